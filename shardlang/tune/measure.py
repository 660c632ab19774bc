"""``shardlang tune --measure K``: run the leading specs for a few steps each and measure them.

Each candidate runs with the real launcher (N local CPU ranks over gloo, or the
ranks of the calling torchrun job), one after another, for ``warmup`` steps and
then ``steps`` timed steps; its step time is the median over those steps of
the slowest rank's, and its peak the largest training peak of any rank
(`shardlang.runtime.peak_memory`, the resident set since compiling began).
One more step, untimed, is run with a thread sampling the bytes malloc has in
use (Note [sampled malloc peak]): ``in_use_peak``, above what was in use before
the model was built, is the measure the plan's peak is comparable to (the
resident set also holds pages malloc keeps after ``free``, the compiled
graphs and the allocator's caches).

Example::

    measured = measure(job_path, [evaluated.spec for evaluated in result.fitting[:3]], world=2)
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import attrs
import torch
import torch.distributed as dist

from ..cli.common import compile_job, rank_batch, threads_per_rank
from ..cli.job import build, load_job
from ..runtime.dist import DistContext
from ..runtime.launcher import launch
from ..runtime.peak_memory import MallocPeak, PeakMemory, malloc_in_use
from ..spec.spec import Spec


@attrs.frozen
class Measured:
    """One spec run for real: the median step time (slowest rank), and the largest peaks of a rank: its
    resident set, and the bytes malloc had in use (None where glibc cannot say)."""

    step_time_s: float
    peak: int
    in_use_peak: int | None = None


def measure(job_path: str, specs: list[Spec], world: int, steps: int = 5, warmup: int = 2) -> list[Measured]:
    """Run each of ``specs`` for ``warmup + steps`` steps on ``world`` local ranks; one `Measured` each."""
    out = []
    with tempfile.TemporaryDirectory(prefix="shardlang-tune-") as tmp:
        for i, spec in enumerate(specs):
            spec_file = Path(tmp) / f"candidate-{i}.toml"
            spec_file.write_text(spec.to_toml())
            # A process of its own even at N=1: each candidate's peak is its own, not this process's.
            out.append(launch(measure_rank, world, job_path, str(spec_file), steps, warmup, timeout=None,
                              threads=threads_per_rank(world), name=f"shardlang tune: measuring candidate {i + 1}")[0])
    return out


def measure_rank(ctx: DistContext, job_path: str, spec_file: str, steps: int, warmup: int) -> Measured:
    """One rank of a measurement (module level: the launcher pickles it by reference)."""
    job = load_job(job_path, spec_file)
    in_use_base = malloc_in_use()
    peak = PeakMemory.start()
    model = build(job)
    step = compile_job(job, model, rank_batch(job, 0, ctx.world_size, ctx.rank), ctx)
    del model
    peak.mark_init()
    times, sampled_peak = timed_steps(ctx, job, step, steps, warmup)
    in_use = -1.0 if sampled_peak is None or in_use_base is None else float(sampled_peak - in_use_base)
    values = torch.tensor([*times, float(peak.values()[1]), in_use], dtype=torch.float64)
    if ctx.has_process_group:
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return Measured(statistics.median(values[:-2].tolist()), int(values[-2]),
                    None if values[-1] < 0 else int(values[-1]))


def timed_steps(ctx: DistContext, job, step, steps: int, warmup: int) -> tuple[list[float], int | None]:
    """This rank's seconds for each of ``steps`` steps after ``warmup``, and malloc's bytes in use at the peak
    of one more step, untimed (the sampling thread shares the GIL with the step; None where glibc cannot say).

    Batches are the job's for steps 0, 1, ... on this rank; `calibrate` times its step the same way.
    """
    times = []
    for k in range(warmup + steps):
        batch = rank_batch(job, k, ctx.world_size, ctx.rank)
        begin = time.perf_counter()
        step(batch)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        if k >= warmup:
            times.append(time.perf_counter() - begin)
    with MallocPeak() as sampled:
        step(rank_batch(job, warmup + steps, ctx.world_size, ctx.rank))
    return times, sampled.peak
