"""Inspection: the plan report, the exported traces and pictures, plan comparison, and the measured trace.

Everything runs in-process through `shardlang.cli.main` (planning needs no
processes; ``run --trace`` at one rank needs none either), so the cases are fast.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

import shardlang as sl
from shardlang.step.batch import split_batch
from shardlang.cli import main
from shardlang.compiler.analysis.cost import op_name
from shardlang.compiler.analysis.plan_diff import diff_plans
from shardlang.compiler.analysis.plan_report import communication_check, make_plan
from shardlang.compiler.analysis.timeline import LANES, chrome_trace
from shardlang.cli.job import build, global_batch, load_job

ROOT = Path(__file__).resolve().parents[1]
GPT, MLP = str(ROOT / "examples" / "gpt.py"), str(ROOT / "examples" / "mlp.py")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def plan_of(path: str, world: int, **options):
    job = load_job(path)
    spec = job.spec if not options else sl.Spec(job.spec.mesh, rules=job.spec.rules, units=job.spec.units,
                                                  options=sl.Options(**options))
    batch = split_batch(global_batch(job, 0), world, 0)
    compiled = sl.plan(lambda: build(job), job.loss_fn, spec, optimizer=job.optimizer, example_batch=batch,
                       world_size=world)
    return make_plan(compiled)


@pytest.fixture(scope="module")
def gpt2():
    return plan_of(GPT, 2)


# ---- the report ------------------------------------------------------------------


def test_plan_prints_memory_communication_and_time(capsys):
    assert main(["plan", GPT, "--world", "2"]) == 0
    out = capsys.readouterr().out
    assert "schedule: world 2 (mesh fsdp=2)" in out
    assert re.search(r"^memory peak: [0-9.]+ MiB per rank, during op \d+", out, re.MULTILINE)
    assert re.search(r"^\s+activations\s+[0-9.]+ KiB", out, re.MULTILINE)
    assert re.search(r"^all_gather\s+\S+ KiB\s+\S+ KiB\s+= M \+ R", out, re.MULTILINE)
    assert re.search(r"^predicted step: [0-9.]+ ms = compute [0-9.]+ ms \+ exposed communication", out, re.MULTILINE)
    header = next(line for line in out.splitlines() if line.startswith("#"))
    assert header.split()[:9] == ["#", "phase", "op", "unit", "bytes", "live", "after", "peak", "in"]
    assert re.search(r"^\d+\s+forward\s+all_gather", out, re.MULTILINE)


def test_communication_matches_the_formulas(gpt2):
    rows = communication_check(gpt2.schedule)
    assert [r.kind for r in rows] == ["all_gather", "reduce_scatter", "all_reduce"]
    assert all(r.matches for r in rows), rows


def test_plan_json_carries_memory_and_timeline(capsys):
    assert main(["plan", GPT, "--world", "4", "--json", "--link", "infiniband", "--compute", "h100-bf16"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["world_size"] == 4 and plan["ops"]
    memory, timeline = plan["memory"], plan["timeline"]
    assert memory["peak"] == max(op["peak"] for op in memory["ops"])
    assert sum(memory["breakdown"].values()) == memory["peak"]
    assert memory["scratch"]["reduce_scatter"] == 0.0  # NCCL: no collective scratch
    assert timeline["model"]["link"]["name"] == "infiniband"
    assert timeline["step_time_s"] == pytest.approx(timeline["compute_s"] + timeline["exposed_comm_s"])
    assert len(timeline["ops"]) == len(plan["ops"])


def test_cost_knobs_override_the_presets(capsys):
    assert main(["plan", MLP, "--world", "2", "--json", "--alpha", "0", "--bandwidth", "1e15", "--flops", "1e12"]) == 0
    timeline = json.loads(capsys.readouterr().out)["timeline"]
    assert timeline["model"]["link"]["alpha_s"] == 0 and timeline["model"]["compute"]["flops_per_s"] == 1e12
    assert timeline["exposed_comm_s"] < 1e-6


@pytest.mark.parametrize("argv, names", [
    (["plan", MLP, "--world", "2", "--link", "carrier-pigeon"], ["--link", "carrier-pigeon", "nvlink"]),
    (["plan", MLP, "--world", "2", "--bandwidth", "-3"], ["--bandwidth", "'-3'"]),
    (["diff", MLP, MLP], ["--world"]),
])
def test_bad_knobs_are_one_line(capsys, argv, names):
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardlang: error: ")
    assert all(name in err[0] for name in names), err[0]


# ---- exported trace and pictures -------------------------------------------------


def test_chrome_trace_is_json_with_named_lanes(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert main(["plan", GPT, "--world", "2", "--chrome-trace", str(path)]) == 0
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert sorted(lanes.values()) == sorted(LANES) == sorted(["compute", "all_gather", "reduce_scatter", "all_reduce"])
    by_lane = {}
    for e in events:
        if e["ph"] == "X":
            by_lane.setdefault(lanes[e["tid"]], []).append(e)
            assert e["dur"] >= 0 and e["ts"] >= 0
    assert {"compute", "all_gather", "reduce_scatter"} <= set(by_lane)
    assert all(e["name"].split()[1] == "all_gather" for e in by_lane["all_gather"])
    assert any(e["cat"] == "wait" for e in by_lane["compute"])
    counters = [e for e in events if e["ph"] == "C"]
    assert {e["name"] for e in counters} == {"memory", "memory total"}
    assert max(e["args"]["bytes"] for e in counters if e["name"] == "memory total") == trace["otherData"]["peak_bytes"]


def test_plot_flag_draws_memory_over_the_schedule(tmp_path, capsys):
    pytest.importorskip("matplotlib")  # the optional 'plot' extra
    png = tmp_path / "memory.png"
    assert main(["plan", MLP, "--world", "2", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == PNG_SIGNATURE


def test_trace_lanes_render_without_a_browser(tmp_path, gpt2):
    pytest.importorskip("matplotlib")
    from shardlang.cli.plot import plot_trace

    png = tmp_path / "trace.png"
    plot_trace(chrome_trace(gpt2.schedule, gpt2.timeline, gpt2.memory), png)
    assert png.read_bytes()[:8] == PNG_SIGNATURE


def test_plotting_without_matplotlib_says_how_to_install_it(monkeypatch, tmp_path, gpt2):
    from shardlang.cli import plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(sl.ShardlangError, match=re.escape("pip install 'shardlang[plot]'")):
        plot.plot_memory(gpt2, tmp_path / "m.png")


# ---- comparing plans -------------------------------------------------------------


def test_diff_reports_moved_ops_bytes_and_peak(gpt2):
    no_prefetch = plan_of(GPT, 2, prefetch=0)
    d = diff_plans(no_prefetch, gpt2, labels=("prefetch=0", "prefetch=1"))
    assert d.moved and not d.added and not d.removed  # prefetch moves issues earlier, nothing else
    assert all(c.key.startswith("all_gather") and c.index_b < c.index_a for c in d.moved)
    assert d.bytes_per_rank["all_gather"][0] == d.bytes_per_rank["all_gather"][1]
    assert d.peak_delta == gpt2.memory.peak - no_prefetch.memory.peak
    assert "moved (" in d.text() and "memory peak" in d.text()
    assert diff_plans(gpt2, gpt2.to_dict()).identical


def test_diff_from_the_command_line_reads_jobs_and_saved_plans(tmp_path, capsys):
    saved = tmp_path / "gpt2.json"
    assert main(["plan", GPT, "--world", "2", "--json"]) == 0
    saved.write_text(capsys.readouterr().out)
    assert main(["diff", str(saved), GPT, "--world-b", "4", "--world", "2"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^world size\s+2\s+4\s+\+4|^world size\s+2\s+4\s+\+2", out, re.MULTILINE), out
    assert main(["diff", str(saved), str(saved), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["identical"] is True


# ---- the measured trace ----------------------------------------------------------


def test_run_trace_names_ranges_after_the_schedule(tmp_path, capsys):
    path = tmp_path / "run.json"
    assert main(["run", MLP, "--steps", "2", "--trace", str(path)]) == 0
    assert "(profiled)" in capsys.readouterr().out
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["name"] for e in events if e.get("ph") == "X"}
    plan = plan_of(MLP, 1)
    expected = {op_name(op) for op in plan.schedule.ops}  # the plan is the graph that runs, at N = 1 too
    assert expected <= names, sorted(expected - names)
    assert "step 0" in names


@pytest.mark.parametrize("spec", [
    sl.Spec(mesh=sl.Mesh(fsdp=-1), units=["blocks.*"],
            strategies=[("blocks.0", sl.DDP), ("blocks.1", sl.ZeRO1), ("*", sl.ZeRO2)]),
    sl.Spec(mesh=sl.Mesh(replicate=2, fsdp=2), units=["blocks.*"]),
], ids=["mixed-strategies", "hybrid-2x2"])
def test_plans_of_other_strategies_and_meshes(spec):
    job = load_job(GPT)
    batch = split_batch(global_batch(job, 0), 4, 0)
    compiled = sl.plan(lambda: build(job), job.loss_fn, spec, optimizer=job.optimizer, example_batch=batch,
                       world_size=4)
    plan = make_plan(compiled)
    assert all(row.matches for row in communication_check(plan.schedule))
    assert "textbook" not in plan.report()  # 3(N-1)/N*M is full sharding's number only
    assert plan.memory.peak == sum(plan.memory.breakdown.values()) > plan.memory.persistent
    assert plan.timeline.step_time_s == pytest.approx(plan.timeline.compute_s + plan.timeline.exposed_comm_s)
