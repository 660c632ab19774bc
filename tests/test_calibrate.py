"""``shardlang calibrate`` and ``--calibration``: the probes, the file, and contention in the cost model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import attrs
import pytest

import shardlang as sl
from shardlang.cli import main
from shardlang.compiler import CostModel, make_plan
from shardlang.errors import SpecError
from shardlang.step.batch import split_batch
from shardlang.cli.common import rank_batch
from shardlang.cli.job import build
from shardlang.tune.calibrate import (_gpt_job, beyond_probes, compute_scale, fit_link, read_calibration,
                                      scaled_compute, step_budget)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import gpt  # noqa: E402

GPT = str(Path(__file__).resolve().parents[1] / "examples" / "gpt.py")


def test_calibrate_writes_a_file_that_plan_and_tune_take(tmp_path, capsys):
    out = tmp_path / "machine.json"
    assert main(["calibrate", "--nproc", "2", "--reps", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "alpha" in text and "GFLOP/s" in text and "contention" in text
    raw = json.loads(out.read_text())
    assert raw["link"]["backend"] == "gloo" and raw["link"]["reduce_scatter_as_all_reduce"]
    assert len(raw["samples"]) == 15 and raw["compute_slowdown_under_comm"] >= 1.0
    model = read_calibration(out)
    assert model.link.bandwidth > 0 and model.compute.flops_per_s > 0
    # the compute is scaled so that the cost model predicts the 10M GPT's step measured on the 2 ranks
    fit = raw["step_fit"]
    assert fit["measured_s"] > 0 and fit["predicted_s"] > 0 and 0.25 <= fit["scale"] <= 8
    assert "the 10M GPT's step on 2 ranks" in text
    # Note [the runtime's share]: what the 10M step's process held in use beyond its plan (about 33 MiB here)
    assert isinstance(raw["runtime_bytes"], int) and 0 <= raw["runtime_bytes"] < 256 * 2**20
    job = _gpt_10m()
    planned = sl.plan(lambda: build(job), job.loss_fn, job.spec, optimizer=job.optimizer,
                      example_batch=rank_batch(job, 0, 2, 0), world_size=2)
    if 0.25 < fit["scale"] < 8:
        assert make_plan(planned, cost_model=model).timeline.step_time_s == pytest.approx(fit["measured_s"], rel=1e-3)
    assert main(["plan", GPT, "--world", "2", "--calibration", str(out)]) == 0
    assert "calibrated-gloo" in capsys.readouterr().out


def _calibration_json(**fields) -> dict:
    """A calibration file's JSON object with round numbers, ``fields`` added or replaced."""
    return {"format": "shardlang.calibration", "version": 1, "compute_slowdown_under_comm": 1.0,
            "link": {"name": "x", "alpha_s": 1e-4, "bandwidth": 1e9, "backend": "gloo"},
            "compute": {"name": "y", "flops_per_s": 1e11, "bytes_per_s": 1e10, "op_overhead_s": 1e-5,
                        "view_overhead_s": 1e-6}} | fields


def _gpt_10m():
    return _gpt_job("10M")


def test_the_compute_scale_is_the_factor_that_predicts_the_measured_step():
    model = CostModel()
    predict = lambda m: 3e9 / m.compute.flops_per_s + 1000 * m.compute.op_overhead_s  # noqa: E731 grows with it
    measured = 1.7 * predict(model)
    scale = compute_scale(model, predict, measured)
    assert scale == pytest.approx(1.7, rel=1e-6)
    assert predict(attrs.evolve(model, compute=scaled_compute(model.compute, scale))) == pytest.approx(measured)
    assert compute_scale(model, predict, 100 * measured) == 8.0  # beyond what the range predicts: its end


def test_the_fit_recovers_a_known_link():
    alpha, bandwidth = 50e-6, 2e9
    truth = CostModel().link.__class__("t", alpha_s=alpha, bandwidth=bandwidth, backend="gloo",
                                       reduce_scatter_as_all_reduce=True)
    samples = [(k, p, truth.time(k, 4, p)) for k in ("all_gather", "reduce_scatter", "all_reduce")
               for p in (1 << 16, 1 << 20, 1 << 24)]
    got_alpha, got_bandwidth = fit_link(samples, 4, gloo=True)
    assert got_alpha == pytest.approx(alpha, rel=1e-6) and got_bandwidth == pytest.approx(bandwidth, rel=1e-6)


def test_contention_stretches_compute_that_overlaps_a_collective():
    spec = sl.Spec(mesh=sl.Mesh(fsdp=-1), units=["blocks.*"])
    step = sl.plan(lambda: gpt.GPT(gpt.GPTConfig()), gpt.lm_loss, spec,
                   example_batch=split_batch(gpt.make_tokens(0), 2, 0), world_size=2)
    calm, busy = (make_plan(step, cost_model=CostModel(contention=c)).timeline for c in (1.0, 2.0))
    assert busy.step_time_s > calm.step_time_s and busy.compute_s > calm.compute_s
    model = CostModel(contention=2.0)
    assert model._contended(1.0, 0.0) == 1.0 and model._contended(1.0, 4.0) == 2.0
    assert model._contended(1.0, 1.0) == pytest.approx(1.5)  # half the work while busy (1 s), the rest after


@pytest.mark.parametrize("edit, names", [
    (lambda raw: raw.update(format="other"), "not a shardlang.calibration"),
    (lambda raw: raw["link"].update(bandwidth=-1), "link.bandwidth is -1"),
    (lambda raw: raw["link"].update(backend="mpi"), "link.backend is 'mpi'"),
    (lambda raw: raw["compute"].update(flops_per_s="fast"), "compute.flops_per_s is 'fast'"),
    (lambda raw: raw.update(compute_slowdown_under_comm=0.5), "compute_slowdown_under_comm is 0.5"),
])
def test_a_bad_calibration_file_names_the_field(tmp_path, edit, names):
    raw = _calibration_json(compute_slowdown_under_comm=1.2)
    path = tmp_path / "m.json"
    path.write_text(json.dumps(raw))
    assert read_calibration(path).contention == 1.2
    edit(raw)
    path.write_text(json.dumps(raw))
    with pytest.raises(SpecError, match=names):
        read_calibration(path)


def test_a_budget_with_a_calibration_leaves_out_the_runtimes_share(tmp_path, capsys):
    """Note [the runtime's share]: the step plans within the budget less what the runtime was measured holding."""
    raw = _calibration_json(runtime_bytes=3 * 2**20)
    path = tmp_path / "m.json"
    path.write_text(json.dumps(raw))
    assert step_budget(8 * 2**20, path) == 5 * 2**20
    with pytest.raises(SpecError, match=r"runtime alone holding 3\.00 MiB"):
        step_budget(3 * 2**20, path)
    assert main(["tune", GPT, "--world", "2", "--memory-budget", "5MiB", "--calibration", str(path),
                 "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "the runtime's own 3.00 MiB (measured by the calibration) come off the budget: each step plans within " \
           "2.00 MiB" in out
    assert main(["plan", GPT, "--world", "2", "--memory-budget", "5MiB", "--calibration", str(path)]) == 0
    assert "memory budget 2.00 MiB per rank" in capsys.readouterr().out
    raw.pop("runtime_bytes")  # a calibration from before the field: nothing comes off
    path.write_text(json.dumps(raw))
    assert step_budget(8 * 2**20, path) == 8 * 2**20
    raw["runtime_bytes"] = -1
    path.write_text(json.dumps(raw))
    with pytest.raises(SpecError, match="runtime_bytes is -1"):
        step_budget(8 * 2**20, path)


def test_calibrate_fits_the_step_of_the_job_and_spec_given(tmp_path, capsys, monkeypatch):
    """``--job`` (and ``--spec``): the step factor is fitted on that job's step with that spec, not the 10M GPT's.
    ``--max-payload``: the link is probed up to that size."""
    monkeypatch.setenv("GPT_SIZE", "tiny")  # the ranks inherit it
    job = _gpt_job("tiny")
    ddp = attrs.evolve(job.spec, strategies=(("*", "ddp"),))
    spec_file = tmp_path / "ddp.toml"
    spec_file.write_text(ddp.to_toml())
    out = tmp_path / "machine.json"
    assert main(["calibrate", "--nproc", "2", "--reps", "2", "--job", GPT, "--spec", str(spec_file),
                 "--max-payload", "1MiB", "--out", str(out)]) == 0
    assert f"{GPT}'s step on 2 ranks" in capsys.readouterr().out
    raw = json.loads(out.read_text())
    assert sorted({payload for _, payload, _ in raw["samples"]}) == [2**16, 2**18, 2**20]
    assert len(raw["samples"]) == 9
    fit = raw["step_fit"]
    assert fit["job"] == GPT
    # the unscaled prediction is the probes' model's for the tiny GPT under DDP, and the scale makes it the measured
    fitted = read_calibration(out)
    probed = attrs.evolve(fitted, compute=scaled_compute(fitted.compute, 1 / fit["scale"]))

    def predicted(spec, model):
        planned = sl.plan(lambda: build(job), job.loss_fn, spec, optimizer=job.optimizer,
                          example_batch=rank_batch(job, 0, 2, 0), world_size=2)
        return make_plan(planned, cost_model=model).timeline.step_time_s

    assert predicted(ddp, probed) == pytest.approx(fit["predicted_s"], rel=1e-6)
    assert predicted(job.spec, probed) != pytest.approx(fit["predicted_s"], rel=1e-3)  # the spec file counted
    if 0.25 < fit["scale"] < 8:
        assert predicted(ddp, fitted) == pytest.approx(fit["measured_s"], rel=1e-3)


def test_calibrate_spec_needs_a_job_and_probes_lie_within_64kib_to_1gib(tmp_path, capsys):
    assert main(["calibrate", "--spec", str(tmp_path / "a.toml"), "--out", str(tmp_path / "m.json")]) == 2
    assert "a spec replaces a job's; give the job with --job FILE" in capsys.readouterr().err
    for size in ("1KiB", "2GiB"):
        assert main(["calibrate", "--max-payload", size, "--out", str(tmp_path / "m.json")]) == 2
        assert "the link's probes run from 64.00 KiB to at most 1.00 GiB" in capsys.readouterr().err
    assert not (tmp_path / "m.json").exists()


def test_plan_and_tune_say_when_a_collective_is_larger_than_the_calibration_probed(tmp_path, capsys):
    """A collective larger than any probe is timed by the fit's extrapolation: plan and tune say so, and how far
    to probe (`beyond_probes`); within the probes they say nothing."""
    raw = _calibration_json(samples=[[kind, 2**16, 1e-3] for kind in ("all_gather", "reduce_scatter", "all_reduce")])
    path = tmp_path / "m.json"
    path.write_text(json.dumps(raw))
    assert beyond_probes(2**16, path) is None
    assert beyond_probes(3 * 2**20, path).endswith("shardlang calibrate --max-payload 4MiB)")
    assert beyond_probes(2**20, path).endswith("shardlang calibrate --max-payload 1MiB)")
    assert beyond_probes(2**31, path).endswith("shardlang calibrate --max-payload 1024MiB)")
    # the tiny GPT at N=2: its blocks' gathers move 195.25 KiB, beyond the one 64 KiB probe
    assert main(["plan", GPT, "--world", "2", "--calibration", str(path)]) == 0
    assert ("note: the largest collective moves 195.25 KiB, and the calibration " + str(path) + " probed the link "
            "up to 64.00 KiB: its time is the fit's extrapolation (to probe that far: shardlang calibrate "
            "--max-payload 256KiB)") in capsys.readouterr().out
    assert main(["tune", GPT, "--world", "2", "--calibration", str(path), "--jobs", "1"]) == 0
    assert "its time is the fit's extrapolation" in capsys.readouterr().out
    raw["samples"].append(["all_gather", 2**24, 1e-2])
    path.write_text(json.dumps(raw))
    assert main(["plan", GPT, "--world", "2", "--calibration", str(path)]) == 0
    assert main(["tune", GPT, "--world", "2", "--calibration", str(path), "--jobs", "1"]) == 0
    assert "extrapolation" not in capsys.readouterr().out
