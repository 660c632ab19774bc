"""``tune`` on a mesh with a tensor axis: the tp degree searched with the FSDP layouts (Note [tensor degrees]).

The job's rules say how tp splits each parameter; the search tries every degree
that divides the world and the node, degree 1 being the job's rules on the data
axes alone, each with the global batch cut in world / t parts. Tests: the
layouts at each degree, the batch each compiles for, a degree the model's dims
do not take left out with its reason, a tp degree chosen where the data link is
slow, its sequence and loss parallelism varied once it leads, and the written
spec planning to what the search predicted.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import shardlang as sl
from shardlang.cli import main
from shardlang.cli.common import batch_part
from shardlang.cli.job import build, load_job
from shardlang.compiler import CostModel, make_plan
from shardlang.compiler.analysis.cost import LINKS, LinkModel
from shardlang.spec.tensor_axes import is_tensor_axis
from shardlang.tune import layouts, tune
from shardlang.tune.search import Job, _spec_of

ROOT = Path(__file__).resolve().parents[1]
LLAMA, LLAMA_TP = str(ROOT / "examples" / "llama.py"), str(ROOT / "examples" / "llama_tp.toml")
SLOW_DATA = CostModel(axis_links={"fsdp": LinkModel("slow", alpha_s=1e-4, bandwidth=2e7, backend="gloo"),
                                  "replicate": LinkModel("slow", alpha_s=1e-4, bandwidth=2e7, backend="gloo"),
                                  "tp": LINKS["gloo-loopback"]})


def _job(monkeypatch, global_batch: int):
    monkeypatch.setenv("LLAMA_BATCH", str(global_batch))
    return load_job(LLAMA, LLAMA_TP)


def test_layouts_at_every_tp_degree_of_the_node_with_the_job_s_degree_first(monkeypatch):
    job = _job(monkeypatch, 8)
    found = layouts(build(job), job.spec, 8, node_size=4)
    assert len(found) == len(set(found))
    assert [lay.tensor for lay in found][0] == 2  # the job's own degree (llama_tp.toml: tp = 2) comes first
    assert {lay.tensor for lay in found} == {1, 2, 4}
    for lay in found:
        axes = dict(lay.mesh.axes)
        assert axes.get("tp", 1) == lay.tensor and sl.Mesh(**axes).size == 8
        assert list(axes)[-1] == "tp" if lay.tensor > 1 else "tp" not in axes  # tp innermost: inside a node
        assert not (lay.sequence_parallel or lay.loss_parallel)  # the job's; varied only once a layout leads
    single = next(lay for lay in found if lay.tensor == 1)
    rules = _spec_of(job.spec, single, None).rules
    assert all(not is_tensor_axis(getattr(r.layout, "axis", "")) and not isinstance(r.layout, tuple) for r in rules)
    engine = Job(lambda: build(job), job.loss_fn, job.spec, job.optimizer, batch_part(job, 0, 8, 0), 8, None,
                 CostModel(), lambda parts: batch_part(job, 0, parts, 0))
    assert {lay.tensor: engine.batch_of(lay).shape[0] for lay in found} == {1: 1, 2: 2, 4: 4}  # tp peers share


def test_a_slow_data_link_chooses_tp_leaves_out_what_the_dims_refuse_and_plans_as_predicted(monkeypatch):
    world = 6  # degrees 1, 2, 3, 6: the tiny Llama's 64-wide projections take 2, not 3 or 6
    job = _job(monkeypatch, 12)
    lines: list[str] = []
    result = tune(lambda: build(job), job.loss_fn, job.spec, job.optimizer, batch_part(job, 0, world, 0), world,
                  None, SLOW_DATA, say=lines.append, workers=2, node_size=6,
                  batch_for=lambda parts: batch_part(job, 0, parts, 0))
    refused = {lay.tensor for lay, _ in result.skipped}
    assert refused == {3, 6}
    assert all("which 3 ranks do not divide" in why or "which 6 ranks do not divide" in why
               for _, why in result.skipped)
    assert sum(line.startswith("skipped  every layout at tp=") for line in lines) == 2  # once per degree
    best = result.best
    assert best.layout.tensor == 2  # FSDP's bytes over the slow link halve; tp's move on the fast one
    seen = [e.layout for e in result.fitting] + [b.layout for b in result.bounded] + [u.layout for u in result.unfit]
    assert any(lay.tensor == 1 for lay in seen)  # FSDP alone was a candidate
    assert {(e.layout.sequence_parallel, e.layout.loss_parallel) for e in result.fitting
            if e.layout.tensor == 2} == {(sp, lp) for sp in (True, False) for lp in (True, False)}
    again = sl.plan(lambda: build(job), job.loss_fn, best.spec, optimizer=job.optimizer,
                    example_batch=batch_part(job, 0, world // 2, 0), world_size=world)
    plan = make_plan(again, cost_model=SLOW_DATA)
    assert (plan.memory.peak, plan.timeline.step_time_s) == (best.peak, best.step_time_s)
    assert dict(best.spec.mesh.axes)["tp"] == 2


def test_tune_on_a_tensor_axis_needs_the_batch_of_each_degree():
    with pytest.raises(sl.SpecError, match="needs batch_for"):
        tune(lambda: None, None, sl.Spec(sl.Mesh(fsdp=-1, tp=2)), sl.AdamW(lr=1e-3), None, 4, None, CostModel())


def test_the_command_tunes_the_tp_degree_and_writes_a_spec_plan_takes(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("LLAMA_BATCH", "8")
    out = tmp_path / "spec.toml"
    assert main(["tune", LLAMA, "--spec", LLAMA_TP, "--world", "2", "--node-size", "2", "--jobs", "2",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "mesh fsdp=1 x tp=2" in text and "mesh fsdp=2," in text  # both degrees were planned
    assert main(["plan", LLAMA, "--spec", str(out), "--world", "2"]) == 0


_FORKED_AFTER_OPENMP = '''
import os, sys
import torch
from shardlang.cli.common import batch_part
from shardlang.cli.job import build, load_job
from shardlang.compiler import CostModel
from shardlang.tune import tune

os.environ["LLAMA_BATCH"] = "4"
job = load_job(sys.argv[1], sys.argv[2])
torch.ones(1 << 22).add_(1)  # the parent's OpenMP threads have run, as cutting a large global batch does


def batch_for(parts):
    torch.ones(1 << 22).add_(1)  # a parallel region in the forked worker that asks for its batch
    return batch_part(job, 0, parts, 0)


result = tune(lambda: build(job), job.loss_fn, job.spec, job.optimizer, batch_part(job, 0, 2, 0), 2, None,
              CostModel(), workers=2, node_size=2, batch_for=batch_for)
print("chose", result.best.one_line())
'''


def test_forked_workers_compile_after_the_parents_openmp_threads_ran(tmp_path):
    """libgomp is not fork-safe: a forked worker whose first parallel region comes after the parent's OpenMP
    threads ran waited forever (the 70B search with a tensor axis never returned). A hang here is a timeout."""
    import subprocess
    import sys

    script = tmp_path / "forked.py"
    script.write_text(_FORKED_AFTER_OPENMP)
    done = subprocess.run([sys.executable, str(script), LLAMA, LLAMA_TP], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "chose " in done.stdout
