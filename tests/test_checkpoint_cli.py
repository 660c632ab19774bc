"""``shardlang run --checkpoint-dir/--checkpoint-every/--resume/--keep``, and a rank SIGKILLed mid-save."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shardlang.checkpoint import store
from shardlang.cli import main
from shardlang.errors import CheckpointError

from test_checkpoint_errors import _step

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
    # The surviving rank's save failed with its peer gone, and it removed the unfinished step-4.tmp.
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000002"]
    uninterrupted = _losses(killed.stdout)
    assert list(uninterrupted) == ["1/4", "2/4", "3/4", "4/4"]

    resumed = _run([*common, "--resume", "--keep", "1"])
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {ckpt / 'step-00000002'} (step 2, written by 2 ranks)" in resumed.stdout
    assert _losses(resumed.stdout) == {k: v for k, v in uninterrupted.items() if k in ("3/4", "4/4")}
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000004"]  # --keep 1


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


# ---- no checkpoint is lost (Note [replacing a checkpoint] in shardlang.checkpoint.store) ----------------------

MLP = str(EXAMPLES / "mlp.py")


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_a_fresh_run_refuses_a_directory_with_checkpoints_and_overwrite_replaces_them(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    assert main(["run", MLP, "--steps", "6", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"]) == 0
    first_run = store.run_of(ckpt / "step-00000006")
    capsys.readouterr()
    # A fresh run into it would mix two runs: refused before compiling, naming both ways on.
    assert main(["run", MLP, "--steps", "2", "--checkpoint-dir", str(ckpt), "--keep", "1"]) == 2
    captured = capsys.readouterr()
    assert "already holds checkpoints" in captured.err and "--resume" in captured.err
    assert "--overwrite" in captured.err and "compiled" not in captured.out
    assert _names(ckpt) == ["step-00000002", "step-00000004", "step-00000006"]
    # --overwrite --keep 1: the checkpoint just saved stays (it is not the newest by number), the other run's go.
    assert main(["run", MLP, "--steps", "2", "--checkpoint-dir", str(ckpt), "--keep", "1", "--overwrite"]) == 0
    assert f"checkpoint saved: {ckpt / 'step-00000002'}" in capsys.readouterr().out
    assert _names(ckpt) == ["step-00000002"]
    assert store.run_of(ckpt / "step-00000002") not in (None, first_run)


def test_keep_prunes_only_this_runs_checkpoints_and_never_the_one_just_saved(tmp_path):
    root = tmp_path / "ckpt"
    for steps, run in ((2, "a"), (4, "b"), (6, "b"), (8, "a")):
        path = root / f"step-{steps:08d}"
        path.mkdir(parents=True)
        (path / store.MANIFEST).write_text(json.dumps({"files": {}, "steps": steps, "run": run}))
    directory = store.CheckpointDir(root, keep=1, run_id="b")
    assert directory.prune(just_saved=root / "step-00000004") == []  # b's newest is 6, but 4 was just saved
    assert directory.prune() == [root / "step-00000004"]
    assert _names(root) == ["step-00000002", "step-00000006", "step-00000008"]  # run a's are untouched


def test_resume_past_steps_says_there_is_nothing_to_do(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    assert main(["run", MLP, "--steps", "6", "--checkpoint-dir", str(ckpt)]) == 0
    capsys.readouterr()
    assert main(["run", MLP, "--steps", "2", "--checkpoint-dir", str(ckpt), "--resume"]) == 0
    out = capsys.readouterr().out
    assert "nothing to do" in out and "step-00000006" in out and "--steps greater than 6" in out
    assert "trained" not in out and not _losses(out)


def test_a_checkpoint_dir_that_is_a_file_fails_before_compiling(tmp_path, capsys):
    file = tmp_path / "not-a-dir"
    file.write_text("x")
    assert main(["run", MLP, "--steps", "1", "--checkpoint-dir", str(file)]) == 2
    captured = capsys.readouterr()
    assert f"--checkpoint-dir {file} is a file, not a directory" in captured.err and "compiled" not in captured.out


def test_a_crash_between_the_renames_of_a_replacing_save_leaves_a_checkpoint_resume_finds(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    assert main(["run", MLP, "--steps", "2", "--checkpoint-dir", str(ckpt)]) == 0
    # What a crash after "step-2 -> step-2.old" and before "step-2.tmp -> step-2" leaves.
    (ckpt / "step-00000002").rename(ckpt / "step-00000002.old")
    (ckpt / "step-00000002.tmp").mkdir()
    capsys.readouterr()
    assert main(["run", MLP, "--steps", "3", "--checkpoint-dir", str(ckpt), "--resume"]) == 0
    out = capsys.readouterr().out
    assert f"resumed from {ckpt / 'step-00000002.old'} (step 2" in out and list(_losses(out)) == ["3/3"]
    assert _names(ckpt) == ["step-00000002.old", "step-00000003"]  # the stale .tmp cleaned at the save


def test_a_full_disk_names_enospc_and_leaves_no_tmp(tmp_path, monkeypatch):
    step = _step()
    step.save(tmp_path / "step-00000001")

    def no_space(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path))

    monkeypatch.setattr(store, "describe", no_space)  # fails while the new checkpoint is being published
    with pytest.raises(CheckpointError, match=r"no space left on the device .*\(ENOSPC") as caught:
        step.save(tmp_path / "step-00000002")
    assert "step-00000002.tmp was removed" in str(caught.value)
    assert _names(tmp_path) == ["step-00000001"]


def test_async_saves_by_a_checkpointer_process_resume_like_any_other(tmp_path, capfd):
    ckpt = tmp_path / "ckpt"
    job = str(EXAMPLES / "mlp.py")
    common = [job, "--nproc", "2", "--checkpoint-dir", str(ckpt)]
    assert main(["run", *common, "--steps", "4"]) == 0
    uninterrupted = _losses(capfd.readouterr().out)
    assert list(uninterrupted) == ["1/4", "2/4", "3/4", "4/4"]
    shutil.rmtree(ckpt)
    assert main(["run", *common, "--steps", "2", "--async-save", "process"]) == 0
    assert "checkpoint writing: " + str(ckpt / "step-00000002") in capfd.readouterr().out
    assert main(["run", *common, "--steps", "4", "--resume"]) == 0
    resumed = _losses(capfd.readouterr().out)
    assert resumed == {k: v for k, v in uninterrupted.items() if k in ("3/4", "4/4")}


def test_a_checkpointer_process_in_a_world_of_one_is_refused_before_compiling(tmp_path, capfd):
    assert main(["run", str(EXAMPLES / "mlp.py"), "--nproc", "1", "--steps", "1", "--checkpoint-dir",
                 str(tmp_path / "c"), "--async-save", "process"]) != 0
    out, err = capfd.readouterr()
    assert "the process checkpointer needs a process group" in err and "--async-save without a value" in err
    assert "compiled in" not in out + err and not any((tmp_path / "c").glob("step-*"))
