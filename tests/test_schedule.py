"""The schedule: its byte totals equal the formulas, and the verifier catches broken invariants.

Pure tests: `sl.plan` compiles with fake tensors, with no process group and no
real weights.
"""

from __future__ import annotations

import json
import math

import attrs
import pytest
import torch
import torch.distributed as dist

import shardlang as sl
from shardlang.step.batch import split_batch
from shardlang.compiler.schedule.schedule import OpKind

from models import CASES, load_gpt_module


def plan_case(case_name, world_size, dtype=torch.float32, **options):
    case = CASES[case_name]
    spec = sl.Spec(mesh=sl.Mesh(fsdp=world_size), units=case.units, options=sl.Options(**options))
    batch = split_batch(case.make_batch(0, dtype), world_size, 0)
    return sl.plan(case.build(dtype), case.loss_fn, spec, example_batch=batch, world_size=world_size,
                   check_each_pass=True)


def padded_bytes(schedule, model, world_size, trainable_only=False):
    """M from first principles: each flat parameter's members concatenated whole and padded once to a multiple
    of N (Note [whole-flat shards]); together the flat parameters hold every parameter of the model once."""
    assert sum(f.numel for f in schedule.flats) == sum(p.numel() for p in model.parameters())  # tied ones once
    flats = [f for f in schedule.flats if f.sharded and (f.trainable or not trainable_only)]
    return sum(math.ceil(f.numel / world_size) * world_size * f.element_size for f in flats)


def regathered(schedule):
    return {op.flat for op in schedule.ops if op.kind is OpKind.ALL_GATHER and op.detail}


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("case_name", ["mlp", "gpt_tiny", "prime", "frozen", "convnet_bn"])
def test_bytes_follow_the_formula(case_name, world_size):
    schedule = plan_case(case_name, world_size).schedule
    model = CASES[case_name].build()
    m_all = padded_bytes(schedule, model, world_size)
    m_trainable = padded_bytes(schedule, model, world_size, trainable_only=True)
    again = sum(schedule.flat(f).padded_bytes for f in regathered(schedule))
    summary = schedule.summary
    # Full sharding: gather everything once for forward, again for backward what it re-gathers,
    # reduce-scatter every trainable gradient once; a world of one reduces nothing, its AdamW updates
    # read member gradients (Note [updates from member gradients]).
    assert summary.bytes_per_rank["all_gather"] == m_all + again
    assert summary.bytes_per_rank["reduce_scatter"] == (m_trainable if world_size > 1 else 0)
    if world_size > 1:
        assert summary.wire_bytes_per_rank["reduce_scatter"] == round(m_trainable * (world_size - 1) / world_size)


@pytest.mark.parametrize("world_size", [2, 4])
def test_without_resharding_gathers_once(world_size):
    schedule = plan_case("gpt_tiny", world_size, reshard_after_forward=False).schedule
    m = padded_bytes(schedule, CASES["gpt_tiny"].build(), world_size)
    assert schedule.summary.bytes_per_rank == {"all_gather": m, "reduce_scatter": m, "all_reduce": 0}
    assert not regathered(schedule)


def test_regathers_every_block_but_the_last():
    """Blocks are re-gathered for backward; the last block and the root stay gathered (Note [keep the last unit])."""
    gpt = load_gpt_module()
    spec = sl.Spec(mesh=sl.Mesh(fsdp=4), units=["blocks.*"])
    batch = split_batch(gpt.make_batch(0), 4, 0)
    build = lambda: gpt.make_gpt(n_layer=4)  # noqa: E731
    schedule = sl.plan(build, gpt.loss_fn, spec, example_batch=batch, world_size=4).schedule
    assert regathered(schedule) == {"blocks.0", "blocks.1", "blocks.2"}
    m = padded_bytes(schedule, build(), 4)
    assert schedule.summary.bytes_per_rank["all_gather"] == m + sum(schedule.flat(f"blocks.{i}").padded_bytes
                                                                   for i in range(3))


def test_planning_needs_no_process_group_and_no_memory():
    """A 1.3B-parameter GPT plans on fake tensors: nothing is allocated, no process group exists."""
    gpt = load_gpt_module()
    build = lambda: gpt.make_gpt(n_layer=24, n_embd=2048, n_head=16, vocab_size=50304, block_size=32)  # noqa: E731
    spec = sl.Spec(mesh=sl.Mesh(fsdp=64), units=["blocks.*"])
    batch = torch.zeros(1, 33, dtype=torch.long)
    compiled = sl.plan(build, gpt.loss_fn, spec, example_batch=batch, world_size=64)
    assert not dist.is_initialized()
    params = sum(f.numel for f in compiled.schedule.flats)
    assert params > 1.2e9
    assert compiled.schedule.summary.bytes_per_rank["reduce_scatter"] >= params * 4


def test_json_has_the_documented_keys():
    schedule = plan_case("gpt_tiny", 2).schedule
    data = json.loads(schedule.to_json())
    assert data["world_size"] == 2
    assert {"kind", "unit", "bytes"} <= set(data["ops"][0])
    assert set(data["bytes_per_rank"]) >= {"all_gather", "reduce_scatter"}
    assert data["bytes_per_rank"]["all_gather"] == sum(op["bytes"] for op in data["ops"] if op["kind"] == "all_gather")


def test_every_rank_derives_the_same_schedule():
    assert plan_case("gpt_tiny", 4).schedule.digest() == plan_case("gpt_tiny", 4).schedule.digest()
    assert plan_case("gpt_tiny", 4).schedule.digest() != plan_case("gpt_tiny", 2).schedule.digest()


def test_table_shows_every_op():
    schedule = plan_case("mlp", 2).schedule
    table = schedule.table()
    assert len(table.splitlines()) == len(schedule.ops) + 2
    assert "all_gather" in table and "reduce_scatter" in table and "free" in table
    assert "reduce_scatter" in schedule.summary_text()


# ---- the verifier catches what it promises to catch -------------------------------------------


def broken(schedule, drop=None, replace=None):
    ops = list(schedule.ops)
    if drop is not None:
        ops = [op for op in ops if not drop(op)]
    if replace is not None:
        ops = [replace(op) for op in ops]
    ops = [attrs.evolve(op, index=i) for i, op in enumerate(ops)]
    return attrs.evolve(schedule, ops=tuple(ops))


@pytest.fixture(scope="module")
def good():
    schedule = plan_case("gpt_tiny", 4).schedule
    sl.verify(schedule)
    return schedule


def test_verifier_catches_a_missing_wait(good):
    first_wait = next(op for op in good.ops if op.kind is OpKind.WAIT)
    with pytest.raises(sl.ScheduleError, match=f"h{first_wait.handle}"):
        sl.verify(broken(good, drop=lambda op: op is first_wait))


def test_verifier_catches_a_missing_free(good):
    with pytest.raises(sl.ScheduleError, match="never freed|gathers blocks.0 again"):
        sl.verify(broken(good, drop=lambda op: op.kind is OpKind.FREE and op.flat == "blocks.0"))


def test_verifier_catches_a_use_after_free(good):
    free = next(op for op in good.ops if op.kind is OpKind.FREE and op.flat == "blocks.0")
    ops = [op for op in good.ops if op is not free]
    ops.insert(next(i for i, op in enumerate(ops) if op.kind is OpKind.ALL_GATHER and op.flat == "blocks.0"
                    and op.detail) - 0, free)
    late_use = attrs.evolve(good, ops=tuple(attrs.evolve(op, index=i) for i, op in enumerate(ops)))
    sl.verify(late_use)  # moving the free later is fine while nothing else gathers blocks.0...
    early = [op for op in good.ops if op is not free]
    early.insert(next(i for i, op in enumerate(early) if op.kind is OpKind.WAIT and op.flat == "blocks.0") + 1, free)
    with pytest.raises(sl.ScheduleError, match="blocks.0"):
        sl.verify(attrs.evolve(good, ops=tuple(attrs.evolve(op, index=i) for i, op in enumerate(early))))


def test_verifier_catches_a_gradient_reduced_twice(good):
    rs = next(op for op in good.ops if op.kind is OpKind.REDUCE_SCATTER)
    twice = list(good.ops) + [attrs.evolve(rs, handle=999), attrs.evolve(rs, kind=OpKind.WAIT, handle=999)]
    with pytest.raises(sl.ScheduleError, match="reduced 2 times"):
        sl.verify(attrs.evolve(good, ops=tuple(attrs.evolve(op, index=i) for i, op in enumerate(twice))))


def test_verifier_catches_a_gradient_never_reduced_unless_the_world_is_one(good):
    """Only a world of one may leave a trainable gradient unreduced (Note [updates from member gradients])."""
    rs = next(op for op in good.ops if op.kind is OpKind.REDUCE_SCATTER)
    unreduced = broken(good, drop=lambda op: op.handle == rs.handle)
    with pytest.raises(sl.ScheduleError, match=f"trainable {rs.flat} has its gradient reduced 0 times"):
        sl.verify(unreduced)
    one = plan_case("gpt_tiny", 1).schedule
    assert not [op for op in one.ops if op.kind in (OpKind.REDUCE_SCATTER, OpKind.ALL_REDUCE)]
    sl.verify(one)


def test_verifier_catches_an_optimizer_touching_the_whole_parameter(good):
    whole = broken(good, replace=lambda op: attrs.evolve(op, numel=op.numel * 4) if op.kind is OpKind.OPTIMIZER
                   else op)
    with pytest.raises(sl.ScheduleError, match="touches"):
        sl.verify(whole)


def test_memory_budget_picks_a_prefetch_that_fits_at_the_least_predicted_time():
    gpt = load_gpt_module()
    build = lambda: gpt.make_gpt(n_layer=4)  # noqa: E731
    batch = split_batch(gpt.make_batch(0), 4, 0)

    def planned(**options):
        spec = sl.Spec(mesh=sl.Mesh(fsdp=4), units=["blocks.*"], options=sl.Options(**options))
        return sl.plan(build, gpt.loss_fn, spec, example_batch=batch, world_size=4)

    peaks = {d: planned(prefetch=d).memory.peak for d in range(6)}  # 5 units: root and 4 blocks
    assert peaks[0] < peaks[2]  # prefetching deeper keeps more units gathered
    assert all(peaks[d] <= peaks[d + 1] for d in range(5))  # never less: what the search relies on
    chosen = planned(memory_budget=peaks[1])  # fits without recompute: only the depth is chosen
    assert chosen.schedule.options["prefetch"] >= 1 and "recompute" not in chosen.schedule.options
    assert chosen.memory.peak <= peaks[1]
    fitting = [c for c in chosen.budget.tried if c.peak <= peaks[1]]
    assert chosen.budget.chosen.step_time_s == min(c.step_time_s for c in fitting)
    with pytest.raises(sl.SpecError, match="no configuration fits. The leanest"):
        planned(memory_budget=peaks[0] // 4)
