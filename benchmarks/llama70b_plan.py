"""The Llama-3-70B plan on 1024 ranks: peak per rank without recompute, with full recompute, and under a budget.

    python -m benchmarks.llama70b_plan                         # all 80 layers (slow on a loaded 2-core machine)
    python -m benchmarks.llama70b_plan --layers 4              # 4 layers, extrapolated to 80 per layer

The model, spec and batch are examples/llama_70b.py's (bf16 parameters, fp32
gradient reduction, one 4096-token sequence per rank). With ``--layers L`` the
model has L of its 80 layers and the 80-layer figures are extrapolated from the
plan: every layer is the same, so ``peak(80) = peak(L) + (80 - L) * kept``,
with ``kept`` one layer's activations kept from forward to backward (the
memory plan's per-unit rows): under ZeRO-3 nothing else a rank holds at the
peak grows with depth but its parameter and optimizer shards, a few MiB per
layer at 1024 ranks, which the extrapolation leaves out.
Each configuration is timed (wall clock, this machine; noisy under load).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import time
from pathlib import Path

import attrs

import shardlang as sl
from shardlang.step.batch import split_batch
from shardlang.compiler.schedule.schedule_format import human_bytes

GIB = 2**30
ROOT = Path(__file__).resolve().parents[1]


def _job():
    os.environ.setdefault("LLAMA_SIZE", "70b")
    source = importlib.util.spec_from_file_location("_bench_llama_70b", ROOT / "examples" / "llama_70b.py")
    module = sys.modules.setdefault(source.name, importlib.util.module_from_spec(source))
    source.loader.exec_module(module)
    return module


def plan(job, layers: int, world: int, recompute=None, budget: int | None = None):
    llama = job.llama
    config = dataclasses.replace(llama.CONFIG, n_layers=layers)
    spec = attrs.evolve(job.spec, recompute=recompute)
    if budget is not None:
        spec = attrs.evolve(spec, options=attrs.evolve(spec.options, memory_budget=budget))
    tokens = llama.make_tokens(0, world, config.max_seq_len, config.vocab_size)
    batch = split_batch(tokens, world, 0)
    started = time.perf_counter()
    compiled = sl.plan(lambda: llama.Llama(config), llama.loss_fn, spec, optimizer=job.optimizer,
                       example_batch=batch, world_size=world)
    memory = compiled.memory
    return compiled, memory, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.llama70b_plan", description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--world", type=int, default=1024)
    parser.add_argument("--budget-gib", type=float, default=80.0)
    args = parser.parse_args(argv)
    job = _job()
    total = job.llama.CONFIG.n_layers
    rows = []
    for name, recompute in (("none", None), ("full", [("layers.*", "full")])):
        compiled, memory, seconds = plan(job, args.layers, args.world, recompute)
        kept = {u.unit: u.kept for u in memory.units}
        per_layer = kept.get("layers.0", 0)
        peak = memory.peak + (total - args.layers) * per_layer
        rows.append((name, memory.peak, per_layer, peak, compiled.timeline.step_time_s, seconds))
    print(f"Llama-3-70B shape on {args.world} ranks, {args.layers} of {total} layers planned"
          + (f", extrapolated to {total}" if args.layers != total else ""))
    print("| recompute | planned peak (L layers) | kept per layer | peak at 80 layers | predicted step (L layers) "
          "| plan time |")
    print("|---|---|---|---|---|---|")
    for name, peak_l, per_layer, peak, step_s, seconds in rows:
        print(f"| {name} | {human_bytes(peak_l)} | {human_bytes(per_layer)} | {human_bytes(peak)} | {step_s:.1f} s "
              f"| {seconds:.0f} s |")
    if args.layers == total:
        compiled, memory, seconds = plan(job, args.layers, args.world, budget=int(args.budget_gib * GIB))
        print(f"\n--memory-budget {args.budget_gib:g}GiB ({seconds:.0f} s):\n{compiled.budget.summary_text()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
