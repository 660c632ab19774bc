"""Worker functions for test_timeout.py (module level, so the launcher's workers can import them)."""

from __future__ import annotations

import time

import torch

import shardlang as sl
from shardlang.runtime.watch import CollectiveError

import models


def late_rank_with_api_timeout(ctx, timeout_s: float, late_s: float):
    """Compile with ``sl.compile(timeout=)``; rank 1 starts step 2 ``late_s`` seconds late.

    Each rank re-raises what it caught with the fields the test checks, so that the
    pool rejoins a fresh process group after the job (a collective that timed out
    leaves its group unusable).
    """
    torch.manual_seed(0)
    step = sl.compile(models.mlp(), models.mse_loss, sl.Spec(sl.Mesh(fsdp=-1)), optimizer=sl.SGD(lr=0.1),
                      example_batch=models.mlp_batch(0), dist_context=ctx, timeout=timeout_s)
    step(models.mlp_batch(0))
    if ctx.rank == 1:
        time.sleep(late_s)  # a stuck data loader
    started = time.monotonic()
    try:
        step(models.mlp_batch(1))
    except CollectiveError as exc:
        fields = dict(kind=type(exc).__name__, step=exc.step, op=exc.op_index, late=exc.late_ranks,
                      waited=round(time.monotonic() - started, 1), message=str(exc))
        raise ValueError(repr(fields)) from exc
    return None


def time_step_records(ctx, calls: int):
    """Seconds per `StepWatch.begin` (one store write) on this rank, for the overhead measurement."""
    from shardlang.runtime.watch import StepWatch

    step = sl.compile(models.mlp(), models.mse_loss, sl.Spec(sl.Mesh(fsdp=-1)), example_batch=models.mlp_batch(0),
                      dist_context=ctx)
    watch = StepWatch(ctx, step.schedule)
    started = time.perf_counter()
    for _ in range(calls):
        watch.begin()
    per_record = (time.perf_counter() - started) / calls
    batch = models.mlp_batch(0)
    step(batch)
    started = time.perf_counter()
    for _ in range(20):
        step(batch)
    return per_record, (time.perf_counter() - started) / 20
