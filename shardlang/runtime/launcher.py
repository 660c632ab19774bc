"""The local launcher: N ranks as CPU processes on this machine, joined over gloo.

`launch(fn, nproc, *args)` starts ``nproc`` fresh processes, runs ``fn(ctx, *args)``
on each and returns the results in rank order. `WorkerPool(nproc)` keeps the
processes (and their process group) alive between jobs, so that a test session
pays the cost of spawning Python and importing torch once per world size.
`WorkerPools` keeps one pool per world size and replaces broken ones.

Note [what a job is]: ``fn`` is a module-level function (pickled by reference, so
the workers must be able to import its module: the parent's ``sys.path`` is
passed to them) and ``args`` are picklable values. Each worker calls
``fn(ctx, *args)`` with its `DistContext`; the return value is pickled back.
Keyword arguments go through ``functools.partial(fn, key=value)``.

Note [failures]: a job fails when a rank raises, dies, or outlives the timeout.
The caller gets a `WorkerError` (a ShardlangRuntimeError) naming each rank, what
happened to it and its traceback. After the first rank fails, the others get
``grace`` seconds to finish; a rank still running then is usually waiting in a
collective for the failed one, so it is stopped, and its Python stack (dumped on
SIGUSR1 where the platform has it) is reported in place of a traceback.

Note [pool states]: a pool is READY (every rank idle in one consistent process
group), BROKEN (a rank died, hung or was stopped; all workers are gone) or CLOSED.
When every rank of a failed job came back (some with errors), the pool recovers:
each rank destroys its process group and joins a fresh one on a new port, so no
half-finished collective can leak into the next job, and the pool stays READY.
Otherwise it is BROKEN, and `run` refuses work; make a new pool (`WorkerPools`
does so by itself).

Example::

    from shardlang.runtime import launch

    def total(ctx, x):                          # module-level, so workers can import it
        t = torch.tensor([x * (ctx.rank + 1)])
        torch.distributed.all_reduce(t)
        return t.item()

    launch(total, 2, 10)                        # [30, 30]
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import faulthandler
import io
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from multiprocessing import connection, get_context
from typing import Any

import attrs
import torch

from shardlang.compiler.errors import ShardlangRuntimeError
from shardlang.runtime.dist import DistContext, init_process_group, shutdown

LOCALHOST = "127.0.0.1"
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_GRACE_S = 3.0
STARTUP_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0
STACK_DUMP_WAIT_S = 0.3


class PoolState(enum.Enum):
    """Where a WorkerPool stands (Note [pool states])."""

    READY = "ready"
    BROKEN = "broken"
    CLOSED = "closed"


class FailureKind(enum.Enum):
    """What happened to a rank whose job did not return a value; declared from likely cause to consequence."""

    DIED = "died"
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
        """The ranks that raised, died or timed out, in order."""
        return tuple(f.rank for f in self.failures if f.kind is not FailureKind.STOPPED)


class _Command(enum.Enum):
    RUN = "run"
    RESET = "reset"
    STOP = "stop"


class _Reply(enum.Enum):
    READY = "ready"
    OK = "ok"
    ERROR = "error"


@attrs.frozen
class _WorkerConfig:
    """What every worker of a pool is started with."""

    nproc: int
    threads: int | None
    prefix_output: bool
    stack_dir: str


@attrs.frozen
class _Worker:
    """The parent's handle on one rank."""

    rank: int
    process: Any
    conn: connection.Connection


def find_free_port(host: str = LOCALHOST) -> int:
    """A TCP port on ``host`` that was free a moment ago (the kernel's pick for port 0).

    Example::

        >>> 0 < find_free_port() < 65536
        True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def launch(
    fn: Callable[..., Any],
    nproc: int,
    *args: Any,
    timeout: float | None = DEFAULT_TIMEOUT_S,
    grace: float = DEFAULT_GRACE_S,
    threads: int | None = 1,
    prefix_output: bool = True,
) -> list[Any]:
    """Run ``fn(ctx, *args)`` on ``nproc`` new CPU processes over gloo; the results in rank order.

    ``timeout`` (seconds, None for no limit) covers start-up and the job; a rank
    still running then is killed and reported. ``threads`` sets each rank's torch
    and OpenMP threads (None leaves them alone). A failure raises `WorkerError`
    (Note [failures]). World size 1 starts one process with no process group.

    Example::

        launch(total, 2, 10)      # [30, 30]   (see the module docstring)
    """
    started = time.monotonic()
    with WorkerPool(
        nproc,
        timeout=timeout,
        grace=grace,
        threads=threads,
        prefix_output=prefix_output,
        startup_timeout=STARTUP_TIMEOUT_S if timeout is None else timeout,
    ) as pool:
        left = None if timeout is None else max(timeout - (time.monotonic() - started), 0.0)
        try:
            return pool.run(fn, *args, timeout=left)
        except WorkerError as exc:  # the pool's state means nothing to launch's caller: every rank is gone
            raise WorkerError(exc.what, exc.failures, exc.finished, PoolState.CLOSED) from None


def run_in_process(fn: Callable[..., Any], *args: Any) -> list[Any]:
    """Run ``fn(ctx, *args)`` as the only rank, in this process, with no process group.

    The world-size-1 counterpart of `WorkerPool.run`: same call, same result shape,
    and an exception comes back as a `WorkerError` naming rank 0 (the original is
    its ``__cause__``).

    Example::

        >>> run_in_process(lambda ctx, x: (ctx.world_size, x), 7)
        [(1, 7)]
    """
    try:
        return [fn(DistContext.single(), *args)]
    except Exception as exc:
        failure = RankFailure(0, FailureKind.RAISED, _summary(exc), traceback.format_exc())
        raise WorkerError(f"job {_job_name(fn)}", (failure,), (), PoolState.READY) from exc


class WorkerPool:
    """N persistent ranks on this machine, joined once over gloo, that run many jobs.

    Jobs follow Note [what a job is]; failures Note [failures]; states Note [pool states].

    Example::

        with WorkerPool(2) as pool:
            pool.run(total, 10)       # [30, 30]
            pool.run(total, 1)        # [3, 3], same processes, same process group
    """

    def __init__(
        self,
        nproc: int,
        *,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        grace: float = DEFAULT_GRACE_S,
        threads: int | None = 1,
        prefix_output: bool = True,
        startup_timeout: float = STARTUP_TIMEOUT_S,
    ):
        _check_nproc(nproc)
        self._nproc = nproc
        self._timeout = timeout
        self._grace = grace
        self._startup_timeout = startup_timeout
        self._stack_dir = tempfile.mkdtemp(prefix="shardlang-pool-")
        self._config = _WorkerConfig(nproc, threads, prefix_output, self._stack_dir)
        self._state = PoolState.READY
        self._broken_reason = ""
        self._workers: list[_Worker] = []
        self._release = weakref.finalize(self, _release, self._workers, self._stack_dir)
        atexit.register(self._release)  # runs before multiprocessing's own hook, which would wait for the ranks
        with self._broken_if_interrupted("starting"):
            self._start_workers(find_free_port())
            self._await_ready(f"starting {nproc} rank(s)")

    @property
    def nproc(self) -> int:
        """The number of ranks (the world size)."""
        return self._nproc

    @property
    def state(self) -> PoolState:
        """READY, BROKEN or CLOSED (Note [pool states])."""
        return self._state

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        """Run ``fn(ctx, *args)`` on every rank; the results in rank order.

        ``timeout`` defaults to the pool's. Raises `WorkerError` when a rank fails,
        and ShardlangRuntimeError when the pool is not READY or ``fn``/``args``
        cannot be pickled (the pool stays READY then).
        """
        self._check_ready()
        payload = _pickle_job(fn, args)
        what = f"job {_job_name(fn)}"
        with self._broken_if_interrupted(what):
            self._send_all((_Command.RUN, payload))
            replies, failures = self._gather(self._timeout if timeout is None else timeout)
            if failures:
                self._recover_or_break(what, failures, replies)
        return [_unpickle_result(what, rank, replies[rank][1]) for rank in range(self._nproc)]

    def close(self) -> None:
        """Stop every rank and free the pool; safe to call twice. (At interpreter exit, unclosed
        pools are killed: see `_release`.)"""
        if self._state is PoolState.READY:
            self._send_all((_Command.STOP,))
            for worker in self._workers:
                worker.process.join(STOP_TIMEOUT_S)
        self._release()
        self._state = PoolState.CLOSED

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"WorkerPool(nproc={self._nproc}, state={self._state.name})"

    def _start_workers(self, port: int) -> None:
        """Spawn the ranks. Not daemons, so that jobs may start processes of their own (DataLoader
        workers); `_release` still ends them when the pool is closed, broken, collected or at exit."""
        mp = get_context("spawn")
        for rank in range(self._nproc):
            parent_end, child_end = mp.Pipe(duplex=True)
            process = mp.Process(
                target=_worker_main,
                args=(rank, port, self._config, child_end),
                name=f"shardlang-rank-{rank}",
                daemon=False,
            )
            process.start()
            child_end.close()
            self._workers.append(_Worker(rank, process, parent_end))

    @contextlib.contextmanager
    def _broken_if_interrupted(self, what: str) -> Iterator[None]:
        """Anything but a WorkerError escaping (Ctrl-C, a bug) leaves ranks mid-job: break the pool."""
        try:
            yield
        except WorkerError:
            raise
        except BaseException:
            self._release()
            self._state = PoolState.BROKEN
            self._broken_reason = f"interrupted while {what}"
            raise

    def _await_ready(self, what: str) -> None:
        """Wait for every rank to report a process group; break the pool if one does not."""
        replies, failures = self._gather(self._startup_timeout)
        if failures:
            self._break(what, failures, replies)

    def _check_ready(self) -> None:
        if self._state is not PoolState.READY:
            reason = f" ({self._broken_reason})" if self._broken_reason else ""
            raise ShardlangRuntimeError(
                f"{self!r} cannot run jobs{reason}; create a new WorkerPool "
                "(shardlang.runtime.WorkerPools replaces broken pools by itself)"
            )

    def _send_all(self, message: tuple) -> None:
        """Send ``message`` to every rank; a rank that died is found by `_gather`."""
        for worker in self._workers:
            try:
                worker.conn.send(message)
            except OSError:
                pass

    def _gather(self, timeout: float | None) -> tuple[dict[int, tuple], list[RankFailure]]:
        """One reply per rank, or a failure per rank that raised, died, hung or was stopped."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = {worker.rank: worker for worker in self._workers}
        replies: dict[int, tuple] = {}
        failures: list[RankFailure] = []
        while pending:
            wait_s = _seconds_left(deadline)
            if wait_s is not None and wait_s <= 0:
                break
            handles = [w.conn for w in pending.values()] + [w.process.sentinel for w in pending.values()]
            connection.wait(handles, wait_s)
            for rank, worker in list(pending.items()):
                reply = _poll(worker)
                if reply is None:
                    continue
                del pending[rank]
                if isinstance(reply, RankFailure):
                    failures.append(reply)
                    deadline = _grace_deadline(deadline, self._grace, len(failures))
                elif reply[0] is _Reply.ERROR:
                    failures.append(RankFailure(rank, FailureKind.RAISED, reply[1], reply[2]))
                    deadline = _grace_deadline(deadline, self._grace, len(failures))
                else:
                    replies[rank] = reply
        late_kind = FailureKind.STOPPED if failures else FailureKind.TIMED_OUT
        failures.extend(self._stacks_of(sorted(pending), late_kind, timeout))
        return replies, sorted(failures, key=_cause_first)

    def _stacks_of(self, ranks: list[int], kind: FailureKind, timeout: float | None) -> list[RankFailure]:
        """Failures for ranks still running, each with its Python stack when it can be dumped."""
        if not ranks:
            return []
        for rank in ranks:
            _request_stack_dump(self._workers[rank].process)
        time.sleep(STACK_DUMP_WAIT_S)
        detail = f"after {timeout:.3g} s" if kind is FailureKind.TIMED_OUT and timeout is not None else ""
        return [RankFailure(r, kind, detail, _read_stack(self._stack_dir, r)) for r in ranks]

    def _recover_or_break(self, what: str, failures: list[RankFailure], replies: dict[int, tuple]) -> None:
        """Note [pool states]: rejoin a fresh process group if every rank came back; then raise."""
        if any(f.kind is not FailureKind.RAISED for f in failures):
            self._break(what, failures, replies)
        self._send_all((_Command.RESET, find_free_port()))
        _, reset_failures = self._gather(self._startup_timeout)
        if reset_failures:
            self._break(what, failures + reset_failures, replies)
        raise WorkerError(what, tuple(failures), tuple(sorted(replies)), self._state)

    def _break(self, what: str, failures: list[RankFailure], replies: dict[int, tuple]) -> None:
        """Stop every worker, mark the pool BROKEN, and raise the failures."""
        self._release()
        self._state = PoolState.BROKEN
        self._broken_reason = f"{what} failed: " + "; ".join(f.headline() for f in failures)
        raise WorkerError(what, tuple(failures), tuple(sorted(replies)), self._state)



class WorkerPools:
    """One WorkerPool per world size, started on first use and replaced when broken.

    World size 1 runs in this process with no process group (`run_in_process`).
    ``pool_options`` go to each `WorkerPool`.

    Example::

        pools = WorkerPools()
        pools.run(2, total, 10)       # [30, 30]; starts the 2-rank pool
        pools.run(1, total, 10)       # [10]; in this process
        pools.close()
    """

    def __init__(self, **pool_options: Any):
        self._options = pool_options
        self._pools: dict[int, WorkerPool] = {}

    def get(self, world_size: int) -> WorkerPool:
        """The READY pool of ``world_size`` ranks, started (or restarted, if broken) as needed."""
        _check_nproc(world_size)
        pool = self._pools.get(world_size)
        if pool is None or pool.state is not PoolState.READY:
            pool = WorkerPool(world_size, **self._options)
            self._pools[world_size] = pool
        return pool

    def run(self, world_size: int, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        """``fn(ctx, *args)`` on every rank of a world of ``world_size``; the results in rank order."""
        if world_size == 1:
            return run_in_process(fn, *args)
        return self.get(world_size).run(fn, *args, timeout=timeout)

    def close(self) -> None:
        """Close every pool."""
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def _release(workers: list[_Worker], stack_dir: str) -> None:
    """Kill the ranks still alive, reap them, close their pipes and remove the stack files.

    Runs once per pool, through `weakref.finalize`: from close(), when the pool breaks,
    when it is garbage-collected, or at interpreter exit (before multiprocessing would
    wait for its non-daemon children).
    """
    for worker in workers:
        if worker.process.is_alive():
            worker.process.kill()
    for worker in workers:
        worker.process.join(STOP_TIMEOUT_S)
        worker.conn.close()
    shutil.rmtree(stack_dir, ignore_errors=True)


def _worker_main(rank: int, port: int, config: _WorkerConfig, conn: connection.Connection) -> None:
    """A rank's life: set up the process, join the group, then serve commands until STOP."""
    _setup_process(rank, config)
    ctx = _join(rank, port, config, conn)
    while ctx is not None:
        try:
            command, *rest = conn.recv()
        except (EOFError, OSError):
            break
        if command is _Command.STOP:
            break
        if command is _Command.RUN:
            conn.send(_run_job(ctx, rest[0]))
        elif command is _Command.RESET:
            shutdown()
            ctx = _join(rank, rest[0], config, conn)
    shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown (about a second with torch loaded); jobs close their own files


def _setup_process(rank: int, config: _WorkerConfig) -> None:
    """Threads, output prefixes, Ctrl-C handling and the stack dump signal for one worker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if config.threads is not None:
        _limit_threads(config.threads)
    if config.prefix_output:
        sys.stdout = _PrefixedStream(sys.stdout, f"[rank {rank}] ")
        sys.stderr = _PrefixedStream(sys.stderr, f"[rank {rank}] ")
    if hasattr(signal, "SIGUSR1"):
        stack_file = open(_stack_path(config.stack_dir, rank), "a")  # noqa: SIM115  lives as long as the process
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)


def _join(rank: int, port: int, config: _WorkerConfig, conn: connection.Connection) -> DistContext | None:
    """Join the pool's process group and report READY; report the error and return None if it fails."""
    try:
        ctx = init_process_group(rank, config.nproc, LOCALHOST, port, "gloo")
    except BaseException as exc:
        conn.send((_Reply.ERROR, _summary(exc), traceback.format_exc()))
        return None
    conn.send((_Reply.READY,))
    return ctx


def _run_job(ctx: DistContext, payload: bytes) -> tuple:
    """Unpickle and run one job; the reply to send back (Note [what a job is])."""
    try:
        fn, args = pickle.loads(payload)
        result = fn(ctx, *args)
    except BaseException as exc:
        return (_Reply.ERROR, _summary(exc), traceback.format_exc())
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    try:
        return (_Reply.OK, pickle.dumps(result))
    except Exception as exc:
        return (_Reply.ERROR, f"returned a value that cannot be pickled ({_summary(exc)})", traceback.format_exc())


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


def _poll(worker: _Worker) -> tuple | RankFailure | None:
    """The rank's reply if one arrived, a DIED failure if its process ended without one, else None."""
    alive = worker.process.is_alive()  # read before polling: a reply sent just before exiting still counts
    try:
        if worker.conn.poll():
            return worker.conn.recv()
    except (EOFError, OSError):
        pass
    else:
        if alive:
            return None
    worker.process.join(1.0)
    return RankFailure(worker.rank, FailureKind.DIED, f"with exit code {worker.process.exitcode}")


def _cause_first(failure: RankFailure) -> tuple[int, int]:
    """Sort key: likely causes first. A rank that dies makes its peers' collectives raise
    (gloo: "Connection reset by peer"), and one that raises leaves them waiting."""
    return list(FailureKind).index(failure.kind), failure.rank


def _seconds_left(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


def _grace_deadline(deadline: float | None, grace: float, failures: int) -> float | None:
    """Note [failures]: from the first failure on, the other ranks have ``grace`` more seconds at most."""
    if failures != 1:
        return deadline
    end = time.monotonic() + grace
    return end if deadline is None else min(deadline, end)


def _request_stack_dump(process: Any) -> None:
    if hasattr(signal, "SIGUSR1") and process.is_alive():
        try:
            os.kill(process.pid, signal.SIGUSR1)
        except OSError:
            pass


def _stack_path(stack_dir: str, rank: int) -> str:
    return os.path.join(stack_dir, f"rank{rank}.stack")


def _read_stack(stack_dir: str, rank: int) -> str:
    try:
        with open(_stack_path(stack_dir, rank)) as file:
            text = file.read().strip()
    except OSError:
        return ""
    return f"Python stack when stopped:\n{text}" if text else ""


def _unpickle_result(what: str, rank: int, data: bytes) -> Any:
    try:
        return pickle.loads(data)
    except Exception as exc:
        raise ShardlangRuntimeError(
            f"{what}: the result of rank {rank} cannot be unpickled here ({_summary(exc)}); "
            "return plain data (tensors, numbers, containers) or types this process can import"
        ) from exc


def _pickle_job(fn: Callable[..., Any], args: tuple) -> bytes:
    try:
        return pickle.dumps((fn, args))
    except Exception as exc:
        raise ShardlangRuntimeError(
            f"job {_job_name(fn)} cannot be sent to the workers: {_summary(exc)}; "
            "the function must be defined at module level of an importable module, and its arguments picklable"
        ) from exc


def _check_nproc(nproc: int) -> None:
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ShardlangRuntimeError(f"nproc={nproc!r} is not a number of processes; expected an integer >= 1")


def _job_name(fn: Callable[..., Any]) -> str:
    inner = getattr(fn, "func", fn)  # functools.partial
    return f"{getattr(inner, '__module__', '?')}.{getattr(inner, '__qualname__', repr(inner))}"


def _summary(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


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
