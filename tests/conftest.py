"""Fixtures shared by the whole suite: running a function on N ranks.

Multi-process tests call ``run_on(world_size, fn, *args)``: it runs
``fn(ctx, *args)`` on every rank of a world of ``world_size`` and returns the
results in rank order (``ctx`` is a `shardlang.runtime.DistContext`)::

    import workers_for_my_tests as w            # a module in tests/

    def test_sum(run_on):
        assert run_on(2, w.all_reduce_rank) == [1, 1]

- World size 1 runs in this process, with no process group.
- Other world sizes run on one `shardlang.runtime.WorkerPool` per world size, started
  the first time a test asks for it and kept for the whole session (spawning Python
  and importing torch costs seconds on 2 cores; a job on a warm pool, milliseconds).
- A failure on any rank raises `shardlang.runtime.WorkerError` (a
  ShardlangRuntimeError) naming the rank, with its traceback. If the failure broke
  the pool (a rank died, hung, or was stopped while waiting for a failed peer), the
  next ``run_on`` starts a fresh one; otherwise the pool recovered (see
  `shardlang.runtime.worker_pool`, Note [pool states]).
- ``pools`` (a `shardlang.runtime.WorkerPools`) gives the pools themselves.

Where worker functions live: ``tests/`` is deliberately not a package. pytest's
default ("prepend") import mode puts ``tests/`` on ``sys.path`` and imports each
file under its own name (``test_launcher``, ``parity``), and the spawned workers
inherit the parent's ``sys.path``; this file also adds ``tests/`` in case another
import mode is used. So ``fn`` must be a module-level function of a module in
``tests/``: a test file itself (the workers then import it, pytest included) or a
helper module such as ``tests/parity.py``. Lambdas and local functions cannot be
sent to workers; pass extra values as arguments or through ``functools.partial``.
Workers keep their state between jobs (seeded RNGs, default dtype): a worker
function that depends on such state sets it itself.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from shardlang.runtime import WorkerPools

TESTS_DIR = str(Path(__file__).resolve().parent)
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)

JOB_TIMEOUT_S = 300.0  # a hung collective fails its test after this long, never the whole session
GRACE_S = 3.0  # after one rank fails, how long the others may take to finish


@pytest.fixture(scope="session")
def pools() -> Iterator[WorkerPools]:
    """One WorkerPool per world size for the session, started on first use, replaced when broken."""
    session_pools = WorkerPools(timeout=JOB_TIMEOUT_S, grace=GRACE_S)
    yield session_pools
    session_pools.close()


@pytest.fixture(scope="session")
def run_on(pools: WorkerPools) -> Callable[..., list[Any]]:
    """``run_on(world_size, fn, *args, timeout=None) -> [result of rank 0, rank 1, ...]``."""
    return pools.run


@pytest.fixture(scope="session")
def references() -> Callable[..., Any]:
    """``references(case, optimizer, dtype="float64", steps=3)``: one process's training, cached for the session.

    Returns `parity.train_reference`'s (losses, parameters, buffers); several test
    files compare against the same references, so each is computed once.
    """
    import parity

    cache: dict[tuple, Any] = {}

    def get(case: str, optimizer: str, dtype: str = "float64", steps: int = 3):
        key = (case, optimizer, dtype, steps)
        if key not in cache:
            cache[key] = parity.train_reference(case, optimizer, dtype, steps)
        return cache[key]

    return get
