"""``--spec FILE``: a TOML spec in place of the job's, for ``run``, ``plan`` and ``check``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import shardlang as sl
from shardlang.cli import main

GPT = str(Path(__file__).resolve().parents[1] / "examples" / "gpt.py")
ZERO2 = sl.Spec(mesh=sl.Mesh(fsdp=-1), rules=[("*", sl.shard("fsdp"))], units=["blocks.*"],
                strategies=[("blocks.*", "zero2")], options=sl.Options(prefetch=2))


@pytest.fixture
def spec_file(tmp_path) -> str:
    path = tmp_path / "spec.toml"
    path.write_text(ZERO2.to_toml())
    return str(path)


def test_plan_uses_the_spec_file(spec_file, capsys):
    assert main(["plan", GPT, "--world", "2", "--json", "--spec", spec_file]) == 0
    assert '"zero2"' in json.dumps(json.loads(capsys.readouterr().out))
    assert main(["plan", GPT, "--world", "2", "--json"]) == 0
    assert '"zero2"' not in capsys.readouterr().out  # the job's own spec: every unit ZeRO-3


def test_check_passes_at_1_2_4_under_the_spec_file(spec_file, capsys):
    assert main(["check", GPT, "--world-sizes", "1,2,4", "--steps", "2", "--spec", spec_file]) == 0


def test_run_trains_under_the_spec_file(spec_file, capfd):
    assert main(["run", GPT, "--nproc", "2", "--steps", "2", "--spec", spec_file]) == 0
    out = capfd.readouterr().out
    assert re.search(r"^zero2\s+2\s", out, flags=re.M) and "prefetch=2" in out


def test_a_missing_or_malformed_spec_file_is_named(tmp_path, capsys):
    assert main(["plan", GPT, "--world", "2", "--spec", str(tmp_path / "none.toml")]) == 2
    assert "--spec" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text("[shardlang]\nmesh = {fsdp = -1}\nunits = 3\n")
    assert main(["plan", GPT, "--world", "2", "--spec", str(bad)]) == 2
    assert str(bad) in capsys.readouterr().err
