"""shardlang against PyTorch FSDP2 and DDP, side by side, in one invocation.

Run from the repository root::

    python -m benchmarks                       # the full benchmark (10M and 100M GPT, N = 1, 2, 4)
    python -m benchmarks --quick               # the smallest: tiny GPT, N = 1, 2, one step
    python -m benchmarks --sizes 10M --world-sizes 2 --modes shardlang,fsdp2 --steps 5

For every model size and world size N it runs each mode (`modes.MODES`) on N local
CPU ranks joined over gloo, one torch thread per rank, then runs the same modes
again with the "fake" process-group backend, whose collectives do nothing, to
tell how much of a step waits for communication. It writes ``results.json``
(every rank's raw numbers and the aggregates), ``results.md`` (the tables and the
targets) and a plot of step time and memory per rank against N into ``--out``.
See docs/benchmarks.md for what each number means.

Note [pools]: the ranks of one world size are one `WorkerPool`, reused by every
run at that N (spawning 4 processes and importing torch costs ~10 s on two
cores). Each pool first runs every mode once on the tiny model, unreported, so
that imports and one-time caches are not charged to the first measured run's
memory; memory is measured above each run's own baseline (Note [memory in use]
in `probes.py`). Each fake-backend run follows its gloo run at once, so that both
see about the same load from other processes, and gives the pool its gloo group
back when it ends.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

from shardlang.runtime.launcher import WorkerPool

from .modes import FAKE, GLOO, MODES, SIZES, RunSpec, run_rank
from .reference import references
from .report import aggregate, render_markdown, write_plot

DEFAULT_MODES = ("shardlang", "shardlang-zero2", "shardlang-zero1", "shardlang-ddp", "shardlang-inductor", "fsdp2",
                 "fsdp2-compile", "ddp")
DEFAULT_SIZES = ["10M", "100M", "10M-latency", "100M-latency"]
N1_ONLY = ("single",)  # runs whenever N = 1 does
# At N = 1 the same program as shardlang:
NOT_AT_N1 = ("shardlang-zero2", "shardlang-zero1", "shardlang-ddp")
RUN_TIMEOUT_S = 1800.0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so that the pools stop their ranks
    quick = {"sizes": ["tiny"], "world_sizes": [1, 2], "warmup": 1, "steps": 1, "prime": False}
    full = {"sizes": DEFAULT_SIZES, "world_sizes": [1, 2, 4], "warmup": 2, "steps": 5, "prime": True}
    for key, value in (quick if args.quick else full).items():  # options given explicitly win
        if getattr(args, key) is None:
            setattr(args, key, value)
    _check(args)
    out = Path(args.out or (tempfile.mkdtemp(prefix="shardlang-bench-") if args.quick else "docs/benchmarks"))
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    started = time.perf_counter()
    machine = _machine()
    _log(f"machine: {machine['cpu']}, {machine['cores']} cores, {machine['memory_gib']} GiB; torch {torch.__version__}")
    refs = {s: references(SIZES[s], args.world_sizes, args.global_batch) for s in args.sizes}
    runs = []
    for world in args.world_sizes:
        runs += _run_world(world, args, refs)
    results = {
        "machine": machine,
        "command": "python -m benchmarks " + " ".join(argv if argv is not None else sys.argv[1:]),
        "settings": {k: getattr(args, k) for k in ("sizes", "world_sizes", "modes", "warmup", "steps",
                                                    "global_batch", "exposed", "prime", "memory_budget_gib")},
        "sizes": {s: {"config": vars(SIZES[s]), "reference": {str(n): r.to_dict() for n, r in refs[s].items()}}
                  for s in args.sizes},
        "runs": runs,
        "wall_s": None,
    }
    results["summary"] = aggregate(results)
    results["wall_s"] = round(time.perf_counter() - started, 1)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    markdown = render_markdown(results)
    (out / "results.md").write_text(markdown)
    plot = write_plot(results, out / "step_time_memory.png")
    print(markdown)
    _log(f"wrote {out / 'results.json'}, {out / 'results.md'}" + (f", {plot}" if plot else ""))
    _log(f"total {results['wall_s']:.0f} s")
    return 0


def _run_world(world: int, args, refs: dict) -> list[dict]:
    """Every run at world size ``world`` on one pool (Note [pools]): gloo runs, then fake-backend runs."""
    modes = tuple((list(N1_ONLY) if world == 1 else [])
                  + [m for m in args.modes if m not in N1_ONLY and not (world == 1 and m in NOT_AT_N1)])
    runs = []
    _log(f"N={world}: starting {world} rank(s)")
    with WorkerPool(world, timeout=RUN_TIMEOUT_S, threads=1) as pool:
        if args.prime:
            pool.run(run_rank, RunSpec(SIZES["tiny"], modes, world, warmup=1, steps=1, global_batch=args.global_batch))
        for size in args.sizes:
            for group in memory_groups(modes, refs[size][world], args.memory_budget_gib * 2**30):
                spec = RunSpec(SIZES[size], group, world, GLOO, args.warmup, args.steps, args.global_batch)
                runs += _run_group(pool, spec)
                if args.exposed and world > 1:  # right after, so that both see about the same load
                    fake = dataclasses.replace(spec, backend=FAKE, warmup=1)
                    runs += _run_group(pool, fake)
    return runs


def _run_group(pool: WorkerPool, spec: RunSpec) -> list[dict]:
    started = time.perf_counter()
    per_rank = pool.run(run_rank, spec)
    runs = []
    for mode in spec.modes:
        ranks = [r[mode] for r in per_rank]
        runs.append({"size": spec.size.name, "world": spec.world, "mode": mode, "backend": spec.backend,
                     "group": list(spec.modes), "ranks": ranks, "loadavg": os.getloadavg()[0]})
        times = sorted(max(r["times"][k] for r in ranks) for k in range(spec.steps))
        _log(f"{spec.label} {mode}: step {_fmt_s(times[len(times) // 2])}, "
             f"peak {max(r['peak'] for r in ranks) / 2**20:.0f} MiB, "
             f"loss {sum(r['loss'] for r in ranks) / spec.world:.6f}")
    _log(f"{spec.label} [{', '.join(spec.modes)}]: {time.perf_counter() - started:.0f} s, "
         f"load average {os.getloadavg()[0]:.1f}")
    return runs


_PEERS_FIRST = ("shardlang", "single", "fsdp2", "ddp")


def memory_groups(modes: tuple[str, ...], ref, budget: float) -> list[tuple[str, ...]]:
    """Modes packed into runs whose resident memory, over all ranks, stays under ``budget`` bytes (Note [pools]).

    Modes are placed first-fit in order, the peers that targets compare against
    first (shardlang, one process, FSDP2, torch DDP), so that they share the first
    group with each other and with as many of the other modes as fit: a ratio
    between two groups compares different moments of the machine's load. A
    group needs every mode's state at once, but one step's transient at a time:
    its modes run their steps in turn (`run_rank`).
    """
    first = [m for m in _PEERS_FIRST if m in modes]
    groups: list[list[str]] = []
    for mode in first + [m for m in modes if m not in first]:
        for group in groups:
            if group_estimate([*group, mode], ref) <= budget:
                group.append(mode)
                break
        else:
            groups.append([mode])
    order = {m: i for i, m in enumerate(modes)}
    return [tuple(sorted(g, key=order.__getitem__)) for g in groups]


# Bytes per parameter each rank holds for a mode, generously, each as a (whole, sharded over N) pair: its state
# between steps (parameters, AdamW moments, DDP's buckets and the reduction buffers shardlang-DDP keeps), and what
# one step adds (gradients, ZeRO-2's gathered parameters, compiled buffers); the units gathered at once and the
# activations come on top of the step's share (`_transient`).
_BYTES_PER_PARAM = {  # mode: (state, step)
    "single": ((12, 0), (8, 0)), "ddp": ((16, 0), (8, 0)), "shardlang-ddp": ((16, 0), (4, 0)),
    "shardlang-zero1": ((4, 8), (4, 0)), "shardlang": ((0, 12), (0, 4)), "shardlang-zero2": ((0, 12), (4, 0)),
    "fsdp2": ((0, 12), (0, 4)), "shardlang-inductor": ((0, 12), (4, 4)), "fsdp2-compile": ((0, 12), (4, 4)),
}


def group_estimate(modes, ref) -> float:
    """Resident bytes over all ranks of ``modes`` run side by side: all their states, the largest step's transient."""
    state = sum(_per_rank(_BYTES_PER_PARAM[m][0], ref) for m in modes)
    return ref.world * (state + max(_transient(m, ref) for m in modes))


def _transient(mode: str, ref) -> float:
    return _per_rank(_BYTES_PER_PARAM[mode][1], ref) + 2 * ref.largest_unit + ref.activations


def _per_rank(bytes_per_param: tuple[int, int], ref) -> float:
    whole, sharded = bytes_per_param
    return ref.params * (whole + sharded / ref.world)


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _machine() -> dict:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(memory, 1), "torch": torch.__version__,
            "python": sys.version.split()[0], "loadavg_start": os.getloadavg(), "commit": _commit()}


def _commit() -> str:
    """The repository's commit, with "+changes" when the working tree differs from it ("" outside git)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return head + ("+changes" if dirty else "")


def _available_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) / 2**20
    except (OSError, StopIteration):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**31


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def _csv(kind):
    def parse(text: str) -> list:
        return [kind(part.strip()) for part in text.split(",") if part.strip()]

    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=_csv(str),
                   help=f"model sizes and settings, comma-separated, from {', '.join(SIZES)} "
                        f"(default {','.join(DEFAULT_SIZES)}; '-latency': one 128-token sequence per rank)")
    p.add_argument("--world-sizes", type=_csv(int), help="world sizes (default 1,2,4)")
    p.add_argument("--modes", type=_csv(str), default=list(DEFAULT_MODES),
                   help=f"modes besides the one-process reference, from {', '.join(MODES[1:])} "
                        "(default: all)")
    p.add_argument("--warmup", type=int, help="untimed steps first, at least 1 (default 2)")
    p.add_argument("--steps", type=int,
                   help="timed steps (default 5, their median is reported); one instrumented step follows")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step over all ranks (default 8)")
    p.add_argument("--no-exposed", dest="exposed", action="store_false",
                   help="skip the fake-backend runs (no exposed-communication fraction)")
    p.add_argument("--memory-budget-gib", type=float, default=_available_gib() / 2,
                   help="resident memory the modes run side by side may take, all ranks together "
                        "(default half of the memory available at start); modes that do not fit run apart")
    p.add_argument("--no-prime", dest="prime", action="store_false", default=None,
                   help="skip the unreported tiny run of each mode that warms a pool up (Note [pools])")
    p.add_argument("--out", help="directory for results.json, results.md and the plot "
                                 "(default docs/benchmarks; with --quick, a new temporary directory)")
    p.add_argument("--quick", action="store_true",
                   help="smoke-test defaults: tiny GPT, N = 1 and 2, one warm-up and one timed step, no priming "
                        "(options given explicitly still apply)")
    return p


def _check(args) -> None:
    for size in args.sizes:
        if size not in SIZES:
            raise SystemExit(f"python -m benchmarks: error: unknown size {size!r}; valid sizes are {', '.join(SIZES)}")
    for mode in args.modes:
        if mode not in MODES:
            raise SystemExit(f"python -m benchmarks: error: unknown mode {mode!r}; valid modes are {', '.join(MODES)}")
    if args.warmup < 1 or args.steps < 1:
        raise SystemExit("python -m benchmarks: error: --warmup and --steps must be at least 1")
    split = [s for s in args.sizes if SIZES[s].per_rank_batch is None]  # the global batch is split over ranks
    for world in args.world_sizes:
        if world < 1 or (split and args.global_batch % world):
            raise SystemExit(f"python -m benchmarks: error: world size {world} must be >= 1 and divide "
                             f"--global-batch {args.global_batch}")
