"""``python -m benchmarks.init_memory --world N``: a rank's memory through initialisation and training, in detail.

What ``shardlang run``'s last line reports (VmHWM minus the resident set
before ``build_model``), beside what explains it: glibc's bytes in use
(``mallinfo2``, which does not count pages malloc keeps after ``free``), the
bytes of the rank's `TrainState`, and the static plan's peak. Runs
examples/gpt.py at ``GPT_SIZE`` (default 100M) for ``--steps`` steps.
docs/large_models.md reports its output for the 100M GPT at N=4 and N=8.

Example::

    GPT_SIZE=100M python -m benchmarks.init_memory --world 4 --steps 2
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

from shardlang import api

from .probes import StepProbe
from shardlang.cli.job import build, global_batch, init_of, load_job
from shardlang.step.batch import split_batch
from shardlang.runtime.launcher import launch
from shardlang.runtime.peak_memory import MIB, PeakMemory, malloc_in_use, peak_rss_bytes, rss_bytes

GPT = str(Path(__file__).resolve().parents[1] / "examples" / "gpt.py")


class MallocPeak:
    """The most bytes malloc had in use while active, sampled by a background thread every millisecond."""

    def __init__(self):
        self.peak = malloc_in_use() or 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, malloc_in_use() or 0)

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, malloc_in_use() or 0)
            time.sleep(0.001)


def measure_rank(ctx, path: str, steps: int) -> dict:
    """One rank: the memory after each stage, in MiB above the resident set (or malloc's bytes) before ``build_model``.

    ``*_peak``: VmHWM (what ``shardlang run`` reports); ``*_malloc_peak``: malloc's bytes in use at the most,
    sampled; the last step's also at every op (`benchmarks.probes.StepProbe`).
    """
    job = load_job(path)
    peak = PeakMemory.start()
    malloc_base = malloc_in_use() or 0
    started = time.perf_counter()
    with MallocPeak() as init_malloc:
        model = build(job, 0)
        example = split_batch(global_batch(job, 0), ctx.world_size, ctx.rank)
        init = init_of(job, 0)
        step = api.compile(model, job.loss_fn, job.spec, optimizer=job.optimizer, example_batch=example,
                           dist_context=ctx, init_seed=init.seed, init_weights=init.init_weights, weights=init.weights)
        del model
    peak.mark_init()
    out = {"init_s": time.perf_counter() - started,
           "init_peak": (peak.init_peak - peak.base) / MIB,
           "init_malloc_peak": (init_malloc.peak - malloc_base) / MIB,
           "init_malloc": ((malloc_in_use() or 0) - malloc_base) / MIB,
           "state": step.state.nbytes / MIB,
           "plan_peak": step.compiled.memory.peak / MIB,
           "plan_breakdown": {k: v / MIB for k, v in step.compiled.memory.breakdown.items()}
           if hasattr(step.compiled.memory, "breakdown") else None}
    for k in range(steps - 1):
        step(split_batch(global_batch(job, k), ctx.world_size, ctx.rank))
    with StepProbe() as probe:
        step(split_batch(global_batch(job, steps - 1), ctx.world_size, ctx.rank))
    out |= {"training_peak": (peak_rss_bytes() - peak.base) / MIB, "end_rss": (rss_bytes() - peak.base) / MIB,
            "step_malloc_peak": (probe.peak - malloc_base) / MIB,
            "end_malloc": ((malloc_in_use() or 0) - malloc_base) / MIB}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--job", default=GPT)
    args = parser.parse_args(argv)
    os.environ.setdefault("GPT_SIZE", "100M")
    results = launch(measure_rank, args.world, args.job, args.steps, timeout=None,
                     threads=max(1, (os.cpu_count() or 1) // args.world))
    print(json.dumps({"world": args.world, "gpt_size": os.environ["GPT_SIZE"], "ranks": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
