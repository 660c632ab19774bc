"""What a long run shows: the plain lines every K steps, the bar on a terminal, the metrics file (shardlang.cli.progress).

The reporter is tested in this process on a world of one; the command line's
flags once, end to end, on two ranks.
"""

from __future__ import annotations

import io
import json
import re

import pytest
import torch

from shardlang.cli.progress import ProgressOptions, RunReporter, batch_items, peak_memory_bytes
from shardlang.runtime.dist import DistContext

from test_cli import LOSS_LINE, MLP, shardlang

TOKENS = torch.zeros(4, 6, dtype=torch.long)  # 24 tokens
SAMPLES = (torch.zeros(8, 3), torch.zeros(8, 1))  # 8 samples, no token dimension


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def report(steps: int, options: ProgressOptions, out: io.StringIO, batch=TOKENS) -> None:
    reporter = RunReporter(DistContext.single(), steps, options, out=out)
    for k in range(1, steps + 1):
        reporter.step(k, torch.tensor(1.0 / k), 0.01, batch)
    reporter.close()


def test_plain_lines_every_k_steps_and_the_first_and_last(tmp_path):
    out, metrics = io.StringIO(), tmp_path / "m.jsonl"
    report(7, ProgressOptions(log_every=3, metrics=str(metrics)), out)
    lines = LOSS_LINE.findall(out.getvalue())
    assert [int(k) for k, _n, _loss in lines] == [1, 3, 6, 7]
    assert float(lines[1][2]) == pytest.approx(1 / 3, abs=1e-6)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 3, 6, 7]
    first = records[0]
    assert first["tokens"] == 24 and first["tokens_per_s"] == 24 / 0.01 and first["step_time_s"] == 0.01
    assert first["peak_memory_bytes"] == [first["peak_memory_bytes"][0]] and first["peak_memory_bytes"][0] > 0
    assert records[-1]["eta_s"] == 0 and records[1]["eta_s"] > 0


def test_not_a_terminal_logs_every_step_by_default():
    out = io.StringIO()
    report(3, ProgressOptions(), out)
    assert len(LOSS_LINE.findall(out.getvalue())) == 3 and "\r" not in out.getvalue()


def test_a_terminal_gets_a_bar_and_no_plain_lines(tmp_path):
    out, metrics = Terminal(), tmp_path / "m.jsonl"
    report(4, ProgressOptions(metrics=str(metrics)), out, batch=SAMPLES)
    text = out.getvalue()
    assert LOSS_LINE.findall(text) == []
    assert re.search(r"4/4 \[.*loss 0\.2500, 800\.0 samples/s, 10 ms/step, peak \d+ MiB/rank", text), text
    assert len(metrics.read_text().splitlines()) == 4  # under a bar alone, every step goes to the metrics file


def test_a_terminal_with_log_every_gets_both():
    out = Terminal()
    report(4, ProgressOptions(log_every=2), out)
    lines = out.getvalue().replace("\r", "\n")  # the bar redraws itself after carriage returns
    assert [int(k) for k, _n, _l in LOSS_LINE.findall(lines)] == [1, 2, 4]
    assert "tok/s" in out.getvalue()


def test_items_are_tokens_when_an_integer_leaf_has_two_dims():
    assert batch_items(TOKENS) == (24, "tokens")
    assert batch_items({"ids": TOKENS, "mask": torch.ones(4, 6)}) == (24, "tokens")
    assert batch_items(SAMPLES) == (8, "samples")
    assert batch_items((torch.zeros(5, 2), torch.zeros(5, dtype=torch.long))) == (5, "samples")  # class labels
    assert peak_memory_bytes(torch.device("cpu")) > 2**20


def test_run_log_every_and_metrics_on_two_ranks(tmp_path):
    metrics = tmp_path / "run.jsonl"
    result = shardlang("run", MLP, "--nproc", "2", "--steps", "4", "--log-every", "3", "--metrics", str(metrics))
    assert result.returncode == 0, result.stderr
    assert [int(k) for k, _n, _l in LOSS_LINE.findall(result.stdout)] == [1, 3, 4]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 3, 4]
    assert all(len(r["peak_memory_bytes"]) == 2 and r["samples"] == 16 for r in records)  # MLP's global batch
    losses = {int(k): float(loss) for k, _n, loss in LOSS_LINE.findall(result.stdout)}
    assert all(abs(r["loss"] - losses[r["step"]]) < 1e-6 for r in records)


class ClosedPipe(io.StringIO):
    """A reader that went away: every write raises, as a pipe whose reader exited does."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_reader_that_goes_away_stops_the_lines_not_the_run():
    """`shardlang run ... | head`: once the pipe is closed, the reporter prints nothing more and training goes on."""
    report(5, ProgressOptions(log_every=1), ClosedPipe())  # raises without the guard


def test_run_piped_into_a_reader_that_stops_early_exits_0():
    import os
    import subprocess
    import sys

    from test_cli import ROOT, TORCHRUN_VARS

    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    proc = subprocess.Popen([sys.executable, "-m", "shardlang", "run", MLP, "--nproc", "2", "--steps", "20"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()  # the header; the steps' lines then meet a closed pipe
    proc.stdout.close()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()
    assert b"BrokenPipe" not in err and b"Traceback" not in err, err.decode()
