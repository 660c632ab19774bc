"""The static memory plan: checked against memory measured on real ranks, and its bookkeeping on its own.

Acceptance (issue 3): the plan's peak is within 10% of the measured peak for the
GPT example at N=2 and N=4, on every rank. The measure is glibc's mallinfo2
sampled after every node of a real step (`memory_workers.measure_job`), so it
sees gloo's threads too. Measured on this project's 2-core CI machine (bytes
per rank, plan / measured):

    N=2   2,339,892 / 2,391,776   -2.2%   both at node gelu_backward (op 14)
    N=4   1,449,504 / 1,490,640   -2.8%   both at node addmm_3 (op 7, the next unit's gather in flight)

The plan is slightly under because the measure also holds malloc's chunk
headers and the tensors' own objects (about 0.5 KiB per live tensor).
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import torch
from torch import nn

import memory_workers
import shardlang as sl
from shardlang.compiler.analysis.memory import NO_SCRATCH, Category, gloo_scratch, plan_memory
from shardlang.compiler.schedule.schedule import OpKind
from shardlang.cli.common import rank_batch
from shardlang.cli.job import build, load_job

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "examples" / "gpt.py")
TOLERANCE = 0.10  # fixed by the issue: plan peak within 10% of the measured peak


def plan_job(path: str, world: int, spec_file: str | None = None, **spec_options):
    job = load_job(path, spec_file)
    spec = job.spec if not spec_options else sl.Spec(job.spec.mesh, rules=job.spec.rules, units=job.spec.units,
                                                        options=sl.Options(**spec_options))
    batch = rank_batch(job, 0, world, 0)  # rank 0's rows, which ranks of one tp group share
    return sl.plan(lambda: build(job), job.loss_fn, spec, optimizer=job.optimizer, example_batch=batch,
                   world_size=world)


@pytest.fixture(scope="module")
def gpt_plans():
    return {n: plan_job(GPT, n) for n in (1, 2, 4)}


# ---- against a measurement ---------------------------------------------------------


def assert_plan_meets_the_measure(plan, results, mesh: str):
    """Each rank's measured samples against ``plan``: the peak within `TOLERANCE`, and node by node the plan an
    upper bound up to allocator overhead (it never misses a tenth of the peak)."""
    during = {n.name: n.during for n in plan.nodes if n.op is not None}  # inputs are in every sample
    for rank, result in enumerate(results):
        samples = result["samples"]
        measured = max(nbytes for _, nbytes in samples)
        assert result["input_bytes"] == pytest.approx(plan.persistent, abs=4096)  # the batch's storage is shared
        error = (plan.peak - measured) / measured
        assert abs(error) <= TOLERANCE, (
            f"{mesh} rank {rank}: plan peak {plan.peak} B (op {plan.peak_op}, {plan.peak_node}) vs measured "
            f"{measured} B: {100 * error:+.1f}% (tolerance {100 * TOLERANCE:.0f}%)")
        worst = max((nbytes - during[name], name) for name, nbytes in samples if name in during)
        assert worst[0] <= TOLERANCE * measured, f"{mesh} rank {rank}: node {worst[1]} measured {worst[0]} B more"


@pytest.mark.parametrize("world", [2, 4])
def test_plan_peak_is_within_10_percent_of_the_measured_peak(run_on, gpt_plans, world):
    plan = gpt_plans[world].memory  # fake tensors, no process: the plan a user reads before running
    assert_plan_meets_the_measure(plan, run_on(world, memory_workers.measure_job, GPT), f"N={world}")


LLAMA, LLAMA_TP = str(ROOT / "examples" / "llama.py"), str(ROOT / "examples" / "llama_tp.toml")


def test_on_a_2d_mesh_the_plan_peak_is_within_10_percent_of_the_measured_peak(run_on):
    """At fsdp=2 x tp=2 (examples/llama_tp.toml): the same measure, every rank, with the tp collectives' buffers
    in the samples as the data axis's are."""
    plan = plan_job(LLAMA, 4, spec_file=LLAMA_TP).memory
    assert_plan_meets_the_measure(plan, run_on(4, memory_workers.measure_job, LLAMA, 1, LLAMA_TP), "2x2")


# ---- the bookkeeping (no processes) ------------------------------------------------


def test_every_byte_is_accounted_for(gpt_plans):
    plan = gpt_plans[2].memory
    assert plan.peak == max(n.during for n in plan.nodes) == sum(plan.breakdown.values())
    for op in plan.ops:
        if op.breakdown:
            assert sum(op.breakdown.values()) == op.peak >= op.live_after
    held = [Category.REDUCTION_BUFFERS, Category.BUFFER_POOL]  # held since the step before: live from the start
    live = sum(plan.breakdown[c.value] for c in held)
    assert plan.breakdown[Category.BUFFER_POOL.value] > 0  # the pool's slots that do not raise the peak
    for node in plan.nodes:
        assert node.during == live + node.allocated - node.released and node.after == node.during - node.freed
        live = node.after
    persistent = sum(plan.breakdown[c.value] for c in (Category.PARAMETERS, Category.OPTIMIZER_STATE, Category.INPUTS,
                                                       *held))
    assert persistent == plan.persistent
    assert plan.nodes[-1].after - plan.persistent < 64  # after the step: the inputs and the 0-d loss


def test_the_plan_is_made_once_per_compiled_step(gpt_plans):
    compiled = gpt_plans[2]
    assert compiled.memory is compiled.memory
    assert attrs.evolve(compiled).memory is not compiled.memory  # a new step plans its own


def test_persistent_bytes_are_the_shards_and_optimizer_state(gpt_plans):
    for world, compiled in gpt_plans.items():
        schedule = compiled.schedule
        shards = sum(f.local_numel * f.element_size for f in schedule.flats)
        breakdown = compiled.memory.breakdown
        assert breakdown["parameters"] == shards
        assert breakdown["optimizer_state"] == 2 * shards + 2 * 8  # AdamW's two moments, the step, lr


def test_a_world_of_one_gathers_nothing(gpt_plans):
    plan = gpt_plans[1].memory
    assert plan.scratch == NO_SCRATCH
    assert all(op.breakdown.get("gathered", 0) == 0 and op.breakdown.get("collective_scratch", 0) == 0
               for op in plan.ops)


def test_gathered_units_live_from_gather_to_free(gpt_plans):
    compiled = gpt_plans[4]
    plan = plan_memory(compiled.graph_module, compiled.schedule, compiled.context.inputs, scratch=NO_SCRATCH)
    ops = compiled.schedule.ops
    for op in ops:
        if op.kind is OpKind.FREE:
            assert plan.ops[op.index].freed >= op.bytes  # the gathered buffer goes back at its free
    assert all(o.breakdown.get("collective_scratch", 0) == 0 for o in plan.ops)
    after_last_free = max(op.index for op in ops if op.kind is OpKind.FREE)
    assert all(o.breakdown.get("gathered", 0) == 0 for o in plan.ops[after_last_free + 1:] if o.breakdown)


def test_gloo_scratch_is_held_from_issue_to_wait(gpt_plans):
    compiled = gpt_plans[2]
    with_scratch = compiled.memory
    without = plan_memory(compiled.graph_module, compiled.schedule, compiled.context.inputs, scratch=NO_SCRATCH)
    scratch = gloo_scratch(2)
    ops = compiled.schedule.ops
    issue = next(op for op in ops if op.kind is OpKind.REDUCE_SCATTER)
    wait = next(op for op in ops if op.kind is OpKind.WAIT and op.handle == issue.handle)
    extra = int(scratch["reduce_scatter"] * issue.bytes)
    for i in range(issue.index, wait.index):  # in flight: the extra bytes at least (others may be in flight too)
        assert with_scratch.ops[i].live_after - without.ops[i].live_after >= extra
    assert with_scratch.nodes[-1].after == without.nodes[-1].after


def test_full_sharding_peaks_lower_than_keeping_units_gathered():
    # N=2: at N=4 ZeRO-2's peak is the root unit's gradient reduction (on gloo an all-to-all holds its input and
    # its full-size result until the wait), where no block is gathered any more in either strategy.
    # Without the buffer pool, so that gathered units are counted as such (ZeRO-2's pool holds them otherwise).
    zero3 = plan_job(GPT, 2, buffer_pool=False).memory
    zero2 = plan_job(GPT, 2, reshard_after_forward=False, buffer_pool=False).memory
    assert zero3.peak < zero2.peak
    assert zero2.breakdown["gathered"] > zero3.breakdown["gathered"]
    pooled = plan_job(GPT, 2, reshard_after_forward=False).memory
    assert pooled.peak == zero2.peak and pooled.breakdown["gathered"] + pooled.breakdown["buffer_pool"] >= \
        zero2.breakdown["gathered"]


def test_views_and_in_place_updates_allocate_nothing():
    # One Linear layer, SGD in place: the update's mutations and the weight's views cost no bytes.
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    batch = (torch.randn(2, 8), torch.randn(2, 4))
    compiled = sl.plan(model, lambda m, b: (m(b[0]) - b[1]).pow(2).mean(), sl.Spec(sl.Mesh(fsdp=-1)),
                       optimizer=sl.SGD(lr=0.1), example_batch=batch, world_size=2)
    plan = compiled.memory
    nodes = {n.name: n for n in compiled.graph_module.graph.nodes}
    for record in plan.nodes:
        node = nodes[record.name]
        schema = getattr(node.target, "_schema", None)
        if (schema is not None and schema.is_mutable) or getattr(node.target, "is_view", False):
            assert record.allocated == 0, record
    updates = [op for op in plan.ops if compiled.schedule.ops[op.index].kind is OpKind.OPTIMIZER]
    assert updates and all(op.allocated <= op.freed + 64 for op in updates)  # temporaries come and go


@pytest.mark.parametrize("rule, copies", [(sl.shard("fsdp"), False), (sl.shard("fsdp", dim=0), True)])
def test_a_unit_sharded_flat_is_gathered_as_views_and_one_sharded_along_a_dim_is_copied_out(rule, copies):
    """Note [whole-flat shards]: a gathered member of a whole flat is a view of the gathered buffer, which lives
    until the unit's free; in the pieces layout each member is a copy and the buffer dies after the copies."""
    from shardlang.compiler.layout.flat import FlatLayout
    from shardlang.compiler.ir.graph_utils import unpack_copies
    from shardlang.compiler.ir.tags import NodeKind, kind_of

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 4))
    batch = (torch.randn(2, 8), torch.randn(2, 4))
    compiled = sl.plan(model, lambda m, b: (m(b[0]) - b[1]).pow(2).mean(), sl.Spec(sl.Mesh(fsdp=-1), rules=[("*", rule)]),
                       optimizer=sl.SGD(lr=0.1), example_batch=batch, world_size=2)
    assert {f.layout for f in compiled.flats} == {FlatLayout.PIECES if copies else FlatLayout.WHOLE}
    unpacks = [n for n in compiled.graph_module.graph.nodes if kind_of(n) is NodeKind.UNPACK]
    assert len(unpacks) >= 4  # two weights and two biases, gathered for forward (and again for backward)
    assert all(unpack_copies(n) is copies for n in unpacks)
    gathered = {r.name: r for r in compiled.memory.nodes}
    allocated = sum(gathered[n.name].allocated for n in unpacks)
    assert (allocated > 0) is copies  # views allocate nothing
