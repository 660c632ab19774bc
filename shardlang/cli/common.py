"""Helpers shared by the commands: loading a job and splitting its batches, output, threads.

Example::

    >>> threads_per_rank(10**6)
    1
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from ..step.batch import split_batch
from ..errors import ShardlangRuntimeError
from .job import Job, converted, global_batch, load_job
from ..runtime.dist import DistContext


def load_checked(path: str, world: int, spec_file: str | None = None) -> Job:
    """Load the job and check that its first global batch splits over ``world`` ranks, before any rank starts."""
    job = load_job(path, spec_file)
    split_for_rank(job, global_batch(job, 0), world, 0, 0)
    return job


def split_for_rank(job: Job, batch, world: int, rank: int, step: int, maker: str = "make_batch"):
    """Rank ``rank``'s part of global batch ``step`` over ``world`` ranks; an error names the job and the step."""
    try:
        return split_batch(batch, *job.spec.mesh.batch_split(world, rank))
    except ShardlangRuntimeError as exc:
        raise ShardlangRuntimeError(f"{shown(job.path)}: {maker}({step}): {exc}") from exc


def compile_job(job: Job, model: torch.nn.Module, example, ctx: DistContext, seed: int = 0,
                weights: str | None = None):
    """``sl.compile`` of a job's built model on this rank: its loss, spec, optimizer, lr schedule and initial values
    (the seed, its ``init_weights``, ``weights`` or the job file's), for the per-rank ``example`` batch."""
    from .. import api
    from .job import init_of

    init = init_of(job, seed, weights)
    return api.compile(model, job.loss_fn, job.spec, optimizer=job.optimizer, example_batch=example, dist_context=ctx,
                       lr_schedule=job.lr_schedule, init_seed=init.seed, init_weights=init.init_weights,
                       weights=init.weights)


def rank_batch(job: Job, step: int, world: int, rank: int, evaluation: bool = False):
    """Rank ``rank``'s part of global batch ``step`` over ``world`` ranks, split over the mesh's data axes."""
    parts, index = job.spec.mesh.batch_split(world, rank)  # ranks that differ only on a tensor axis share rows
    return batch_part(job, step, parts, index, evaluation)


def batch_part(job: Job, step: int, parts: int, index: int, evaluation: bool = False):
    """Part ``index`` of global batch ``step`` cut into ``parts`` equal runs of rows.

    A batch maker that reads rows (``sl.data.tokens``: ``rows(step, start, stop)`` and an int ``global_batch``)
    is asked for those rows alone, the rows `split_batch` would cut; any other is called for the whole
    global batch, which is then split.
    """
    maker = "make_eval_batch" if evaluation else "make_batch"
    source = getattr(job, maker)
    rows, size = getattr(source, "rows", None), getattr(source, "global_batch", None)
    if not (callable(rows) and isinstance(size, int)):
        try:
            return split_batch(global_batch(job, step, evaluation=evaluation), parts, index)
        except ShardlangRuntimeError as exc:
            raise ShardlangRuntimeError(f"{shown(job.path)}: {maker}({step}): {exc}") from exc
    if size % parts:
        raise ShardlangRuntimeError(f"{shown(job.path)}: {maker}: global batch size {size} does not divide into "
                                    f"{parts} data-parallel parts (mesh {job.spec.mesh!r}); use a multiple of "
                                    f"{parts}, e.g. {size - size % parts or parts}")
    per_part = size // parts
    return converted(job, rows(step, index * per_part, (index + 1) * per_part))


def eval_example(job: Job, world: int, rank: int = 0):
    """The per-rank batch an evaluation is compiled for: ``make_eval_batch(0)``'s, else ``make_batch(0)``'s."""
    return rank_batch(job, 0, world, rank, evaluation=job.make_eval_batch is not None)


def global_mean(loss: torch.Tensor, ctx: DistContext) -> float:
    """The mean of the ranks' local losses: the global batch's loss (equal per-rank batches, mean-reduced loss)."""
    value = loss.detach().to(torch.float64).reshape(())
    if ctx.has_process_group:
        value = value.clone()
        dist.all_reduce(value)
        value /= ctx.world_size
    return float(value)


def threads_per_rank(nproc: int) -> int:
    """Torch threads for each of ``nproc`` local ranks: the cores shared out, at least one."""
    return max(1, (os.cpu_count() or 1) // nproc)


def shown(path: Path) -> str:
    """``path`` relative to the working directory when it is under it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)
