"""The worker side of the local launcher: what each spawned rank runs.

`worker_main` is a rank's whole life: set up the process (threads, output
prefixes, the stack-dump signal), join the pool's gloo process group, then serve
the parent's commands (`Command`: RUN a job, RESET the process group, STOP) and
answer each with a `Reply`. The parent side is `worker_pool.WorkerPool`; jobs
follow Note [what a job is] there.

Example::

    >>> s = _PrefixedStream(io.StringIO(), "[rank 0] "); _ = s.write("ready\\n")
    >>> s.inner.getvalue()
    '[rank 0] ready\\n'
"""

from __future__ import annotations

import enum
import faulthandler
import io
import os
import pickle
import signal
import sys
import threading
import traceback
from multiprocessing import connection
from typing import Any

import attrs
import torch
import tqdm

from shardlang.runtime.dist import DEFAULT_COLLECTIVE_TIMEOUT_S, DistContext, init_process_group, shutdown
from shardlang.runtime.failures import exception_summary, stack_path

LOCALHOST = "127.0.0.1"


class Command(enum.Enum):
    RUN = "run"
    RESET = "reset"
    STOP = "stop"


class Reply(enum.Enum):
    READY = "ready"
    OK = "ok"
    ERROR = "error"


@attrs.frozen
class WorkerConfig:
    """What every worker of a pool is started with."""

    nproc: int
    threads: int | None
    prefix_output: bool
    stack_dir: str
    collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT_S


def worker_main(rank: int, port: int, config: WorkerConfig, conn: connection.Connection) -> None:
    """A rank's life: set up the process, join the group, then serve commands until STOP."""
    _setup_process(rank, config)
    ctx = _join(rank, port, config, conn)
    while ctx is not None:
        try:
            command, *rest = conn.recv()
        except (EOFError, OSError):
            break
        if command is Command.STOP:
            break
        if command is Command.RUN:
            conn.send(_run_job(ctx, rest[0]))
        elif command is Command.RESET:
            shutdown()
            ctx = _join(rank, rest[0], config, conn)
    shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown (about a second with torch loaded); jobs close their own files


def _setup_process(rank: int, config: WorkerConfig) -> None:
    """Threads, output prefixes, Ctrl-C handling and the stack dump signal for one worker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # tqdm's default lock holds a multiprocessing semaphore (torch.fx's Interpreter makes a bar even when it
    # is off), and a rank ends with os._exit, which never unlinks it: the parent would warn of leaked
    # semaphores. Ranks write through their own streams, so a thread lock serves.
    tqdm.tqdm.set_lock(threading.RLock())
    if config.threads is not None:
        _limit_threads(config.threads)
    if config.prefix_output:
        sys.stdout = _PrefixedStream(sys.stdout, f"[rank {rank}] ")
        sys.stderr = _PrefixedStream(sys.stderr, f"[rank {rank}] ")
    if hasattr(signal, "SIGUSR1"):
        stack_file = open(stack_path(config.stack_dir, rank), "a")  # noqa: SIM115  lives as long as the process
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)


def _join(rank: int, port: int, config: WorkerConfig, conn: connection.Connection) -> DistContext | None:
    """Join the pool's process group and report READY; report the error and return None if it fails."""
    try:
        ctx = init_process_group(rank, config.nproc, LOCALHOST, port, "gloo", timeout_s=config.collective_timeout)
    except BaseException as exc:
        conn.send((Reply.ERROR, exception_summary(exc), traceback.format_exc()))
        return None
    conn.send((Reply.READY,))
    return ctx


def _run_job(ctx: DistContext, payload: bytes) -> tuple:
    """Unpickle and run one job; the reply to send back (Note [what a job is])."""
    try:
        fn, args = pickle.loads(payload)
        result = fn(ctx, *args)
    except BaseException as exc:  # the ranks a timed-out collective found late (Note [collective timeout])
        return (Reply.ERROR, exception_summary(exc), traceback.format_exc(), tuple(getattr(exc, "late_ranks", ())))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    try:
        return (Reply.OK, pickle.dumps(result))
    except Exception as exc:
        detail = f"returned a value that cannot be pickled ({exception_summary(exc)})"
        return (Reply.ERROR, detail, traceback.format_exc())


def _limit_threads(threads: int) -> None:
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["MKL_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:
        pass  # already fixed once parallel work has started; intra-op threads are what matter here


class _PrefixedStream(io.TextIOBase):
    """A text stream that writes whole lines, each starting with ``prefix``.

    A partial line waits for its newline (or an explicit flush), so that the lines
    of ranks sharing one terminal never interleave mid-line.

    Example::

        >>> s = _PrefixedStream(io.StringIO(), "[rank 1] "); _ = s.write("a\\nb"); _ = s.write("c\\n")
        >>> s.inner.getvalue()
        '[rank 1] a\\n[rank 1] bc\\n'
    """

    def __init__(self, inner: Any, prefix: str):
        super().__init__()
        self.inner = inner
        self._prefix = prefix
        self._partial = ""

    def write(self, text: str) -> int:
        *lines, self._partial = (self._partial + text).split("\n")
        if lines:
            self.inner.write("".join(f"{self._prefix}{line}\n" for line in lines))
            self.inner.flush()
        return len(text)

    def flush(self) -> None:
        if self._partial:
            self.inner.write(f"{self._prefix}{self._partial}")
            self._partial = ""
        self.inner.flush()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self.inner.isatty()

    def fileno(self) -> int:
        return self.inner.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self.inner, "encoding", "utf-8")
