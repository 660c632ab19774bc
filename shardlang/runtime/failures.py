"""How a job on the local launcher's ranks fails: `FailureKind`, `RankFailure`, `WorkerError`.

Also the pool states a failure leaves behind (`PoolState`), the one-line
summaries of exceptions and jobs, and the files where a stopped rank's Python
stack is dumped. The parent side (`worker_pool`) builds these; the caller sees
`WorkerError`.

Note [failures]: a job fails when a rank raises, dies, or outlives the timeout.
The caller gets a `WorkerError` (a ShardlangRuntimeError) naming each rank, what
happened to it and its traceback. After the first rank fails, the others get
``grace`` seconds to finish; a rank still running then is usually waiting in a
collective for the failed one, so it is stopped, and its Python stack (dumped on
SIGUSR1 where the platform has it) is reported in place of a traceback. A rank
that a peer's timed-out collective found late (it had not begun the step; Note
[collective timeout] in `watch`) is the cause, not a consequence: it is reported
first, as LATE, with the stack of what it was doing instead.

Example::

    >>> error = WorkerError("job f", (RankFailure(1, FailureKind.RAISED, "ValueError: boom"),), (0,), PoolState.READY)
    >>> error.ranks
    (1,)
"""

from __future__ import annotations

import enum
import functools
import os
import re
import signal
import sysconfig
from collections.abc import Callable
from typing import Any

import attrs

from shardlang.errors import ShardlangRuntimeError


class PoolState(enum.Enum):
    """Where a WorkerPool stands (Note [pool states] in `worker_pool`)."""

    READY = "ready"
    BROKEN = "broken"
    CLOSED = "closed"


class FailureKind(enum.Enum):
    """What happened to a rank whose job did not return a value; declared from likely cause to consequence."""

    DIED = "died"
    LATE = "was late"  # still running when a peer's collective timed out waiting for it (Note [collective timeout])
    RAISED = "raised"
    TIMED_OUT = "timed out"
    STOPPED = "was stopped while still running"


@attrs.frozen
class RankFailure:
    """One rank's part in a failed job: what happened, a one-line detail, and the traceback text.

    Example::

        >>> RankFailure(1, FailureKind.RAISED, "ValueError: boom").headline()
        'rank 1 raised ValueError: boom'
    """

    rank: int
    kind: FailureKind
    detail: str = ""
    traceback: str = ""

    def headline(self) -> str:
        """The failure in one line."""
        return f"rank {self.rank} {self.kind.value}" + (f" {self.detail}" if self.detail else "")

    def user_frame(self) -> str | None:
        """Where in the user's code this rank was: the innermost frame of its traceback or stack that lies
        outside Python's library, torch and shardlang, as ``file:line in function``; None when there is none.

        Example::

            >>> RankFailure(1, FailureKind.LATE, traceback='  File "/jobs/a.py", line 9 in make_batch').user_frame()
            '/jobs/a.py:9 in make_batch'
        """
        return user_frame(self.traceback)


class WorkerError(ShardlangRuntimeError):
    """A job failed on some ranks; ``failures`` says how, rank by rank (Note [failures]).

    ``ranks`` are the ranks that caused the failure (raised, died or timed out), not
    those stopped afterwards; ``finished`` the ranks that returned normally;
    ``pool_state`` the pool's state after the failure (CLOSED from `launch`).
    """

    def __init__(self, what: str, failures: tuple[RankFailure, ...], finished: tuple[int, ...], pool_state: PoolState):
        self.what = what
        self.failures = failures
        self.finished = finished
        self.pool_state = pool_state
        super().__init__(_failure_message(what, failures, finished, pool_state))

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks that raised, died, timed out or were late, in order."""
        return tuple(f.rank for f in self.failures if f.kind is not FailureKind.STOPPED)


def _failure_message(
    what: str, failures: tuple[RankFailure, ...], finished: tuple[int, ...], pool_state: PoolState
) -> str:
    lines = [f"{what} failed: " + "; ".join(f.headline() for f in failures)]
    if finished:
        lines[0] += f" (rank{'s' if len(finished) > 1 else ''} {', '.join(map(str, finished))} finished)"
    for failure in failures:
        if failure.traceback:
            lines.append(f"--- rank {failure.rank} ---")
            lines.append(failure.traceback.rstrip())
    if pool_state is PoolState.BROKEN:
        lines.append("every rank was stopped (a WorkerPool left BROKEN cannot run more jobs; create a new one)")
    elif pool_state is PoolState.READY and (finished or len(failures) > 1):
        lines.append("every rank came back; the ranks joined a fresh process group and the pool is still READY")
    return "\n".join(lines)


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+),? in (?P<function>\S+)')


def user_frame(text: str) -> str | None:
    """The innermost user frame in a Python traceback or a faulthandler stack (`RankFailure.user_frame`)."""
    current = text.split("Current thread", 1)[-1]  # faulthandler: the thread that was running the job
    frames = [m for m in _FRAME.finditer(current) if not _is_library(m["file"])]
    if not frames:
        return None
    # A traceback lists the innermost frame last; faulthandler's stack ("most recent call first") first.
    frame = frames[0] if "most recent call first" in text else frames[-1]
    path = frame["file"]
    here = os.path.join(os.getcwd(), "")
    return f"{path.removeprefix(here)}:{frame['line']} in {frame['function']}"


def _is_library(path: str) -> bool:
    if path.startswith("<"):
        return True
    return any(path.startswith(root) for root in _library_roots())


@functools.cache
def _library_roots() -> tuple[str, ...]:
    import torch

    import shardlang
    import shardlang.compiler

    roots = {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots |= {os.path.dirname(module.__file__) for module in (torch, shardlang, shardlang.compiler)}
    return tuple(os.path.join(root, "") for root in roots)


def cause_first(failure: RankFailure) -> tuple[int, int]:
    """Sort key: likely causes first. A rank that dies makes its peers' collectives raise
    (gloo: "Connection reset by peer"), and one that raises leaves them waiting."""
    return list(FailureKind).index(failure.kind), failure.rank


def exception_summary(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def job_name(fn: Callable[..., Any]) -> str:
    inner = getattr(fn, "func", fn)  # functools.partial
    return f"{getattr(inner, '__module__', '?')}.{getattr(inner, '__qualname__', repr(inner))}"


def request_stack_dump(process: Any) -> None:
    if hasattr(signal, "SIGUSR1") and process.is_alive():
        try:
            os.kill(process.pid, signal.SIGUSR1)
        except OSError:
            pass


def stack_path(stack_dir: str, rank: int) -> str:
    return os.path.join(stack_dir, f"rank{rank}.stack")


def read_stack(stack_dir: str, rank: int) -> str:
    try:
        with open(stack_path(stack_dir, rank)) as file:
            text = file.read().strip()
    except OSError:
        return ""
    return f"Python stack when stopped:\n{text}" if text else ""
