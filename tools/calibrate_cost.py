"""Measure this machine's numbers for the cost model: gloo's alpha and bandwidth, and the CPU roofline.

    python tools/calibrate_cost.py [--world-sizes 2] [--reps 15]

Prints, and the docs (docs/plan.md, "The knobs") quote:

- per collective kind and world size, the median time of an issue + wait on gloo
  over loopback for payloads of 64 KiB to 16 MiB (after a barrier, the slowest
  rank's time), and the least-squares fit of the ring model
  ``steps * alpha + wire_bytes / bandwidth`` over all of them (reduce-scatter
  counted as the all-reduce gloo runs);
- the CPU: a float32 matmul's FLOP/s and an elementwise add's bytes/s with the
  threads one rank gets (cores / N), and the per-node overhead that makes the
  roofline's prediction of the GPT example's compiled step (world 1) equal its
  measured time.

Use the output as ``--alpha`` / ``--bandwidth`` / ``--flops`` on ``shardlang
plan``, or as a `LinkModel` / `ComputeModel` in Python.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shardlang import api  # noqa: E402
from shardlang.compiler.analysis.cost import ComputeModel, node_bytes, node_flops  # noqa: E402
from shardlang.compiler.ir.graph_utils import is_alias_op  # noqa: E402
from shardlang.cli.job import build, global_batch, load_job  # noqa: E402
from shardlang.runtime import DistContext, launch  # noqa: E402

PAYLOADS = [1 << k for k in range(16, 25, 2)]  # 64 KiB .. 16 MiB
KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def time_collectives(ctx, reps: int) -> dict:
    c10d = torch.ops._c10d_functional
    group = dist.group.WORLD.group_name
    n = ctx.world_size
    out = {}
    for kind in KINDS:
        for payload in PAYLOADS:
            x = torch.randn(payload // 4 // (n if kind == "all_gather" else 1))
            times = []
            for _ in range(reps + 2):
                dist.barrier()
                begin = time.perf_counter()
                if kind == "all_gather":
                    y = c10d.all_gather_into_tensor(x, n, group)
                elif kind == "reduce_scatter":
                    y = c10d.reduce_scatter_tensor(x, "sum", n, group)
                else:
                    y = c10d.all_reduce(x, "sum", group)
                c10d.wait_tensor(y)
                times.append(time.perf_counter() - begin)
            out[(kind, payload)] = statistics.median(sorted(times[2:])[: max(1, reps // 3)])  # the quick third
    return out


def fit_link(samples: dict[tuple[int, str, int], float]) -> tuple[float, float]:
    """Fit t = steps * alpha + wire / bandwidth in relative error, alpha >= 0 (gloo: reduce-scatter is an all-reduce).

    Each sample is weighted by 1/t, so a 64 KiB collective counts as much as a
    16 MiB one: alpha is set by the small ones, the bandwidth by the large ones.
    """
    rows, ts = [], []
    for (n, kind, payload), t in samples.items():
        steps, share = (2 * (n - 1), 2 * (n - 1) / n) if kind != "all_gather" else (n - 1, (n - 1) / n)
        rows.append([steps / t, share * payload / t])
        ts.append(1.0)
    a, b = np.array(rows), np.array(ts)
    (alpha, beta), *_ = np.linalg.lstsq(a, b, rcond=None)
    if alpha < 0:  # no latency term fits better than a negative one: fit the bandwidth alone
        alpha, beta = 0.0, float(np.linalg.lstsq(a[:, 1:], b, rcond=None)[0][0])
    return float(alpha), float(1 / beta)


def bench(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(reps):
        begin = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - begin)
    return best


def calibrate_compute(threads: int, reps: int) -> ComputeModel:
    torch.set_num_threads(threads)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    flops = 2 * 512**3 / bench(lambda: a @ b, reps)
    x, y = torch.randn(1 << 18), torch.randn(1 << 18)
    bandwidth = 3 * x.numel() * 4 / bench(lambda: x + y, reps)
    view = bench(lambda: [x.view(-1) for _ in range(1000)], reps) / 1000
    job = load_job(ROOT / "examples" / "gpt.py")
    torch.manual_seed(0)
    batch = global_batch(job, 0)
    step = api.compile(build(job, 0), job.loss_fn, job.spec, optimizer=job.optimizer, example_batch=batch,
                       dist_context=DistContext.single())
    measured = bench(lambda: step(batch), reps)
    nodes = [n for n in step.compiled.graph_module.graph.nodes if n.op == "call_function"]
    views = [n for n in nodes if is_alias_op(n)]
    work = [n for n in nodes if not is_alias_op(n)]
    roofline = sum(max(node_flops(n) / flops, node_bytes(n) / bandwidth) for n in work)
    overhead = max(0.0, (measured - roofline - view * len(views)) / len(work))
    print(f"compute ({threads} thread{'s' if threads > 1 else ''}): matmul {flops / 1e9:.1f} GFLOP/s, "
          f"elementwise {bandwidth / 1e9:.1f} GB/s, view {view * 1e6:.2f} us; GPT step {measured * 1e3:.2f} ms "
          f"= roofline {roofline * 1e3:.2f} ms + {len(work)} nodes x {overhead * 1e6:.1f} us + {len(views)} views")
    return ComputeModel("calibrated", flops_per_s=flops, bytes_per_s=bandwidth, op_overhead_s=overhead,
                        view_overhead_s=view)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", default="2")
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    samples = {}
    for n in (int(w) for w in args.world_sizes.split(",")):
        results = launch(time_collectives, n, args.reps, threads=max(1, cores // n))
        for (kind, payload) in results[0]:
            t = max(r[(kind, payload)] for r in results)
            samples[(n, kind, payload)] = t
            print(f"N={n} {kind:<15}{payload / 2**10:>8.0f} KiB {t * 1e6:>10.1f} us")
    alpha, bandwidth = fit_link(samples)
    print(f"gloo loopback fit: alpha {alpha * 1e6:.1f} us per ring step, bandwidth {bandwidth / 1e9:.2f} GB/s")
    n = min(int(w) for w in args.world_sizes.split(","))
    model = calibrate_compute(max(1, cores // n), args.reps)
    print(f"ComputeModel(flops_per_s={model.flops_per_s:.3g}, bytes_per_s={model.bytes_per_s:.3g}, "
          f"op_overhead_s={model.op_overhead_s:.3g}, view_overhead_s={model.view_overhead_s:.3g})")


if __name__ == "__main__":
    main()
