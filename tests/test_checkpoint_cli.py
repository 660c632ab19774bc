"""``shardlang run --checkpoint-dir/--checkpoint-every/--resume/--keep``, and a rank SIGKILLed mid-save."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from shardlang.cli import main

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# Appended to examples/mlp.py: rank 1 kills itself when it is about to publish the checkpoint
# named by $KILL_AT, i.e. after its files are written and before the checkpoint is complete.
KILL_HOOK = '''
import os as _os, signal as _signal
from shardlang.checkpoint import store as _store

_publish = _store.publish


def _publish_or_die(path, rank, *args, **kwargs):
    if path.name == _os.environ.get("KILL_AT") and rank == 1:
        _os.kill(_os.getpid(), _signal.SIGKILL)
    return _publish(path, rank, *args, **kwargs)


_store.publish = _publish_or_die
'''


def _losses(text: str) -> dict[str, str]:
    return dict(re.findall(r"^step (\d+/\d+)  loss (\S+)", text, flags=re.M))


def _run(args, env=None):
    return subprocess.run([sys.executable, "-m", "shardlang", "run", *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, **(env or {})})


def test_a_rank_killed_mid_save_leaves_the_last_checkpoint_and_resume_picks_it(tmp_path):
    job = tmp_path / "job.py"
    job.write_text((EXAMPLES / "mlp.py").read_text() + KILL_HOOK)
    ckpt = tmp_path / "ckpt"
    common = [str(job), "--nproc", "2", "--steps", "4", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"]
    killed = _run(common, env={"KILL_AT": "step-00000004"})
    assert killed.returncode == 1, killed.stderr
    assert "SIGKILL" in killed.stderr or "killed" in killed.stderr, killed.stderr
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000002", "step-00000004.tmp"]
    uninterrupted = _losses(killed.stdout)
    assert list(uninterrupted) == ["1/4", "2/4", "3/4", "4/4"]

    resumed = _run([*common, "--resume", "--keep", "1"])
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {ckpt / 'step-00000002'} (step 2, written by 2 ranks)" in resumed.stdout
    assert _losses(resumed.stdout) == {k: v for k, v in uninterrupted.items() if k in ("3/4", "4/4")}
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000004"]  # --keep 1; the stale .tmp replaced


def test_resume_continues_the_numbering_on_another_world_size(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    job = str(EXAMPLES / "mlp.py")
    assert main(["run", job, "--steps", "2", "--checkpoint-dir", str(ckpt), "--async-save"]) == 0
    first = capsys.readouterr().out
    assert "checkpoint writing: " + str(ckpt / "step-00000002") in first
    assert main(["run", job, "--steps", "3", "--checkpoint-dir", str(ckpt), "--resume"]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and list(_losses(out)) == ["3/3"]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000002", "step-00000003"]


def test_resume_without_a_checkpoint_starts_fresh(tmp_path, capsys):
    assert main(["run", str(EXAMPLES / "mlp.py"), "--steps", "1", "--checkpoint-dir", str(tmp_path / "c"),
                 "--resume"]) == 0
    out = capsys.readouterr().out
    assert "no checkpoint in" in out and list(_losses(out)) == ["1/1"]


def test_checkpoint_flags_need_a_directory(capsys):
    assert main(["run", str(EXAMPLES / "mlp.py"), "--resume"]) == 2
    assert "--resume needs --checkpoint-dir D" in capsys.readouterr().err
