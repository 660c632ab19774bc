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

import contextlib
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
from typing import Any, NoReturn

import attrs
import torch
import tqdm

from shardlang.errors import ShardlangRuntimeError
from ..compiler import drop_no_action_warnings
from shardlang.runtime.dist import DEFAULT_COLLECTIVE_TIMEOUT_S, DistContext, init_with_store, shutdown
from shardlang.runtime.failures import exception_summary, stack_path
from shardlang.runtime.rendezvous import join_store

CLEAR_LINE = "\r\x1b[K"  # carriage return, then erase to the end of the line (ANSI)


class Command(enum.Enum):
    RUN = "run"
    RESET = "reset"
    STOP = "stop"


class Reply(enum.Enum):
    READY = "ready"
    OK = "ok"
    ERROR = "error"


class OutputPrefix(enum.Enum):
    """Which ranks' output lines start with ``[rank r] `` (each written whole, so ranks never interleave
    mid-line). ``True`` and ``False`` read as EVERY_RANK and NONE.

    Example::

        >>> OutputPrefix.of(True)
        <OutputPrefix.EVERY_RANK: 'every rank'>
    """

    EVERY_RANK = "every rank"
    OTHER_RANKS = "ranks other than 0"  # rank 0 writes straight through: its progress bar redraws one line
    NONE = "none"

    @classmethod
    def of(cls, value: OutputPrefix | bool) -> OutputPrefix:
        if isinstance(value, OutputPrefix):
            return value
        if isinstance(value, bool):
            return cls.EVERY_RANK if value else cls.NONE
        valid = ", ".join(f"OutputPrefix.{p.name}" for p in cls)
        raise ShardlangRuntimeError(f"prefix_output={value!r} is not an output prefix; expected True, False, {valid}")

    def applies_to(self, rank: int) -> bool:
        return self is OutputPrefix.EVERY_RANK or (self is OutputPrefix.OTHER_RANKS and rank > 0)


@attrs.frozen
class WorkerConfig:
    """What every worker of a pool is started with."""

    nproc: int
    threads: int | None
    prefix_output: OutputPrefix = attrs.field(converter=OutputPrefix.of)
    stack_dir: str
    collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT_S
    gloo_interface: str = "lo"  # the loopback interface (`rendezvous.loopback_interface`)


def worker_main(rank: int, port: int, config: WorkerConfig, conn: connection.Connection) -> None:
    """A rank's life: set up the process, join the group, then serve commands until STOP.

    ``port`` is the parent's store on loopback (Note [loopback rendezvous]); RESET names the
    generation of the next process group, whose keys live under a prefix of their own."""
    _setup_process(rank, config)
    generation = 0
    ctx = _join(rank, port, generation, config, conn)
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
            generation = rest[0]
            ctx = _join(rank, port, generation, config, conn)
    leave_rank(0)


def leave_rank(code: int) -> NoReturn:
    """End this rank's process with ``code``, as every rank ends (Note [a rank's exit]).

    Note [a rank's exit]: a rank, the local launcher's or torchrun's, stops the checkpointer process a save
    started, destroys its process group, flushes its output and leaves with ``os._exit``, skipping the
    interpreter's teardown: about a second with torch loaded, and where gloo's threads still hold work, a
    teardown can abort the process (SIGABRT, "terminate called without an active exception") after a run
    that succeeded, which torchrun reports as the rank failing. Jobs close their own files.
    """
    checkpoints = sys.modules.get("shardlang.checkpoint.background")  # loaded only if a job saved
    if checkpoints is not None:
        checkpoints.stop_checkpointer_process()
    shutdown()
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _setup_process(rank: int, config: WorkerConfig) -> None:
    """Threads, output prefixes, Ctrl-C handling and the stack dump signal for one worker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["GLOO_SOCKET_IFNAME"] = config.gloo_interface  # gloo listens on loopback only
    # tqdm's default lock holds a multiprocessing semaphore (torch.fx's Interpreter makes a bar even when it
    # is off), and a rank ends with os._exit, which never unlinks it: the parent would warn of leaked
    # semaphores. Ranks write through their own streams, so a thread lock serves.
    tqdm.tqdm.set_lock(threading.RLock())
    drop_no_action_warnings()  # Note [torch's logs]
    if config.threads is not None:
        _limit_threads(config.threads)
    # A crash in native code (a segfault, malloc's abort) prints every thread's Python stack before the
    # process ends, so the failure says which job and which line were running.
    faulthandler.enable(file=sys.__stderr__, all_threads=True)
    if config.prefix_output.applies_to(rank):
        sys.stdout = _PrefixedStream(sys.stdout, f"[rank {rank}] ")
        sys.stderr = _PrefixedStream(sys.stderr, f"[rank {rank}] ")
    if hasattr(signal, "SIGUSR1"):
        stack_file = open(stack_path(config.stack_dir, rank), "a")  # noqa: SIM115  lives as long as the process
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)


def _join(rank: int, port: int, generation: int, config: WorkerConfig, conn: connection.Connection
          ) -> DistContext | None:
    """Join the pool's process group and report READY; report the error and return None if it fails."""
    try:
        store = join_store(port, generation, config.collective_timeout)
        ctx = init_with_store(rank, config.nproc, store, timeout_s=config.collective_timeout)
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


class LineStream(io.TextIOBase):
    """A text stream over ``inner`` that hands on whole lines to `_write_lines`; a partial line waits for its
    newline (`_take_partial` gives it up). The base of the ranks' prefixing streams and of the stream that
    prints above rank 0's bar (`shardlang.cli.progress`)."""

    def __init__(self, inner: Any):
        super().__init__()
        self.inner = inner
        self._partial = ""

    def write(self, text: str) -> int:
        *lines, self._partial = (self._partial + text).split("\n")
        if lines:
            self._write_lines(lines)
        return len(text)

    def _write_lines(self, lines: list[str]) -> None:
        raise NotImplementedError

    def _take_partial(self) -> str:
        partial, self._partial = self._partial, ""
        return partial

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return is_terminal(self.inner)

    def fileno(self) -> int:
        return self.inner.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self.inner, "encoding", "utf-8")


class _PrefixedStream(LineStream):
    """A text stream that writes whole lines, each starting with ``prefix``.

    A partial line waits for its newline (or an explicit flush), so that the lines
    of ranks sharing one terminal never interleave mid-line. On a terminal each
    line first clears the line the cursor is on: a line printed while rank 0's
    progress bar is drawn replaces the bar, which redraws below it at its next
    update, instead of being glued to its end.

    Example::

        >>> s = _PrefixedStream(io.StringIO(), "[rank 1] "); _ = s.write("a\\nb"); _ = s.write("c\\n")
        >>> s.inner.getvalue()
        '[rank 1] a\\n[rank 1] bc\\n'
    """

    def __init__(self, inner: Any, prefix: str):
        super().__init__(inner)
        self._start = CLEAR_LINE + prefix if is_terminal(inner) else prefix

    def _write_lines(self, lines: list[str]) -> None:
        self.inner.write("".join(f"{self._start}{line}\n" for line in lines))
        self.inner.flush()

    def flush(self) -> None:
        if partial := self._take_partial():
            self.inner.write(f"{self._start}{partial}")
        self.inner.flush()


def is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is a terminal (False for streams that cannot say)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
