"""The DDP strategy's all-reduce buffers, kept between steps (Note [kept reduction buffers]).

- parity with one process (float64, within 1e-9) at N = 1, 2, 4 with the buffers kept;
- kept and freed train alike to the bit (float32), and the kept buffers are the same
  storage at every step, reduced in place; a second batch shape has buffers of its own;
- the memory plan counts them as state, reduced and averaged in place, and only where they are kept: replicated
  gradients all-reduced over more than one rank, with the option on and the eager backend.
"""

from __future__ import annotations

import pytest
import torch

import shardlang as sl
from shardlang.step.batch import split_batch
from shardlang.compiler.analysis.memory import PERSISTENT
from shardlang.compiler.ir.tags import is_kept

import kept_buffer_workers as w
import strategy_workers
from models import CASES
from test_strategies import STEPS, check_parity


def _plan(case_name: str, world: int, strategy: str = "ddp", rules=None, **options):
    case = CASES[case_name]
    spec = sl.Spec.from_dict({"mesh": {"fsdp": world}, "units": list(case.units),
                              "strategies": [{"pattern": "*", "strategy": strategy}],
                              **({"rules": rules} if rules else {}), "options": options})
    return sl.plan(case.builder, case.loss_fn, spec, optimizer=sl.AdamW(lr=1e-3),
                   example_batch=split_batch(case.make_batch(0), world, 0), world_size=world)


def _kept_bytes(compiled) -> int:
    """What the kept packs hold: each a replicated flat's whole gradient, in its reduce dtype."""
    kept = [n for n in compiled.graph_module.graph.nodes if is_kept(n)]
    return sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in kept)


# ---- parity and reuse (processes) ------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ddp_with_kept_buffers_trains_like_one_process(run_on, references, world_size):
    spec = {"mesh": {"fsdp": world_size}, "strategies": [{"pattern": "*", "strategy": "ddp"}],
            "options": {"keep_reduction_buffers": True}}
    results = run_on(world_size, strategy_workers.train_with_spec, "gpt_tiny", "adamw", spec, STEPS)
    check_parity(results, references("gpt_tiny", "adamw"), world_size)


def test_kept_and_freed_buffers_train_alike_to_the_bit(run_on):
    for rank, (kept, freed) in enumerate(run_on(2, w.kept_and_freed_alike, "gpt_tiny")):
        assert kept[2] == 3 and freed[2] == 0  # the root and two blocks: three all-reduces, each kept
        assert torch.equal(kept[0], freed[0]), f"rank {rank}: losses differ"
        assert all(torch.equal(kept[1][name], freed[1][name]) for name in freed[1]), f"rank {rank}"


def test_the_kept_buffers_are_the_same_storage_at_every_step(run_on):
    for before, pointers, all_reduces in run_on(2, w.pointers_over_steps, "gpt_tiny"):
        assert before == [None, None, None]  # allocated by the first step, not by binding
        assert len(pointers[0]) == 3 and all(p == pointers[0] for p in pointers[1:])
        assert all_reduces and all(t == "_c10d_functional.all_reduce_.default" for t in all_reduces)


def test_a_second_batch_shape_keeps_buffers_of_its_own(run_on):
    for losses, first, again, second in run_on(2, w.new_batch_shape, "gpt_tiny"):
        assert all(loss == loss for loss in losses)
        assert first == again and len(first) == 3  # the first shape's graph still fills the same buffers
        assert second == [True, True, True]


# ---- the memory plan (no processes) ----------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
def test_the_plan_counts_kept_buffers_as_state(world):
    kept, freed = _plan("gpt_tiny", world), _plan("gpt_tiny", world, keep_reduction_buffers=False)
    nbytes = _kept_bytes(kept)
    gradient = sum(f.numel * f.element_size for f in kept.flats)  # every flat has several members here
    assert nbytes == gradient and _kept_bytes(freed) == 0
    plan = kept.memory
    assert plan.persistent - freed.memory.persistent == nbytes
    assert plan.persistent == sum(plan.breakdown[c.value] for c in PERSISTENT)
    assert all(op.breakdown["reduction_buffers"] == nbytes for op in plan.ops if op.breakdown)
    assert plan.nodes[-1].after - plan.persistent < 64  # after the step: the state and the 0-d loss
    assert all(n.allocated == 0 for n in plan.nodes if n.name in {m.name for m in kept.graph_module.graph.nodes
                                                                  if is_kept(m)})
    # reduced, waited for and averaged in place in the kept buffers, as the bound graph does: no new gradient
    assert max(op.breakdown["gradient_shards"] for op in plan.ops if op.breakdown) == 0
    # not kept, the pack is made every step and the reduction still runs in it: a gradient buffer, no new shard
    assert max(op.breakdown["gradient_shards"] for op in freed.memory.ops if op.breakdown) == 0
    largest = max(f.numel * f.element_size for f in freed.flats)
    assert max(op.breakdown["gradient_buffers"] for op in freed.memory.ops if op.breakdown) >= largest


@pytest.mark.parametrize("world, strategy, options", [
    (1, "ddp", {}),  # nothing is reduced
    (2, "zero1", {}), (2, "zero2", {}), (2, "zero3", {}),  # reduce-scatters: a full gradient would undo the sharding
    (2, "ddp", {"backend": "inductor"}),  # inductor plans its own buffers
    (2, "ddp", {"microbatches": 2}),  # a pack per micro-batch: k buffers per flat would be kept
])
def test_only_all_reduced_gradients_keep_their_buffers(world, strategy, options):
    assert _kept_bytes(_plan("gpt_tiny", world, strategy, **options)) == 0


def test_one_reduction_per_step_keeps_its_buffers_under_accumulation():
    kept = _plan("gpt_tiny", 2, microbatches=2, accumulation="keep")
    assert _kept_bytes(kept) == sum(f.numel * f.element_size for f in kept.flats)


def test_replicated_parameters_of_a_sharded_spec_keep_their_buffers():
    rules = [{"pattern": "*.ln*.*", "layout": "replicate"}, {"pattern": "*", "layout": "shard", "axis": "fsdp"}]
    compiled = _plan("gpt_tiny", 2, "zero3", rules=rules)
    replicated = [f for f in compiled.flats if not f.sharded]
    assert replicated and _kept_bytes(compiled) == sum(f.numel * f.element_size for f in replicated)


def test_the_option_is_checked_and_round_trips(tmp_path):
    with pytest.raises(sl.SpecError, match="keep_reduction_buffers is 'yes'; it must be True or False"):
        sl.Options(keep_reduction_buffers="yes")
    spec = sl.Spec(sl.Mesh(fsdp=2), options=sl.Options(keep_reduction_buffers=False))
    path = tmp_path / "spec.toml"
    path.write_text(spec.to_toml())
    assert sl.Spec.from_toml(path) == spec
    assert "keep_reduction_buffers" not in sl.Options().to_dict()  # the default is left out


def test_a_budget_too_small_for_kept_buffers_names_the_option():
    from shardlang.compiler.analysis.budget import BudgetError

    with pytest.raises(BudgetError, match=r"keep_reduction_buffers=False\): the all-reduce buffers kept"):
        _plan("gpt_tiny", 2, memory_budget=4096)
