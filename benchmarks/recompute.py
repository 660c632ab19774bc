"""Activation recompute on the 100M GPT: measured peak memory per rank against the plan, and step time.

    python -m benchmarks.recompute                      # N=2, seq 256, global batch 8, 5 timed repetitions
    python -m benchmarks.recompute --world 2 --seq-len 256 --global-batch 8 --reps 5 --out docs/benchmarks

The model is the benchmark's 100M GPT (12 layers, d=768, 12 heads, vocabulary
16384) at a sequence length where activations dominate its memory. Every rank
compiles the step twice from the same weights, with no recompute and with
``recompute=[("blocks.*", "full")]``, then:

- memory: one step of each, run node by node under a `torch.fx.Interpreter`
  that samples glibc's ``mallinfo2`` after every node (`benchmarks.probes`,
  Note [memory in use]; tests/memory_workers.py measures the plan the same way),
  relative to a baseline taken with only the step's inputs live, plus the
  inputs' bytes: the plan's quantity. The plan's peak comes from `sl.plan` with
  fake tensors, on this process.
- time: ``--reps`` steps of each, interleaved (none, full, none, full, ...), so
  both see the same load; a step's time is the slowest rank's; the report is
  the median of each. Timings on a shared machine are noisy: read the ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import signal
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.fx as fx

import shardlang as sl
from examples.gpt import lm_loss, make_gpt, make_tokens
from shardlang.step.batch import split_batch
from shardlang.runtime import WorkerPool

from .modes import SIZES
from .probes import give_memory_back, memory_in_use

POLICIES = {"none": None, "full": [("blocks.*", "full")]}


@dataclasses.dataclass(frozen=True)
class Settings:
    world: int = 2
    seq_len: int = 256
    global_batch: int = 8
    reps: int = 5
    size: str = "100M"

    def config(self) -> dict:
        size = SIZES[self.size]
        return dict(n_layer=size.n_layer, n_embd=size.n_embd, n_head=size.n_head, vocab_size=size.vocab_size,
                    block_size=self.seq_len)

    def batch(self, step: int, rank: int) -> torch.Tensor:
        tokens = make_tokens(step, self.global_batch, self.seq_len, SIZES[self.size].vocab_size)
        return split_batch(tokens, self.world, rank)

    def spec(self, policy: str) -> sl.Spec:
        return sl.Spec(sl.Mesh(fsdp=self.world), units=["blocks.*"], recompute=POLICIES[policy])


class _Sampler(fx.Interpreter):
    """Runs the graph, sampling malloc's bytes in use after each node (values freed after their last use)."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm, garbage_collect_values=True)
        self.peak = 0

    def run_node(self, n: fx.Node):
        result = super().run_node(n)
        self.peak = max(self.peak, memory_in_use())
        return result


def _fresh_gpt(settings: Settings) -> torch.nn.Module:
    """The same weights for every policy: a compiled step takes its model's weights, so each gets its own."""
    torch.manual_seed(0)
    return make_gpt(**settings.config())


def measure_rank(ctx, settings: Settings) -> dict:
    """On one rank: the measured peak of one step per policy, and the interleaved step times."""
    torch.set_num_threads(1)
    batch = settings.batch(0, ctx.rank)
    steps = {p: sl.compile(_fresh_gpt(settings), lm_loss, settings.spec(p), optimizer=sl.AdamW(lr=1e-4),
                           example_batch=batch, dist_context=ctx) for p in POLICIES}
    peaks = {}
    for policy, step in steps.items():
        step(batch)  # warm up: lazy initialisation happens here, not in the sample
        inputs = step.graph_inputs(batch)
        input_bytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in inputs}.values())
        sampler = _Sampler(step.graph)
        gc.collect()
        give_memory_back()
        base = memory_in_use()
        with torch.no_grad():
            sampler.run(*inputs)
        peaks[policy] = sampler.peak - base + input_bytes
        del inputs, sampler
    times: dict[str, list[float]] = {p: [] for p in POLICIES}
    for rep in range(settings.reps):
        for policy, step in steps.items():
            started = time.perf_counter()
            step(settings.batch(rep + 1, ctx.rank))
            times[policy].append(time.perf_counter() - started)
    return {"peaks": peaks, "times": times}


def planned_peaks(settings: Settings) -> dict[str, dict]:
    """The plan of each policy at rank 0: peak, breakdown, and per-unit activations."""
    out = {}
    for policy in POLICIES:
        plan = sl.plan(lambda: make_gpt(**settings.config()), lm_loss, settings.spec(policy),
                       optimizer=sl.AdamW(lr=1e-4), example_batch=settings.batch(0, 0), world_size=settings.world)
        memory = plan.memory
        out[policy] = {"peak": memory.peak, "breakdown": memory.breakdown,
                       "units": [u.to_dict() for u in memory.units]}
    return out


def report(settings: Settings, ranks: list[dict], plans: dict) -> dict:
    rows = {}
    for policy in POLICIES:
        measured = max(r["peaks"][policy] for r in ranks)
        per_rep = [max(r["times"][policy][k] for r in ranks) for k in range(settings.reps)]
        rows[policy] = {"planned_peak": plans[policy]["peak"], "measured_peak": measured,
                        "plan_error": plans[policy]["peak"] / measured - 1, "step_s": per_rep,
                        "median_step_s": statistics.median(per_rep),
                        "activations_at_peak": plans[policy]["breakdown"]["activations"]}
    none, full = rows["none"], rows["full"]
    return {"settings": dataclasses.asdict(settings), "rows": rows, "plans": plans,
            "peak_drop": 1 - full["measured_peak"] / none["measured_peak"],
            "time_ratio": full["median_step_s"] / none["median_step_s"]}


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [f"{s['size']} GPT, N={s['world']}, sequence {s['seq_len']}, global batch {s['global_batch']} "
             f"({s['global_batch'] // s['world']} sequences per rank), float32, {s['reps']} interleaved repetitions",
             "", "| recompute | planned peak | measured peak | plan vs measured | median step | steps (s) |",
             "|---|---|---|---|---|---|"]
    for policy, row in result["rows"].items():
        lines.append(f"| {policy} | {row['planned_peak'] / 2**20:.0f} MiB | {row['measured_peak'] / 2**20:.0f} MiB | "
                     f"{100 * row['plan_error']:+.1f}% | {row['median_step_s']:.2f} s | "
                     f"{', '.join(f'{t:.2f}' for t in row['step_s'])} |")
    lines += ["", f"peak drop with full recompute: {100 * result['peak_drop']:.1f}%; "
                  f"step time full / none: {result['time_ratio']:.2f}x (medians)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.recompute", description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=Settings.world)
    parser.add_argument("--seq-len", type=int, default=Settings.seq_len)
    parser.add_argument("--global-batch", type=int, default=Settings.global_batch)
    parser.add_argument("--reps", type=int, default=Settings.reps)
    parser.add_argument("--size", default=Settings.size, choices=sorted(SIZES))
    parser.add_argument("--out", default=None, help="folder for recompute.json and recompute.md (default: print only)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so that the pool stops its ranks
    settings = Settings(args.world, args.seq_len, args.global_batch, args.reps, args.size)
    torch.set_num_threads(1)
    with WorkerPool(settings.world, timeout=3600, threads=1) as pool:
        ranks = pool.run(measure_rank, settings)
    plans = planned_peaks(settings)
    result = report(settings, ranks, plans)
    result["command"] = "python -m benchmarks.recompute " + " ".join(argv if argv is not None else sys.argv[1:])
    text = markdown(result)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "recompute.json").write_text(json.dumps(result, indent=1))
        (out / "recompute.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
