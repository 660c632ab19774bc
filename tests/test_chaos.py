"""Chaos: one rank SIGKILLed at a random moment of training, then ``--resume``; nothing is lost.

Each seeded trial runs `examples/mlp.py` (plus the hook below) on two ranks with a checkpoint
after every step, synchronous or asynchronous, and kills rank 0 or 1 at a random time after
training has begun: in a step, in a save, in an async save's background write or between them.
Then ``--resume`` trains to the end. Every trial must end with the same parameters, bit for bit,
as one run that never stopped, and the checkpoint it resumed from must be at least as new as
the last one the killed run had completed (Note [atomic checkpoints], Note [replacing a
checkpoint] in `shardlang.checkpoint.store`).
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardlang.checkpoint.export import model_tensors, read_tensor

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# Four seeded trials cover both ranks, sync and async saves, early and late kills; a soak run asks for more
# (SHARDLANG_CHAOS_TRIALS=100 python -m pytest tests/test_chaos.py).
TRIALS = int(os.environ.get("SHARDLANG_CHAOS_TRIALS", "4"))
STEPS = 8
TRAINING_S = 0.8  # about how long the hooked job's 8 steps and saves take here: the window a kill falls in

# Appended to examples/mlp.py. In the rank named by $CHAOS_RANK, the second call of make_batch (training has
# begun: the first builds the example batch) starts a timer that SIGKILLs the process after $CHAOS_DELAY s,
# whatever it is doing then. Every step's data takes 50 ms, so that the run lasts long enough to be hit.
CHAOS_HOOK = '''
import os as _os, signal as _signal, threading as _threading, time as _time
import torch.distributed as _dist

_make_batch = make_batch
_calls = [0]


def make_batch(step):
    _time.sleep(0.05)
    if _dist.is_initialized() and _dist.get_rank() == int(_os.environ.get("CHAOS_RANK", "-1")):
        _calls[0] += 1
        if _calls[0] == 2:
            delay = float(_os.environ["CHAOS_DELAY"])
            timer = _threading.Timer(delay, lambda: _os.kill(_os.getpid(), _signal.SIGKILL))
            timer.daemon = True
            timer.start()
    return _make_batch(step)
'''


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CHAOS_")} | (env or {})
    return subprocess.run([sys.executable, "-m", "shardlang", "run", *args], capture_output=True, text=True,
                          timeout=300, env=clean)


def _final_parameters(checkpoint: Path) -> dict[str, torch.Tensor]:
    return {name: read_tensor(checkpoint, name, md) for name, md in model_tensors(checkpoint).items()}


def _saved_before_the_kill(stdout: str) -> int:
    """The newest step whose checkpoint the killed run knew complete: a 'saved' line, or, for async saves, the
    step before a 'writing' line (the next async save starts only once the previous one is complete)."""
    saved = [int(k) for k in re.findall(r"checkpoint saved: \S+step-(\d+)$", stdout, re.MULTILINE)]
    writing = [int(k) - 1 for k in re.findall(r"checkpoint writing: \S+step-(\d+)$", stdout, re.MULTILINE)]
    return max([0, *saved, *writing])


@pytest.fixture(scope="module")
def chaos_job(tmp_path_factory) -> Path:
    job = tmp_path_factory.mktemp("chaos") / "job.py"
    job.write_text((EXAMPLES / "mlp.py").read_text() + CHAOS_HOOK)
    return job


@pytest.fixture(scope="module")
def uninterrupted(chaos_job, tmp_path_factory) -> dict[str, torch.Tensor]:
    ckpt = tmp_path_factory.mktemp("uninterrupted")
    result = _run(str(chaos_job), "--nproc", "2", "--steps", str(STEPS), "--checkpoint-dir", str(ckpt))
    assert result.returncode == 0, result.stderr
    return _final_parameters(ckpt / f"step-{STEPS:08d}")


def test_a_rank_killed_at_random_loses_nothing_and_resumes_to_the_same_parameters(chaos_job, uninterrupted,
                                                                                  tmp_path):
    killed_mid_run = 0
    for seed in range(TRIALS):
        chance = random.Random(seed)
        rank, delay, asynchronous = chance.randrange(2), chance.uniform(0.0, TRAINING_S), chance.random() < 0.5
        ckpt = tmp_path / f"trial-{seed}"
        common = [str(chaos_job), "--nproc", "2", "--steps", str(STEPS), "--checkpoint-dir", str(ckpt)]
        flags = ["--checkpoint-every", "1"] + (["--async-save"] if asynchronous else [])
        what = f"trial {seed}: rank {rank} killed after {delay:.2f} s, {'async' if asynchronous else 'sync'} saves"
        killed = _run(*common, *flags, env={"CHAOS_RANK": str(rank), "CHAOS_DELAY": f"{delay:.3f}"})
        if killed.returncode == 0:  # the kill came after the run had ended
            resumed_from = STEPS
        else:
            killed_mid_run += 1
            assert killed.returncode == 1 and f"rank {rank} died of SIGKILL" in killed.stderr, \
                f"{what}:\n{killed.stderr}"
            resumed = _run(*common, *flags, "--resume")
            assert resumed.returncode == 0, f"{what}: the resumed run failed:\n{resumed.stderr}"
            found = re.search(r"resumed from \S+step-(\d+)(?:\.old)? \(step (\d+)", resumed.stdout)
            done = re.search(r"nothing to do: the latest checkpoint .* is at step (\d+)", resumed.stdout)
            resumed_from = int(found.group(2)) if found else int(done.group(1)) if done else 0
            assert resumed_from >= _saved_before_the_kill(killed.stdout), \
                f"{what}: a checkpoint the killed run had completed was lost:\n{killed.stdout}\n{resumed.stdout}"
        final = _final_parameters(ckpt / f"step-{STEPS:08d}")
        assert final.keys() == uninterrupted.keys()
        assert all(torch.equal(final[k], uninterrupted[k]) for k in final), \
            f"{what}, resumed from step {resumed_from}: the final parameters differ from a run that never stopped"
        assert not any(p.name.endswith(".tmp") for p in ckpt.iterdir()), f"{what}: {sorted(ckpt.iterdir())}"
    assert killed_mid_run >= TRIALS // 2, f"only {killed_mid_run} of {TRIALS} kills landed while the run went on"
