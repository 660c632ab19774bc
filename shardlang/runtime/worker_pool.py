"""The parent side of the local launcher: `WorkerPool` (N persistent ranks) and `WorkerPools`.

`WorkerPool(nproc)` keeps the processes (and their process group) alive between
jobs, so that a test session pays the cost of spawning Python and importing
torch once per world size. `WorkerPools` keeps one pool per world size and
replaces broken ones; world size 1 runs in this process (`run_in_process`).
The ranks themselves run `worker.worker_main`; failures are described in
`failures` (Note [failures]).

Note [what a job is]: ``fn`` is a module-level function (pickled by reference, so
the workers must be able to import its module: the parent's ``sys.path`` is
passed to them) and ``args`` are picklable values. Each worker calls
``fn(ctx, *args)`` with its `DistContext`; the return value is pickled back.
Keyword arguments go through ``functools.partial(fn, key=value)``.

Note [pool states]: a pool is READY (every rank idle in one consistent process
group), BROKEN (a rank died, hung or was stopped; all workers are gone) or CLOSED.
When every rank of a failed job came back (some with errors), the pool recovers:
each rank destroys its process group and joins a fresh one on a new port, so no
half-finished collective can leak into the next job, and the pool stays READY.
Otherwise it is BROKEN, and `run` refuses work; make a new pool (`WorkerPools`
does so by itself).

Example::

    with WorkerPool(2) as pool:
        pool.run(total, 10)       # [30, 30]   (total: see `shardlang.runtime.launcher`)
        pool.run(total, 1)        # [3, 3], same processes, same process group
"""

from __future__ import annotations

import atexit
import contextlib
import pickle
import shutil
import signal
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from multiprocessing import connection, get_context
from typing import Any

import attrs

from shardlang.errors import ShardlangRuntimeError
from shardlang.runtime.dist import DEFAULT_COLLECTIVE_TIMEOUT_S, DistContext, check_timeout
from shardlang.runtime.failures import (
    FailureKind,
    PoolState,
    RankFailure,
    WorkerError,
    cause_first,
    exception_summary,
    job_name,
    read_stack,
    request_stack_dump,
)
from shardlang.runtime.rendezvous import LoopbackRendezvous, loopback_interface
from shardlang.runtime.worker import Command, OutputPrefix, Reply, WorkerConfig, worker_main

DEFAULT_TIMEOUT_S = 600.0
DEFAULT_GRACE_S = 3.0
STARTUP_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0
STACK_DUMP_WAIT_S = 0.3


@attrs.frozen
class _Worker:
    """The parent's handle on one rank."""

    rank: int
    process: Any
    conn: connection.Connection


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
        failure = RankFailure(0, FailureKind.RAISED, exception_summary(exc), traceback.format_exc())
        raise WorkerError(f"job {job_name(fn)}", (failure,), (), PoolState.READY) from exc


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
        prefix_output: OutputPrefix | bool = True,
        startup_timeout: float = STARTUP_TIMEOUT_S,
        collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
    ):
        check_nproc(nproc)
        check_timeout(collective_timeout, "collective_timeout")
        if timeout is not None:
            check_timeout(timeout, "timeout")
        check_timeout(startup_timeout, "startup_timeout")
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not 0 <= grace < float("inf"):
            raise ShardlangRuntimeError(f"grace={grace!r} is not a time in seconds; expected a number >= 0")
        if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
            raise ShardlangRuntimeError(f"threads={threads!r} is not a number of threads per rank; expected an "
                                        "integer >= 1, or None to leave torch's default")
        self._nproc = nproc
        self._timeout = timeout
        self._grace = grace
        self._startup_timeout = startup_timeout
        self._stack_dir = tempfile.mkdtemp(prefix="shardlang-pool-")
        self._config = WorkerConfig(nproc, threads, prefix_output, self._stack_dir, collective_timeout,
                                    loopback_interface())
        self._state = PoolState.READY
        self._broken_reason = ""
        self._workers: list[_Worker] = []
        self._generation = 0  # of the process group, one more per recovery (Note [loopback rendezvous])
        self._rendezvous = LoopbackRendezvous(max(startup_timeout, collective_timeout))
        self._release = weakref.finalize(self, _release, self._workers, self._stack_dir, self._rendezvous)
        atexit.register(self._release)  # runs before multiprocessing's own hook, which would wait for the ranks
        with self._broken_if_interrupted("starting"):
            self._start_workers(self._rendezvous.port)
            self._await_ready(f"starting {nproc} rank(s)")

    @property
    def nproc(self) -> int:
        """The number of ranks (the world size)."""
        return self._nproc

    @property
    def state(self) -> PoolState:
        """READY, BROKEN or CLOSED (Note [pool states])."""
        return self._state

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, name: str | None = None
            ) -> list[Any]:
        """Run ``fn(ctx, *args)`` on every rank; the results in rank order.

        ``timeout`` defaults to the pool's. ``name`` is what a failure calls the job
        (default ``job <module>.<function>``; the command line names the command and its job file).
        Raises `WorkerError` when a rank fails, and ShardlangRuntimeError when the pool is not
        READY or ``fn``/``args`` cannot be pickled (the pool stays READY then).
        """
        self._check_ready()
        payload = _pickle_job(fn, args)
        what = name or f"job {job_name(fn)}"
        with self._broken_if_interrupted(what):
            self._send_all((Command.RUN, payload))
            replies, failures = self._gather(self._timeout if timeout is None else timeout)
            if failures:
                self._recover_or_break(what, failures, replies)
        return [_unpickle_result(what, rank, replies[rank][1]) for rank in range(self._nproc)]

    def close(self) -> None:
        """Stop every rank and free the pool; safe to call twice. (At interpreter exit, unclosed
        pools are killed: see `_release`.)"""
        if self._state is PoolState.READY:
            self._send_all((Command.STOP,))
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
                target=worker_main,
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
        late: set[int] = set()  # ranks a peer's timed-out collective found late
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
                elif reply[0] is Reply.ERROR:
                    failures.append(RankFailure(rank, FailureKind.RAISED, reply[1], reply[2]))
                    late.update(reply[3] if len(reply) > 3 else ())
                    deadline = _grace_deadline(deadline, self._grace, len(failures))
                else:
                    replies[rank] = reply
        still_running = FailureKind.STOPPED if failures else FailureKind.TIMED_OUT
        failures.extend(self._stacks_of(sorted(pending), still_running, timeout, late))
        return replies, sorted(failures, key=cause_first)

    def _stacks_of(self, ranks: list[int], kind: FailureKind, timeout: float | None,
                   late: set[int]) -> list[RankFailure]:
        """Failures for ranks still running, each with its Python stack when it can be dumped; those in
        ``late`` are LATE (Note [failures])."""
        if not ranks:
            return []
        for rank in ranks:
            request_stack_dump(self._workers[rank].process)
        time.sleep(STACK_DUMP_WAIT_S)
        detail = f"after {timeout:.3g} s" if kind is FailureKind.TIMED_OUT and timeout is not None else ""
        late_detail = "(a peer's collective timed out waiting for it; stopped)"
        return [RankFailure(r, FailureKind.LATE, late_detail, read_stack(self._stack_dir, r)) if r in late
                else RankFailure(r, kind, detail, read_stack(self._stack_dir, r)) for r in ranks]

    def _recover_or_break(self, what: str, failures: list[RankFailure], replies: dict[int, tuple]) -> None:
        """Note [pool states]: rejoin a fresh process group if every rank came back; then raise."""
        if any(f.kind is not FailureKind.RAISED for f in failures):
            self._break(what, failures, replies)
        self._generation += 1
        self._send_all((Command.RESET, self._generation))
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
        check_nproc(world_size)
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


def _release(workers: list[_Worker], stack_dir: str, rendezvous: LoopbackRendezvous) -> None:
    """Kill the ranks still alive, reap them, close their pipes, stop the rendezvous and remove the stack files.

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
    rendezvous.close()
    shutil.rmtree(stack_dir, ignore_errors=True)


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
    return RankFailure(worker.rank, FailureKind.DIED, _exit_detail(worker.process.exitcode))


def _exit_detail(code: int | None) -> str:
    """How a process ended, as a user reads it: ``of SIGKILL (signal 9)`` or ``with exit code 3``."""
    if code is not None and code < 0:
        try:
            return f"of {signal.Signals(-code).name} (signal {-code})"
        except ValueError:
            return f"of signal {-code}"
    return f"with exit code {code}"


def _seconds_left(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


def _grace_deadline(deadline: float | None, grace: float, failures: int) -> float | None:
    """Note [failures]: from the first failure on, the other ranks have ``grace`` more seconds at most."""
    if failures != 1:
        return deadline
    end = time.monotonic() + grace
    return end if deadline is None else min(deadline, end)


def _unpickle_result(what: str, rank: int, data: bytes) -> Any:
    try:
        return pickle.loads(data)
    except Exception as exc:
        raise ShardlangRuntimeError(
            f"{what}: the result of rank {rank} cannot be unpickled here ({exception_summary(exc)}); "
            "return plain data (tensors, numbers, containers) or types this process can import"
        ) from exc


def _pickle_job(fn: Callable[..., Any], args: tuple) -> bytes:
    try:
        return pickle.dumps((fn, args))
    except Exception as exc:
        raise ShardlangRuntimeError(
            f"job {job_name(fn)} cannot be sent to the workers: {exception_summary(exc)}; "
            "the function must be defined at module level of an importable module, and its arguments picklable"
        ) from exc


def check_nproc(nproc: int) -> None:
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ShardlangRuntimeError(f"nproc={nproc!r} is not a number of processes; expected an integer >= 1")
