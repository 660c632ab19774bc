"""The cost model: alpha-beta collectives, roofline compute, and the predicted timeline (no processes)."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

import shardlang as sl
from shardlang.step.batch import split_batch
from shardlang.compiler.analysis import cost
from shardlang.compiler.analysis.cost import COMPUTE, LINKS, ComputeModel, CostModel, LinkModel, node_flops
from shardlang.compiler.schedule.schedule import COLLECTIVE_KINDS, OpKind
from shardlang.cli.job import build, global_batch, load_job

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "examples" / "gpt.py")


@pytest.fixture(scope="module")
def gpt4():
    job = load_job(GPT)
    batch = split_batch(global_batch(job, 0), 4, 0)
    return sl.plan(lambda: build(job), job.loss_fn, job.spec, optimizer=job.optimizer, example_batch=batch,
                   world_size=4)


# ---- collectives -----------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4, 7])
def test_alpha_beta_per_kind(n):
    link = LinkModel("test", alpha_s=1e-5, bandwidth=1e9)
    payload = 3 * 2**20
    assert link.time("all_gather", n, payload) == pytest.approx((n - 1) * 1e-5 + (n - 1) / n * payload / 1e9)
    assert link.time("reduce_scatter", n, payload) == link.time("all_gather", n, payload)
    assert link.time("all_reduce", n, payload) == pytest.approx(2 * (n - 1) * 1e-5 + 2 * (n - 1) / n * payload / 1e9)
    gloo_like = attrs.evolve(link, reduce_scatter_as_all_reduce=True)
    assert gloo_like.time("reduce_scatter", n, payload) == link.time("all_reduce", n, payload)


def test_a_world_of_one_communicates_for_free():
    for link in LINKS.values():
        assert all(link.time(k.value, 1, 10**9) == 0 for k in COLLECTIVE_KINDS)


def test_presets_are_ordered_as_the_hardware():
    payload = 64 * 2**20
    times = {name: link.time("all_gather", 8, payload) for name, link in LINKS.items()}
    assert times["nvlink"] < times["infiniband"] < times["gloo-loopback"]
    assert LINKS["gloo-loopback"].backend == "gloo" and LINKS["gloo-loopback"].reduce_scatter_as_all_reduce


def test_unknown_presets_name_the_valid_ones():
    with pytest.raises(sl.SpecError, match="nvlink"):
        cost.link("nvlnk")
    with pytest.raises(sl.SpecError, match="h100-bf16"):
        cost.compute("h100")
    with pytest.raises(ValueError):
        LinkModel("bad", alpha_s=-1.0, bandwidth=1e9)


# ---- compute ---------------------------------------------------------------------


def _traced(fn, *args) -> fx.GraphModule:
    return make_fx(fn, tracing_mode="fake")(*args)


def test_flops_of_matmuls_and_cpu_attention():
    gm = _traced(lambda a, b: a @ b, torch.randn(8, 16), torch.randn(16, 32))
    (mm,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert node_flops(mm) == 2 * 8 * 16 * 32
    q = torch.randn(2, 3, 16, 8)
    gm = _traced(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v), q, q, q)
    flops = sum(node_flops(n) for n in gm.graph.nodes if n.op == "call_function")
    assert flops == 2 * (2 * 2 * 3 * 16 * 16 * 8)  # q @ k^T and p @ v


def test_roofline_takes_the_slower_of_flops_and_bytes():
    gm = _traced(lambda a, b: (a @ b).relu(), torch.randn(64, 64), torch.randn(64, 64))
    mm, relu = [n for n in gm.graph.nodes if n.op == "call_function"]
    device = ComputeModel("test", flops_per_s=1e9, bytes_per_s=1e12, op_overhead_s=1e-6)
    assert device.node_time(mm) == pytest.approx(1e-6 + 2 * 64**3 / 1e9)
    assert device.node_time(relu) == pytest.approx(1e-6 + 2 * 64 * 64 * 4 / 1e12)


# ---- the timeline ----------------------------------------------------------------


def test_timeline_adds_up(gpt4):
    timeline = CostModel().predict(gpt4.schedule, gpt4.graph_module)
    assert timeline.step_time_s == pytest.approx(timeline.compute_s + timeline.exposed_comm_s)
    waits = [s for s in timeline.spans if s.kind == "wait"]
    assert sum(s.duration_s for s in waits) == pytest.approx(timeline.exposed_comm_s)
    assert {s.lane for s in timeline.spans} <= set(timeline.lanes)
    compute = sorted((s for s in timeline.spans if s.lane == "compute"), key=lambda s: s.start_s)
    assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(compute, compute[1:]))  # one compute lane
    comm = sorted((s for s in timeline.spans if s.lane != "compute"), key=lambda s: s.start_s)
    assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(comm, comm[1:]))  # one process group: one queue
    ops = gpt4.schedule.ops
    for span in comm:  # a collective starts once issued, and its wait does not return before it ends
        assert span.start_s >= timeline.op_start_s[span.op] - 1e-12
        wait = next(op for op in ops if op.kind is OpKind.WAIT and op.handle == ops[span.op].handle)
        assert timeline.op_end_s[wait.index] >= span.end_s - 1e-12


def test_free_communication_is_never_exposed(gpt4):
    free = CostModel(link=LinkModel("free", alpha_s=0.0, bandwidth=1e30))
    timeline = free.predict(gpt4.schedule, gpt4.graph_module)
    assert timeline.exposed_comm_s == pytest.approx(0.0, abs=1e-12)
    assert timeline.step_time_s == pytest.approx(timeline.compute_s)


def test_a_slower_link_exposes_more_and_faster_compute_hides_less(gpt4):
    fast = CostModel(link=LINKS["nvlink"], compute=COMPUTE["h100-bf16"]).predict(gpt4.schedule, gpt4.graph_module)
    slow = CostModel(link=LINKS["infiniband"], compute=COMPUTE["h100-bf16"]).predict(gpt4.schedule, gpt4.graph_module)
    assert slow.exposed_comm_s > fast.exposed_comm_s
    assert slow.compute_s == pytest.approx(fast.compute_s)
    separate = CostModel(serialize_collectives=False).predict(gpt4.schedule, gpt4.graph_module)
    assert separate.step_time_s <= CostModel().predict(gpt4.schedule, gpt4.graph_module).step_time_s + 1e-12


def test_op_names_are_index_kind_unit(gpt4):
    names = [cost.op_name(op) for op in gpt4.schedule.ops]
    gather = next(op for op in gpt4.schedule.ops if op.kind is OpKind.ALL_GATHER and op.unit == "blocks.0")
    assert names[gather.index] == f"{gather.index} all_gather blocks.0"
    root = next(op for op in gpt4.schedule.ops if op.unit == "")
    assert names[root.index].endswith("<root>")
