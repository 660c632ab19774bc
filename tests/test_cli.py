"""The command line, end to end: ``python -m shardlang run | plan | check`` as subprocesses on the examples.

Each subprocess imports torch (~1-2 s) and launched ranks cost ~2 s each, so the
subprocess cases are few and small; argument and job-file errors, which take the
same code path, are checked in-process through `main`.
"""

from __future__ import annotations

import doctest
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardlang as sl
from shardlang import cli
from shardlang.cli import args as cli_args, common as cli_common, main
from shardlang.cli.job import build, global_batch, load_job, reference_optimizer
from shardlang.runtime.launcher import FailureKind, PoolState, RankFailure, WorkerError

ROOT = Path(__file__).resolve().parents[1]
GPT, MLP = "examples/gpt.py", "examples/mlp.py"
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LOSS_LINE = re.compile(r"^step (\d+)/(\d+)\s+loss ([0-9.]+)\s+time [0-9.]+ ms$", re.MULTILINE)


def shardlang(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS} | (env or {})
    return subprocess.run([sys.executable, "-m", "shardlang", *args], cwd=ROOT, env=clean, capture_output=True,
                          text=True, timeout=300)


def assert_usage_error(result: subprocess.CompletedProcess, *names: str) -> None:
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert_one_line(result.stderr, *names)


def assert_one_line(stderr: str, *names: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardlang: error: "), stderr
    for name in names:
        assert name in lines[0], lines[0]


# ---- plan --------------------------------------------------------------------


@pytest.mark.parametrize("path", [GPT, MLP])
def test_plan_json_bytes_follow_the_flats(path):
    result = shardlang("plan", path, "--world", "4", "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)  # stdout is exactly one JSON object
    assert plan["world_size"] == 4
    assert plan["ops"] and all({"kind", "unit", "bytes"} <= op.keys() for op in plan["ops"])
    flats = {f["name"]: f for f in plan["flats"]}
    gathered = plan["bytes_per_rank"]["all_gather"]
    scattered = plan["bytes_per_rank"]["reduce_scatter"]
    # Every trainable sharded flat's gradient is reduce-scattered once, padded.
    assert scattered == sum(f["padded_bytes"] for f in flats.values() if f["sharded"] and f["trainable"]) > 0
    # Each all-gather moves one flat, padded; every flat once in forward, some again for backward.
    gathers = [op for op in plan["ops"] if op["kind"] == "all_gather"]
    assert all(op["bytes"] == flats[op["flat"]]["padded_bytes"] for op in gathers)
    forward = [op for op in gathers if op["phase"] == "forward"]
    again = [op for op in gathers if op["phase"] == "backward"]
    assert sorted(op["flat"] for op in forward) == sorted(n for n, f in flats.items() if f["sharded"])
    assert gathered == scattered + sum(op["bytes"] for op in again)
    assert scattered <= gathered <= 2 * scattered


def test_plan_text_prints_the_summary_and_table(capsys):
    assert main(["plan", str(ROOT / MLP), "--world", "2"]) == 0
    out = capsys.readouterr().out
    assert "schedule: world 2 (mesh fsdp=2)" in out
    assert re.search(r"^\d+\s+forward\s+all_gather", out, re.MULTILINE)


def test_plan_indivisible_batch_names_the_sizes():
    assert_usage_error(shardlang("plan", GPT, "--world", "3"), "global batch size 8", "world size 3", "make_batch(0)")


# ---- run ---------------------------------------------------------------------


def test_run_prints_global_losses_then_the_schedule():
    result = shardlang("run", MLP, "--nproc", "2", "--steps", "2")
    assert result.returncode == 0, result.stderr
    assert "leaked semaphore" not in result.stderr  # ranks end with os._exit: nothing of theirs may be left
    steps = LOSS_LINE.findall(result.stdout)
    assert [(k, n) for k, n, _ in steps] == [("1", "2"), ("2", "2")], result.stdout
    # The global loss of step 1 is the loss of the initial model on the whole global batch.
    job = load_job(ROOT / MLP)
    with torch.no_grad():
        expected = float(job.loss_fn(build(job, seed=0), global_batch(job, 0)))
    assert float(steps[0][2]) == pytest.approx(expected, rel=1e-5)
    assert "schedule: world 2 (mesh fsdp=2)" in result.stdout
    assert "reduce_scatter" in result.stdout.split("schedule:")[1]


def test_run_under_torchrun_environment_uses_its_world(monkeypatch, capsys):
    # WORLD_SIZE set means torchrun started this process; a world of one needs no process group.
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["run", str(ROOT / MLP), "--steps", "1"]) == 0
    assert len(LOSS_LINE.findall(capsys.readouterr().out)) == 1
    assert main(["run", str(ROOT / MLP), "--nproc", "2"]) == 2
    assert_one_line(capsys.readouterr().err, "--nproc 2", "WORLD_SIZE=1")


def test_run_missing_file_is_one_line_naming_it():
    assert_usage_error(shardlang("run", "examples/no_such_job.py", "--nproc", "2"), "examples/no_such_job.py")


@pytest.mark.parametrize("argv, names", [
    (["run", MLP, "--nproc", "3"], ["global batch size 16", "world size 3"]),
    (["run", MLP, "--nproc", "0"], ["--nproc", "'0'"]),
    (["run", MLP, "--timeout", "0"], ["--timeout", "'0'", "seconds"]),
    (["plan", MLP, "--world", "-2"], ["--world", "'-2'"]),
    (["check", MLP, "--world-sizes", "1,two"], ["--world-sizes", "'1,two'"]),
    (["check", MLP, "--world-sizes", "1,3"], ["world size 3"]),
    (["check", MLP, "--steps", "x"], ["--steps", "'x'"]),
])
def test_bad_arguments_are_one_line_naming_the_value(monkeypatch, capsys, argv, names):
    # In-process: the same code as the subprocesses above, without paying for a Python start each.
    monkeypatch.chdir(ROOT)
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code == 2
    assert_one_line(capsys.readouterr().err, *names)


# ---- check -------------------------------------------------------------------


@pytest.mark.parametrize("path, dtype, tolerance", [(MLP, "float64", "1e-09"), (GPT, "float32", "1e-02")])
def test_check_passes_against_torch_optim(path, dtype, tolerance):
    result = shardlang("check", path, "--world-sizes", "1,2", "--steps", "2", "--dtype", dtype)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{dtype}, seed 0, tolerance {tolerance}" in result.stdout
    rows = re.findall(r"^([12])\s+(\S+)\s+(\S+)\s+(PASS|FAIL)\s+\S+$", result.stdout, re.MULTILINE)
    assert [(w, verdict) for w, _, _, verdict in rows] == [("1", "PASS"), ("2", "PASS")], result.stdout
    assert result.stdout.rstrip().endswith("PASS")
    if dtype == "float64":  # SGD in float64: the same numbers up to the order of additions
        assert all(float(diff) < 1e-12 for _, diff, _, _ in rows)


def test_check_fails_with_exit_1_beyond_the_tolerance(monkeypatch, capsys):
    # float32 rounding alone exceeds a zero tolerance: the FAIL path, in-process at world size 1.
    monkeypatch.setitem(cli.TOLERANCES, (torch.float32, False), 0.0)
    monkeypatch.setattr(cli.check, "FLOOR_MULTIPLE", 0.0)  # and no allowance for the reference's own noise
    assert main(["check", str(ROOT / MLP), "--world-sizes", "1", "--steps", "1", "--dtype", "float32"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^1\s+\S+\s+\S+\s+FAIL\s+\S+$", out, re.MULTILINE) and "FAIL: world size 1" in out


def test_rank_errors_of_shardlang_are_one_line_others_keep_tracebacks():
    spec = RankFailure(0, FailureKind.RAISED, "SpecError: Mesh(fsdp=4) has 4 devices", "Traceback ...")
    stopped = RankFailure(1, FailureKind.STOPPED, "", "")
    assert cli._own_error_line(WorkerError("job", (spec, stopped), (), PoolState.READY)) == (
        "rank 0: SpecError: Mesh(fsdp=4) has 4 devices")
    bug = RankFailure(1, FailureKind.RAISED, "ValueError: boom", "Traceback ...")
    assert cli._own_error_line(WorkerError("job", (spec, bug), (), PoolState.READY)) is None
    died = RankFailure(0, FailureKind.DIED, "with exit code 9", "")
    assert cli._own_error_line(WorkerError("job", (died,), (), PoolState.BROKEN)) is None



def test_every_command_module_is_registered_with_add_parser_and_main():
    # one module per command (docs/architecture.md): a new cli/<name>.py must be listed in cli.COMMANDS, unless it
    # is one of the modules the commands share
    shared = {"__init__", "args", "common", "compare", "job", "plot", "profile", "progress"}
    modules = sorted(p.stem for p in (ROOT / "shardlang" / "cli").glob("*.py") if p.stem not in shared)
    assert sorted(m.__name__.rsplit(".", 1)[1] for m in cli.COMMANDS) == modules == ["calibrate", "check", "data", "diff", "export", "plan", "run", "tune"]
    for name in modules:
        module = importlib.import_module(f"shardlang.cli.{name}")
        assert callable(module.add_parser) and callable(module.main), name
        assert module.__doc__.startswith(f'``shardlang {name} '), name


def test_cli_docstring_examples_hold():
    for module in (cli_args, cli_common):
        assert doctest.testmod(module).failed == 0, module.__name__

# ---- job files (in-process) ----------------------------------------------------


def write_job(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.py"
    path.write_text(text)
    return path


def test_load_job_defaults_and_reference_optimizer(tmp_path):
    path = write_job(tmp_path, "import torch\n"
                               "def build_model(): return torch.nn.Linear(2, 1)\n"
                               "def loss_fn(model, batch): return model(batch).pow(2).mean()\n"
                               "def make_batch(step): return torch.ones(4, 2)\n")
    job = load_job(path)
    assert job.spec == sl.Spec(mesh=sl.Mesh(fsdp=-1)) and job.optimizer == sl.AdamW(lr=1e-3) and job.dtype is None
    assert torch.equal(build(job, seed=3).weight, build(job, seed=3).weight)
    params = list(build(job).parameters())
    assert isinstance(reference_optimizer(sl.AdamW(lr=0.1), params), torch.optim.AdamW)
    assert isinstance(reference_optimizer(sl.Adam(lr=0.1), params), torch.optim.Adam)
    sgd = reference_optimizer(sl.SGD(lr=0.1, momentum=0.9, nesterov=True), params)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["nesterov"] and sgd.defaults["momentum"] == 0.9


@pytest.mark.parametrize("text, names", [
    ("x = 1\n", ["build_model", "loss_fn", "make_batch", "def loss_fn(model, batch)"]),
    ("def build_model(): pass\ndef loss_fn(batch): pass\ndef make_batch(step): pass\n",
     ["loss_fn(batch)", "def loss_fn(model, batch)"]),
    ("def build_model(): pass\ndef loss_fn(m, b): pass\nmake_batch = 3\n", ["make_batch is int", "def make_batch"]),
    ("def build_model(): pass\ndef loss_fn(m, b): pass\ndef make_batch(s): pass\nspec = 'fsdp'\n",
     ["spec is str", "sl.Spec"]),
    ("import torch\ny = 2\nz = undefined_name + 1\n", ["failed to import", "NameError", "line 3"]),
    ("def build_model(:\n", ["failed to import", "SyntaxError"]),
])
def test_load_job_errors_name_what_is_wrong(tmp_path, text, names):
    with pytest.raises(sl.SpecError) as info:
        load_job(write_job(tmp_path, text))
    for name in names:
        assert name in str(info.value)


def test_load_job_missing_file_names_it(tmp_path):
    with pytest.raises(sl.SpecError, match="nothing_here.py.*does not exist"):
        load_job(tmp_path / "nothing_here.py")
