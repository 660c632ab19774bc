"""The step's buffer pool (Note [buffer assignment]): gathers and gradient packs in slots held between steps.

- the slot assignment: buffers of one size whose lives do not overlap share a slot, and no others;
- the plan: the pool is its own category, counted as state, and kept only where the planned peak does not rise;
  every pooled value's life is inside its slot's, never overlapping another's;
- parity with one process at N = 1, 2, 4 (the pool on by default), pooled and fresh buffers train alike to the
  bit, and the slots are the same storage at every step.
"""

from __future__ import annotations

import pytest
import torch

import shardlang as sl
from shardlang.compiler.analysis.memory import PERSISTENT, Category
from shardlang.compiler.ir.tags import NodeKind, kind_of, writes_into_slot
from shardlang.compiler.passes.assign_buffers import Life, assign_slots, candidate_lives
from shardlang.step.batch import split_batch

import buffer_pool_workers as w
import strategy_workers
from models import CASES
from test_strategies import STEPS, check_parity


def _plan(case_name: str, world: int, strategy: str, **options):
    case = CASES[case_name]
    spec = sl.Spec.from_dict({"mesh": {"fsdp": world}, "units": list(case.units),
                              "strategies": [{"pattern": "*", "strategy": strategy}], "options": options})
    return sl.plan(case.builder, case.loss_fn, spec, optimizer=sl.AdamW(lr=1e-3),
                   example_batch=split_batch(case.make_batch(0), world, 0), world_size=world)


def _life(name: str, start: int, end: int, numel: int = 8, dtype=torch.float32) -> Life:
    return Life(name, numel, dtype, start, end)


def test_buffers_share_a_slot_only_when_their_lives_do_not_overlap():
    lives = [_life("a", 0, 4), _life("b", 2, 6), _life("c", 5, 9), _life("d", 7, 8), _life("e", 10, 12),
             _life("other size", 1, 2, numel=16), _life("other dtype", 3, 4, dtype=torch.float64)]
    slots = assign_slots(lives)
    assert slots["a"] == slots["c"] and slots["b"] == slots["d"] and slots["a"] != slots["b"]
    assert slots["e"] in (slots["a"], slots["b"])  # both are free again by then
    assert len({slots["a"], slots["b"], slots["other size"], slots["other dtype"]}) == 4
    assert assign_slots([]) == {}


def test_a_buffer_whose_life_ends_where_the_next_begins_gets_a_slot_of_its_own():
    slots = assign_slots([_life("a", 0, 3), _life("b", 3, 5)])  # the node at 3 reads a while b is written
    assert slots["a"] != slots["b"]


@pytest.mark.parametrize("world", [2, 4])
def test_zero2_keeps_its_gathers_and_packs_in_the_pool_without_raising_the_peak(world):
    pooled, fresh = _plan("gpt_tiny", world, "zero2"), _plan("gpt_tiny", world, "zero2", buffer_pool=False)
    slots = [n for n in pooled.graph_module.graph.nodes if kind_of(n) is NodeKind.SLOT]
    assert slots and not any(kind_of(n) is NodeKind.SLOT for n in fresh.graph_module.graph.nodes)
    gathers = [n for n in pooled.graph_module.graph.nodes if kind_of(n) is NodeKind.ALL_GATHER]
    packs = [n for n in pooled.graph_module.graph.nodes if kind_of(n) is NodeKind.PACK]
    assert gathers and all(writes_into_slot(n) for n in gathers)
    assert packs and all(writes_into_slot(n) for n in packs)
    memory = pooled.memory
    assert Category.BUFFER_POOL in PERSISTENT
    pool_bytes = sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in slots)
    assert memory.breakdown[Category.BUFFER_POOL.value] == pool_bytes  # held whole, at the peak too
    assert memory.persistent == fresh.memory.persistent + pool_bytes
    assert memory.peak <= fresh.memory.peak
    assert memory.breakdown[Category.GATHERED.value] < fresh.memory.breakdown[Category.GATHERED.value]
    assert len(slots) < len(gathers) + len(packs)  # some slot serves more than one buffer


@pytest.mark.parametrize("strategy", ["zero3", "zero2", "zero1", "ddp"])
def test_no_two_buffers_in_one_slot_are_alive_at_once(strategy):
    """Lives read off the graph before pooling (same node names); slots off the pooled graph."""
    fresh = _plan("gpt_tiny", 2, strategy, buffer_pool=False).graph_module.graph
    pooled = _plan("gpt_tiny", 2, strategy).graph_module.graph
    lives = {life.node.name: life for life in candidate_lives(fresh)}
    by_slot: dict = {}
    for node in pooled.nodes:
        slot = next((a for a in node.all_input_nodes if kind_of(a) is NodeKind.SLOT), None)
        if slot is not None:
            by_slot.setdefault(slot.name, []).append(lives[node.name])
    for slot, held in by_slot.items():
        held.sort(key=lambda life: life.start)
        for a, b in zip(held, held[1:]):
            assert a.end < b.start, f"{slot}: {a.node.name} lives to {a.end}, {b.node.name} starts at {b.start}"
            assert (a.numel, a.dtype) == (b.numel, b.dtype)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("strategy", ["zero3", "zero2", "zero1", "ddp"])
def test_the_pool_never_raises_the_planned_peak_and_the_plan_adds_only_its_idle_bytes(world, strategy):
    pooled, fresh = _plan("gpt_tiny", world, strategy), _plan("gpt_tiny", world, strategy, buffer_pool=False)
    assert pooled.memory.peak <= fresh.memory.peak
    pool = pooled.memory.breakdown[Category.BUFFER_POOL.value]
    assert pooled.memory.persistent == fresh.memory.persistent + pool
    after = {n.name: n.after for n in fresh.memory.nodes}
    # Node for node, the pooled plan holds what the fresh one does, give or take the pool's bytes.
    for node in pooled.memory.nodes:
        if node.name in after:
            assert after[node.name] - pool <= node.after <= after[node.name] + pool, node.name


def test_the_pool_is_off_where_asked_and_where_it_cannot_serve():
    assert not _slot_nodes(_plan("gpt_tiny", 2, "zero2", buffer_pool=False))
    assert not _slot_nodes(_plan("gpt_tiny", 1, "zero2"))  # one rank: no gathers, no packs
    assert not _slot_nodes(_plan("gpt_tiny", 2, "zero2", backend="inductor"))


def _slot_nodes(compiled) -> list:
    return [n for n in compiled.graph_module.graph.nodes if kind_of(n) is NodeKind.SLOT]


def test_buffer_pool_must_be_a_bool():
    with pytest.raises(sl.SpecError, match="buffer_pool is 'yes'; it must be True or False"):
        sl.Options(buffer_pool="yes")


# ---- processes -------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_a_pooled_step_trains_like_one_process(run_on, references, world_size, strategy):
    spec = {"mesh": {"fsdp": world_size}, "strategies": [{"pattern": "*", "strategy": strategy}],
            "options": {"buffer_pool": True}}
    results = run_on(world_size, strategy_workers.train_with_spec, "gpt_tiny", "adamw", spec, STEPS)
    check_parity(results, references("gpt_tiny", "adamw"), world_size)


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_pooled_and_fresh_buffers_train_alike_to_the_bit_in_slots_held_between_steps(run_on, strategy):
    for rank, (pooled, fresh) in enumerate(run_on(2, w.pooled_and_fresh_alike, "gpt_tiny", strategy)):
        assert torch.equal(pooled[0], fresh[0]), f"rank {rank}: losses differ"
        assert all(torch.equal(pooled[1][n], fresh[1][n]) for n in fresh[1]), f"rank {rank}"
        if strategy == "zero2":
            assert pooled[2][0], "the ZeRO-2 step keeps a pool"
        assert all(p == pooled[2][0] for p in pooled[2]), "the slots are the same storage at every step"
        assert fresh[2] == [[], [], []]


def test_a_tensor_axis_s_shaped_gathers_stay_out_of_the_flat_slots(monkeypatch):
    # loss parallelism gathers each rank's [rows, 1] logit maxima over tp; a flat slot would make them [rows]
    from pathlib import Path

    import attrs

    from shardlang.cli.common import batch_part
    from shardlang.cli.job import build, load_job
    from shardlang.compiler.ir import collectives

    examples = Path(__file__).resolve().parents[1] / "examples"
    monkeypatch.setenv("LLAMA_BATCH", "8")
    job = load_job(examples / "llama.py", examples / "llama_tp.toml")
    spec = attrs.evolve(job.spec, options=attrs.evolve(job.spec.options, sequence_parallel=True, loss_parallel=True))
    step = sl.plan(lambda: build(job), job.loss_fn, spec, optimizer=job.optimizer,
                   example_batch=batch_part(job, 0, 4, 0), world_size=8)
    nodes = list(step.graph_module.graph.nodes)
    pooled = [n for n in nodes if n.target is collectives.all_gather_into]
    shaped = [n for n in nodes if n.target is collectives.all_gather and n.args[0].meta["val"].dim() > 1]
    assert pooled and shaped  # the step pools its flat gathers, and has gathers of shaped activations
    assert all(n.args[0].meta["val"].dim() == 1 for n in pooled)
