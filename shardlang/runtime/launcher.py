"""The local launcher: N ranks as CPU processes on this machine, joined over gloo.

`launch(fn, nproc, *args)` starts ``nproc`` fresh processes, runs ``fn(ctx, *args)``
on each and returns the results in rank order. This module is the public entry
point; the machinery lives one concern per module and is re-exported here:

- `worker_pool`: `WorkerPool` (persistent ranks that run many jobs), `WorkerPools`
  (one pool per world size), `run_in_process`; Note [what a job
  is] and Note [pool states].
- `worker`: what each spawned rank runs (its command loop).
- `failures`: `FailureKind`, `RankFailure`, `WorkerError`, `PoolState`; Note [failures].

Example::

    from shardlang.runtime import launch

    def total(ctx, x):                          # module-level, so workers can import it
        t = torch.tensor([x * (ctx.rank + 1)])
        torch.distributed.all_reduce(t)
        return t.item()

    launch(total, 2, 10)                        # [30, 30]
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from shardlang.runtime.dist import DEFAULT_COLLECTIVE_TIMEOUT_S
from shardlang.runtime.failures import FailureKind, PoolState, RankFailure, WorkerError
from shardlang.runtime.rendezvous import LOCALHOST
from shardlang.runtime.worker import OutputPrefix
from shardlang.runtime.worker_pool import (
    DEFAULT_GRACE_S,
    DEFAULT_TIMEOUT_S,
    STARTUP_TIMEOUT_S,
    STOP_TIMEOUT_S,
    WorkerPool,
    WorkerPools,
    run_in_process,
)

__all__ = [
    "DEFAULT_GRACE_S",
    "DEFAULT_TIMEOUT_S",
    "LOCALHOST",
    "STARTUP_TIMEOUT_S",
    "STOP_TIMEOUT_S",
    "FailureKind",
    "OutputPrefix",
    "PoolState",
    "RankFailure",
    "WorkerError",
    "WorkerPool",
    "WorkerPools",
    "launch",
    "run_in_process",
]


def launch(
    fn: Callable[..., Any],
    nproc: int,
    *args: Any,
    timeout: float | None = DEFAULT_TIMEOUT_S,
    grace: float = DEFAULT_GRACE_S,
    threads: int | None = 1,
    prefix_output: OutputPrefix | bool = True,
    collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
    name: str | None = None,
) -> list[Any]:
    """Run ``fn(ctx, *args)`` on ``nproc`` new CPU processes over gloo; the results in rank order.

    ``timeout`` (seconds, None for no limit) covers start-up and the job; a rank
    still running then is killed and reported. ``collective_timeout`` bounds each
    collective's wait for late peers (Note [collective timeout] in `watch`). ``threads`` sets each rank's torch
    and OpenMP threads (None leaves them alone); ``prefix_output`` which ranks' lines start with
    ``[rank r] `` (`OutputPrefix`). ``name`` is what a failure calls the job (default: the
    function's qualified name). A failure raises `WorkerError`
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
        collective_timeout=collective_timeout,
    ) as pool:
        left = None if timeout is None else max(timeout - (time.monotonic() - started), 0.0)
        try:
            return pool.run(fn, *args, timeout=left, name=name)
        except WorkerError as exc:  # the pool's state means nothing to launch's caller: every rank is gone
            raise WorkerError(exc.what, exc.failures, exc.finished, PoolState.CLOSED) from None
