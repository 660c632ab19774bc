"""One device, one process: shardlang's step against plain PyTorch and FSDP2, and the memory plan against the device.

    python -m benchmarks.gpu --size 100M --steps 10 --out gpu.json     # benchmarks/gpu.sh runs this
    python -m benchmarks.gpu --size tiny --steps 1                     # the CPU path (what the tests run)

On a CUDA device (NCCL for FSDP2's group of one), else on the CPU (gloo): for
each mode (``single``: plain PyTorch and AdamW; ``shardlang``: the compiled
step, eager; ``shardlang-inductor``: its inductor backend; ``fsdp2``:
``fully_shard`` per block and the root) it builds the GPT of ``--size``, runs 2
warm-up steps and ``--steps`` timed ones (synchronised), and reports the
median step time and its ratio to ``single``; on CUDA also each mode's peak
of ``torch.cuda.max_memory_allocated`` above what it held before, and for
shardlang the memory plan's peak beside it. The losses of the last step are
printed to show every mode trained the same model.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardlang.runtime.dist import DistContext

from .modes import SIZES, RunSpec, build_trainer

MODES = ("single", "shardlang", "shardlang-inductor", "fsdp2")


def run(size: str, steps: int, modes=MODES) -> dict:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                            **({"device_id": device} if cuda else {}))
    ctx = DistContext(0, 1, 0, None, device)
    spec = RunSpec(SIZES[size], tuple(modes), 1, warmup=2, steps=steps)
    batches = [b.to(device) for b in spec.batches(0)]
    results = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "size": size, "modes": {}}
    try:
        for mode in modes:
            results["modes"][mode] = _one(mode, spec, ctx, batches, device)
    finally:
        dist.destroy_process_group()
    base = results["modes"].get("single", {}).get("step_s")
    for record in results["modes"].values():
        record["vs_single"] = record["step_s"] / base if base else None
    return results


def _one(mode: str, spec: RunSpec, ctx: DistContext, batches, device) -> dict:
    gc.collect()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    # PyTorch's and FSDP2's model is built on the device; shardlang's step moves its own state there.
    with contextlib.nullcontext() if mode.startswith("shardlang") else torch.device(device):
        trainer = build_trainer(mode, spec, ctx, batches[0])
    times = []
    for k, batch in enumerate(batches[: spec.warmup + spec.steps]):
        _sync(device)
        begin = time.perf_counter()
        loss = trainer.step(batch)
        _sync(device)
        if k >= spec.warmup:
            times.append(time.perf_counter() - begin)
    record = {"step_s": statistics.median(times), "loss": float(loss)}
    if cuda:
        record["peak_bytes"] = torch.cuda.max_memory_allocated() - before
    if mode.startswith("shardlang"):
        from shardlang.compiler import make_plan

        record["planned_peak_bytes"] = make_plan(trainer.step_fn.compiled).memory.peak
    del trainer
    return record


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="100M", choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = run(args.size, args.steps, tuple(args.modes.split(",")))
    print(f"{results['size']} GPT on {results['device']}, world 1")
    print(f"{'mode':<20}{'step ms':>10}{'vs single':>11}{'peak MiB':>11}{'planned MiB':>13}{'plan/peak':>11}  loss")
    for mode, r in results["modes"].items():
        peak, planned = r.get("peak_bytes"), r.get("planned_peak_bytes")
        print(f"{mode:<20}{r['step_s'] * 1e3:>10.2f}{r['vs_single'] or 0:>11.3f}"
              f"{peak / 2**20 if peak else float('nan'):>11.1f}{planned / 2**20 if planned else float('nan'):>13.1f}"
              f"{planned / peak if planned and peak else float('nan'):>11.3f}  {r['loss']:.6f}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
