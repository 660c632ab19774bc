"""CPU time, page faults and wall time per step of several modes, their steps interleaved in one process.

A diagnostic for comparisons on a shared machine: every rank builds each
variant, then runs step k of every variant before step k + 1 of any, so load
falls on all of them alike; each step is timed with ``time.process_time`` and
``getrusage`` (user, system, minor page faults). A variant is a benchmark mode
(`benchmarks.modes.MODES`), optionally with a suffix:

- ``MODE:MIB``: a shardlang mode compiled with ``Options(bucket_bytes=MIB MiB)``;
- ``MODE+freed`` (``MODE+freed:MIB``): a shardlang mode compiled with
  ``Options(keep_reduction_buffers=False)``: its all-reduce buffers are made
  anew every step instead of kept between steps as torch DDP's buckets are
  (Note [kept reduction buffers], the default);
- ``MODE+fresh``: a shardlang mode compiled with ``Options(buffer_pool=False)``:
  its gathered buffers and gradient packs are made anew every step instead of
  in the step's pool (Note [buffer assignment], the default).

Example::

    python -m benchmarks.interleave --size 100M --world 2 --steps 4 shardlang-ddp shardlang-ddp+freed ddp
    python -m benchmarks.interleave --size 10M-latency --world 2 shardlang-zero2 shardlang-zero2:25 ddp
    python -m benchmarks.interleave --size 100M --world 2 --steps 3 shardlang-zero2 shardlang-zero2+fresh ddp
"""

from __future__ import annotations

import argparse
import gc
import resource
import statistics
import sys
import time

import torch

from shardlang.runtime.launcher import WorkerPool

from .modes import MODES, SHARDLANG_MODES, SIZES, STRATEGIES, RunSpec, _join_group, build_trainer, lm_loss

MiB = 2**20


SUFFIXES = {"+freed": {"keep_reduction_buffers": False}, "+fresh": {"buffer_pool": False}}


def _mode(variant: str) -> str:
    mode = variant.partition(":")[0]
    for suffix in SUFFIXES:
        mode = mode.removesuffix(suffix)
    return mode


def _with_options(mode: str, spec: RunSpec, ctx, example: torch.Tensor, **options):
    """The benchmark's shardlang spec for ``mode`` (`benchmarks.modes`), with ``options`` changed."""
    import shardlang as sl

    torch.manual_seed(spec.seed)
    sl_spec = sl.Spec(sl.Mesh(fsdp=-1), rules=[("*", sl.shard("fsdp"))], units=["blocks.*"],
                      strategies=[("*", getattr(sl, STRATEGIES[mode]))], options=sl.Options(**options))
    return sl.compile(spec.size.build(), lm_loss, sl_spec, example_batch=example, dist_context=ctx,
                      optimizer=sl.AdamW(lr=spec.lr, weight_decay=spec.weight_decay))


def _build(variant: str, spec: RunSpec, ctx, example: torch.Tensor):
    mode, _, mib = variant.partition(":")
    options = dict(next((o for suffix, o in SUFFIXES.items() if mode.endswith(suffix)), {}))
    if mib:
        options["bucket_bytes"] = int(float(mib) * MiB)
    mode = _mode(mode)
    if options:
        return _with_options(mode, spec, ctx, example, **options)
    trainer = build_trainer(mode, spec, ctx, example)
    return getattr(trainer, "step_fn", trainer.step)


def interleave(ctx, size: str, variants: list[str], warmup: int, steps: int) -> dict:
    torch.set_num_threads(1)
    _, own_group = _join_group(RunSpec(SIZES[size], ("ddp",), ctx.world_size), ctx)
    spec = RunSpec(SIZES[size], ("ddp",), ctx.world_size, warmup=warmup, steps=steps)
    batches = spec.batches(ctx.rank)
    steps_of = {v: _build(v, spec, ctx, batches[0]) for v in variants}
    samples: dict[str, list[tuple[float, ...]]] = {v: [] for v in variants}
    for k, batch in enumerate(batches[:-1]):
        for variant, step in steps_of.items():
            gc.collect()
            torch.distributed.barrier()
            r0, c0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), time.perf_counter()
            loss = float(step(batch))
            w1, c1, r1 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
            if k >= warmup:
                samples[variant].append((c1 - c0, r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime,
                                         r1.ru_minflt - r0.ru_minflt, w1 - w0, loss))
    if own_group:
        torch.distributed.destroy_process_group()
    return {v: [statistics.median(s[i] for s in rows) for i in range(5)] + [rows[-1][5]]
            for v, rows in samples.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.interleave", description=__doc__.split("\n\n")[0])
    p.add_argument("variants", nargs="+", help="MODE, MODE:MIB (bucket_bytes), MODE+freed or MODE+fresh")
    p.add_argument("--size", default="10M-latency", choices=list(SIZES))
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args(argv)
    for v in args.variants:
        if _mode(v) not in MODES or ((":" in v or _mode(v) != v.partition(":")[0]) and _mode(v) not in SHARDLANG_MODES):
            p.error(f"variant {v!r}: a mode of {MODES}, or a shardlang mode with :MIB, +freed or +fresh")
    if args.world < 2:
        p.error(f"--world is {args.world}; the comparison needs a process group of at least 2 ranks")
    with WorkerPool(args.world, threads=1, timeout=None) as pool:
        per_rank = pool.run(interleave, args.size, args.variants, args.warmup, args.steps)
    print(f"{args.size} N={args.world}, median of {args.steps} steps after {args.warmup} warm-up")
    for rank, rows in enumerate(per_rank):
        for v, (cpu, user, system, faults, wall, loss) in rows.items():
            print(f"rank {rank} {v:20s} CPU {cpu * 1e3:7.1f} ms  user {user * 1e3:7.1f}  sys {system * 1e3:6.1f}  "
                  f"minflt {faults:7.0f}  wall {wall * 1e3:7.1f} ms  loss {loss:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
