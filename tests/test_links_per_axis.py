"""Links per mesh axis (Note [links per axis]): the cost model, ``--link tp=..,fsdp=..`` and ``calibrate --mesh``."""

from __future__ import annotations

import argparse
import json

import pytest

import shardlang as sl
from models import CASES, EXAMPLES
from shardlang.cli import main
from shardlang.cli.args import LinkPresets, link_presets
from shardlang.compiler import CostModel, LINK_PRESETS
from shardlang.compiler.analysis.cost import group_axes
from shardlang.tune.calibrate import probe_payloads, read_calibration
import tensor_parallel_workers as workers

NVLINK, IB = LINK_PRESETS["nvlink"], LINK_PRESETS["infiniband"]


def _planned(mesh: sl.Mesh):
    case = CASES["llama_tiny"]
    spec = sl.Spec(mesh, rules=workers.RULES["llama_tiny"], units=case.units)
    parts, _ = spec.mesh.bind(8).batch_split(8, 0)
    return sl.plan(case.builder, case.loss_fn, spec, optimizer=sl.AdamW(lr=1e-3),
                   example_batch=case.make_batch(0)[: 8 // parts], world_size=8)


def test_each_collective_runs_on_its_axis_link_and_a_ring_over_several_on_the_slowest():
    compiled = _planned(sl.Mesh(replicate=2, fsdp=2, tp=2))
    schedule = compiled.schedule
    model = CostModel(link=IB, axis_links={"tp": NVLINK, "fsdp": NVLINK})
    timeline = model.predict(schedule, compiled.graph_module)
    durations = {s.op: s.duration_s for s in timeline.spans if s.kind != "wait" and s.lane != "compute"}
    seen = set()
    for op in schedule.ops:
        if op.index not in durations or not op.bytes:
            continue
        axes = group_axes(schedule, op.group)
        expected = (NVLINK if set(axes) <= {"tp", "fsdp"} else IB).time(op.kind.value, op.group_size, op.bytes)
        assert durations[op.index] == pytest.approx(expected), (op.kind, op.group)
        seen.add(axes)
    assert ("tp",) in seen and ("fsdp",) in seen and ("replicate",) in seen
    # one link for every axis is the model without axes
    same = CostModel(link=IB, axis_links={"tp": IB}).predict(schedule, compiled.graph_module)
    assert same.step_time_s == pytest.approx(CostModel(link=IB).predict(schedule, compiled.graph_module).step_time_s)
    assert "links per axis: fsdp nvlink" in timeline.summary_text()


def test_link_presets_parse_one_preset_or_one_per_axis():
    assert link_presets("nvlink") == LinkPresets("nvlink")
    both = link_presets("tp=nvlink,fsdp=infiniband")
    assert both.axes == (("tp", "nvlink"), ("fsdp", "infiniband")) and both.default == "nvlink"
    assert link_presets("infiniband,tp=nvlink").default == "infiniband"
    assert str(both) == "tp=nvlink,fsdp=infiniband"


@pytest.mark.parametrize("text, message", [
    ("tp=nvlan", r"'nvlan' is not a link preset; presets: gloo-loopback, infiniband, nvlink"),
    ("nvlink,infiniband", r"two presets without an axis \('nvlink' and 'infiniband'\)"),
    ("tp=nvlink,tp=infiniband", r"names axis 'tp' twice"),
])
def test_a_bad_link_is_named(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        link_presets(text)


def test_plan_costs_each_axis_on_its_link_and_names_an_axis_the_mesh_lacks(capsys):
    job = [str(EXAMPLES / "llama.py"), "--spec", str(EXAMPLES / "llama_tp.toml"), "--world", "4",
           "--compute", "h100-bf16"]

    def predicted(link: str) -> float:
        assert main(["plan", *job, "--link", link]) == 0
        out = capsys.readouterr().out
        return float(out.split("predicted step: ")[1].split(" ms")[0])

    slow, mixed, fast = predicted("infiniband"), predicted("tp=nvlink,fsdp=infiniband"), predicted("nvlink")
    assert fast < mixed < slow
    assert main(["plan", *job, "--link", "tq=nvlink"]) != 0
    assert "axis 'tq' is not an axis of examples/llama.py's mesh (fsdp, tp)" in capsys.readouterr().err


def test_calibrate_with_a_mesh_fits_a_link_per_axis_that_plan_takes(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("GPT_SIZE", "tiny")  # the step fit on the tiny GPT: quick
    out = tmp_path / "machine.json"
    assert main(["calibrate", "--nproc", "4", "--reps", "2", "--max-payload", "1MiB", "--mesh", "fsdp=-1,tp=2",
                 "--job", str(EXAMPLES / "gpt.py"), "--out", str(out)]) == 0
    text = capfd.readouterr().out
    assert "and on the groups of fsdp, tp" in text and "link of axis 'tp' (its groups of 2 ranks)" in text
    raw = json.loads(out.read_text())
    assert set(raw["axis_links"]) == {"fsdp", "tp"}
    assert all(a["ranks"] == 2 and len(a["samples"]) == 3 * len(probe_payloads(2**20)) for a in raw["axis_links"].values())
    model = read_calibration(out)
    assert dict(model.axis_links)["tp"].bandwidth == raw["axis_links"]["tp"]["bandwidth"]
    assert main(["plan", str(EXAMPLES / "llama.py"), "--spec", str(EXAMPLES / "llama_tp.toml"), "--world", "4",
                 "--calibration", str(out)]) == 0
    assert "links per axis: fsdp calibrated-gloo-fsdp" in capfd.readouterr().out
    raw["axis_links"]["tp"]["bandwidth"] = 0
    out.write_text(json.dumps(raw))
    with pytest.raises(sl.SpecError, match=r"axis_links.tp.bandwidth is 0"):
        read_calibration(out)


@pytest.mark.parametrize("text", ["fsdp", "fsdp=x", "fsdp=0", "fsdp=2,fsdp=2", "2=fsdp", "fsdp=-2"])
def test_a_bad_calibrate_mesh_is_named(text):
    from shardlang.cli.calibrate import mesh_axes

    with pytest.raises(argparse.ArgumentTypeError, match=rf"{text!r} is not a mesh: expected axis=size pairs"):
        mesh_axes(text)


def test_a_calibrate_mesh_of_other_ranks_than_nproc_is_refused_before_any_probe():
    from shardlang.tune.calibrate import calibrate

    with pytest.raises(sl.SpecError, match=r"--mesh fsdp=3,tp=2 has 6 ranks and --nproc is 4"):
        calibrate(4, mesh=(("fsdp", 3), ("tp", 2)))


def test_axis_links_that_are_not_an_object_are_named(tmp_path):
    from shardlang.tune.calibrate import FORMAT, VERSION

    good = {"format": FORMAT, "version": VERSION, "link": {"backend": "gloo", "alpha_s": 1e-5, "bandwidth": 1e9},
            "compute": {"flops_per_s": 1e10, "bytes_per_s": 1e10, "op_overhead_s": 0, "view_overhead_s": 0},
            "compute_slowdown_under_comm": 1.0}
    path = tmp_path / "machine.json"
    path.write_text(json.dumps({**good, "axis_links": ["tp"]}))
    with pytest.raises(sl.SpecError, match=r"axis_links is list; expected an object of axis name -> link"):
        read_calibration(path)
    path.write_text(json.dumps({**good, "axis_links": {"tp": {"backend": "mpi"}}}))
    with pytest.raises(sl.SpecError, match=r"axis_links.tp.backend is 'mpi'; expected 'gloo' or 'nccl'"):
        read_calibration(path)
