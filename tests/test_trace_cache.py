"""Traces shared by configurations that trace the same step (Note [shared traces] in compiler/trace_cache.py).

Layouts that differ only in strategy and mesh split (what `shardlang tune` compiles dozens of at one tp degree)
compile from one trace, and each compiles to exactly what it compiles to traced on its own: the same graph, the
same schedule, the same memory plan and prediction. Other units or another tp degree trace again.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
from torch._subclasses.fake_tensor import FakeTensorMode

import shardlang as sl
from shardlang.cli.common import batch_part
from shardlang.cli.job import build, load_job
from shardlang.compiler import make_plan
from shardlang.compiler.trace_cache import TraceCache

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _same(a, b) -> bool:
    pa, pb = make_plan(a), make_plan(b)
    return (a.graph_module.code == b.graph_module.code and str(a.schedule) == str(b.schedule)
            and pa.memory.peak == pb.memory.peak and pa.timeline.step_time_s == pb.timeline.step_time_s)


@pytest.mark.parametrize("job_file, spec_file, meshes", [
    ("gpt.py", None, [{"fsdp": 4}, {"replicate": 2, "fsdp": 2}]),
    ("llama.py", "llama_tp.toml", [{"fsdp": 2, "tp": 2}, {"replicate": 2, "fsdp": 1, "tp": 2}]),
], ids=["gpt", "llama-tp"])
def test_layouts_of_one_trace_compile_as_if_each_were_traced_alone(monkeypatch, job_file, spec_file, meshes):
    monkeypatch.setenv("LLAMA_BATCH", "8")
    job = load_job(EXAMPLES / job_file, EXAMPLES / spec_file if spec_file else None)
    world = 4
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = build(job)
    traces = TraceCache()
    compiled = 0
    for mesh in meshes:
        for strategy in ("zero3", "zero2", "zero1"):
            spec = attrs.evolve(job.spec, mesh=sl.Mesh(**mesh),
                                strategies=sl.Spec.from_dict({"mesh": mesh, "strategies": [
                                    {"pattern": "*", "strategy": strategy}]}).strategies)
            batch = batch_part(job, 0, world // mesh.get("tp", 1), 0)
            kwargs = dict(optimizer=job.optimizer, example_batch=batch, world_size=world)
            alone = sl.plan(lambda: build(job), job.loss_fn, spec, **kwargs)
            shared = sl.plan(model, job.loss_fn, spec, traces=traces, **kwargs)
            assert _same(alone, shared), (mesh, strategy)
            compiled += 1
    assert traces.hits == compiled - 1  # one trace served them all

    other_units = attrs.evolve(job.spec, mesh=sl.Mesh(**meshes[0]), units=())  # the whole model as one unit
    before = traces.hits
    sl.plan(model, job.loss_fn, other_units, optimizer=job.optimizer, world_size=world, traces=traces,
            example_batch=batch_part(job, 0, world // meshes[0].get("tp", 1), 0))
    assert traces.hits == before  # other units: another trace
