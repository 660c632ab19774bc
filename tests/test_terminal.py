"""What a user sees in a real terminal: the command line run under a pseudo-terminal (Python's `pty`).

Pipes hide what a terminal shows: tqdm's carriage-return updates, a terminal that
reports no width, and torch's own logs, which go to the same screen. Each case runs
``python -m shardlang`` with stdout and stderr on one pty, as a shell would, and
reads what arrives, with the time it arrived.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import socket
import struct
import subprocess
import sys
import termios
import time

import attrs
import pytest

from test_cli import ROOT, TORCHRUN_VARS

SLOW_JOB = "tests/jobs/slow_steps.py"  # 0.15 s a step; rank 1 prints one line in step 5
SHAPE_BUG_JOB = "tests/jobs/shape_bug.py"
BAR = re.compile(r"\|\s*(\d+)/(\d+) \[")  # tqdm's "| n/total [" in the bar format of shardlang.cli.progress
CLEAR_LINE = "\r\x1b[K"


@attrs.frozen
class Screen:
    """What a pty received: (seconds since start, text) chunks, and the exit code."""

    chunks: tuple[tuple[float, str], ...]
    returncode: int

    @property
    def text(self) -> str:
        return "".join(text for _, text in self.chunks)

    def first(self, pattern: re.Pattern | str) -> float:
        """When the output up to some chunk first matched ``pattern``."""
        seen = ""
        for at, text in self.chunks:
            seen += text
            if re.search(pattern, seen):
                return at
        raise AssertionError(f"{pattern!r} never appeared in:\n{self.text}")


def in_terminal(*args: str, columns: int = 0, env: dict | None = None, timeout: float = 240) -> Screen:
    """Run ``python -m shardlang ARGS`` on a fresh pty of ``columns`` (0: one that reports no size)."""
    parent, child = pty.openpty()
    if columns:
        fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    clean = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS and k != "SHARDLANG_VERBOSE"}
    process = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=clean | (env or {}), stdin=child,
                               stdout=child, stderr=child, start_new_session=True)
    os.close(child)
    started = time.monotonic()
    chunks = []
    try:
        while time.monotonic() - started < timeout:
            exited = process.poll() is not None  # read before waiting: what it wrote before exiting is read below
            ready, _, _ = select.select([parent], [], [], 1.0)
            if not ready:
                if exited:
                    break
                continue
            try:
                data = os.read(parent, 65536)
            except OSError:  # EIO: every writer closed the pty
                break
            if not data:
                break
            chunks.append((time.monotonic() - started, data.decode(errors="replace")))
        returncode = process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
        os.close(parent)
    return Screen(tuple(chunks), returncode)


def free_port() -> int:
    """A loopback port that was free a moment ago, for torchrun's --master-port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bar_updates(screen: Screen) -> list[tuple[float, int]]:
    """(arrival time, n) of each bar state drawn."""
    updates, seen = [], ""
    for at, text in screen.chunks:
        before = len(BAR.findall(seen))
        seen += text
        updates += [(at, int(n)) for n, _total in BAR.findall(seen)[before:]]
    return updates


def test_the_bar_is_live_during_training_on_a_terminal_of_unknown_width():
    steps = 12
    screen = in_terminal("-m", "shardlang", "run", SLOW_JOB, "--nproc", "2", "--steps", str(steps))
    assert screen.returncode == 0, screen.text
    updates = bar_updates(screen)
    done_at = screen.first(rf"trained {steps} steps")
    during = [n for at, n in updates if at < done_at - 0.5 and 0 < n < steps]
    assert len(set(during)) >= 3, (updates, done_at)  # several states drawn while training ran
    assert updates[-1][1] == steps  # the bar ends in its final state
    assert not re.search(r"^step \d+/\d+", screen.text, re.MULTILINE)  # no plain lines under a bar
    # Rank 1's line goes above the bar: prefixed, on a line cleared of the bar, and the bar goes on after it.
    assert f"{CLEAR_LINE}[rank 1] a line from rank 1\r\n" in screen.text, screen.text
    printed_at = screen.first(r"a line from rank 1")
    assert any(at >= printed_at and n > 4 for at, n in updates)
    assert not _glued_to_the_bar(screen), _glued_to_the_bar(screen)  # rank 0's own line too


def _glued_to_the_bar(screen: Screen) -> list[str]:
    """Every stretch of a line that a bar state was drawn on and that other text followed before the line was
    returned to or ended: what a user sees glued to the end of the bar."""
    return [segment for segment in re.split(r"[\r\n]", screen.text)
            if BAR.search(segment) and not segment.rstrip().endswith("]")]


def test_the_job_s_prints_and_the_checkpointer_process_s_logs_go_above_the_bar(tmp_path):
    """Note [lines above the bar] and Note [children's output]: rank 0's own print (a partial line, then its
    end) and the INFO lines DCP's checkpointer processes log from every rank each get a line of their own
    above the bar, and the bar goes on below them."""
    steps = 10
    screen = in_terminal("-m", "shardlang", "run", SLOW_JOB, "--nproc", "2", "--steps", str(steps),
                         "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "4",
                         "--async-save", "process", columns=100)
    assert screen.returncode == 0, screen.text
    assert not _glued_to_the_bar(screen), _glued_to_the_bar(screen)
    shown = [line.rsplit("\r", 1)[-1] for line in screen.text.split("\r\n")]  # each line as it stays on screen
    assert shown.count("a line from rank 0 of the job's own") == 1, screen.text
    logged = [line for line in shown if " - INFO - " in line]
    assert any("[0] " in line for line in logged) and any("[rank 1] [1] " in line for line in logged), logged
    assert all(not BAR.search(line) for line in logged), logged
    updates = bar_updates(screen)
    assert updates[-1][1] == steps and any(at > screen.first(r"a line from rank 0") and n > 6 for at, n in updates)


def test_a_sized_terminal_gets_a_bar_of_its_width():
    screen = in_terminal("-m", "shardlang", "run", SLOW_JOB, "--nproc", "2", "--steps", "6", columns=90)
    assert screen.returncode == 0, screen.text
    final = [line for line in re.split(r"[\r\n]", screen.text) if BAR.search(line)][-1]
    assert BAR.search(final).group(1) == "6" and len(final) <= 90, final


@pytest.mark.parametrize("verbose", [False, True])
def test_a_trace_error_shows_the_clear_message_only(verbose):
    flags = ["--verbose"] if verbose else []
    screen = in_terminal("-m", "shardlang", *flags, "run", SHAPE_BUG_JOB, "--nproc", "2")
    assert screen.returncode == 2, screen.text
    lines = [line for line in screen.text.splitlines() if line.strip()]
    error = next(i for i, line in enumerate(lines) if line.startswith("shardlang: error: "))
    assert "tracing the training step failed at" in lines[error] and "shape_bug.py:17 in loss_fn" in lines[error]
    assert "must have same reduction dim" in screen.text
    if verbose:  # torch's own log of the failure, and the full traceback
        assert "failed while attempting to run meta" in screen.text and "Traceback" in screen.text
    else:  # the banner, then the error and its two lines of detail; nothing of torch's internals
        assert len(lines) == 4, screen.text
        assert "fake_tensor" not in screen.text and "Traceback" not in screen.text


def test_torchrun_shows_rank_0s_bar_live():
    steps = 10
    screen = in_terminal("-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                         "--master-port", str(free_port()), "--local-addr", "127.0.0.1",
                         "-m", "shardlang", "run", SLOW_JOB, "--steps", str(steps))
    assert screen.returncode == 0, screen.text
    updates = bar_updates(screen)
    done_at = screen.first(rf"trained {steps} steps")
    assert len({n for at, n in updates if at < done_at - 0.3 and 0 < n < steps}) >= 2, (updates, done_at)
    assert updates[-1][1] == steps


@pytest.fixture
def torch_log_stream():
    """A stream that torch's log records reach (a handler on 'torch' and on the loggers torch gives handlers of
    their own, which do not propagate), removed afterwards."""
    import io
    import logging

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    loggers = [logging.getLogger(name) for name in ("torch", "torch._subclasses.fake_tensor")]
    for logger in loggers:
        logger.addHandler(handler)
    yield stream
    for logger in loggers:
        logger.removeHandler(handler)


def _taken(stream) -> str:
    text = stream.getvalue()
    stream.seek(0)
    stream.truncate()
    return text


def test_no_action_warnings_are_dropped_unless_verbose(monkeypatch, torch_log_stream):
    import logging

    from shardlang.compiler.ir import torch_logs

    monkeypatch.delenv(torch_logs.VERBOSE_ENV, raising=False)
    torch_logs.drop_no_action_warnings()
    log = logging.getLogger("torch.utils.cpp_extension")
    log.warning("No CUDA runtime is found, using CUDA_HOME='/usr/local/cuda'")
    log.warning("a warning that may carry an action")
    text = _taken(torch_log_stream)
    assert "No CUDA runtime" not in text and "a warning that may carry an action" in text
    monkeypatch.setenv(torch_logs.VERBOSE_ENV, "1")
    log.warning("No CUDA runtime is found, using CUDA_HOME='/usr/local/cuda'")
    assert "No CUDA runtime" in _taken(torch_log_stream)


def test_torch_records_are_kept_back_while_tracing(monkeypatch, torch_log_stream):
    import logging

    from shardlang.compiler.ir import torch_logs

    monkeypatch.delenv(torch_logs.VERBOSE_ENV, raising=False)
    with torch_logs.captured_torch_logs() as kept:
        logging.getLogger("torch._subclasses.fake_tensor").error("failed while attempting to run meta")
    assert [r.getMessage() for r in kept.records] == ["failed while attempting to run meta"]
    assert "failed while attempting" not in _taken(torch_log_stream)
    logging.getLogger("torch._subclasses.fake_tensor").error("after the block")  # prints again
    assert "after the block" in _taken(torch_log_stream)
