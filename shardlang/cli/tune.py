"""``shardlang tune FILE --world N [--memory-budget SIZE] [--measure K] [--out spec.toml]``: choose the spec.

Searches the layouts of the job's model (unit granularity, one strategy per
unit, the mesh split, blocks grouped per collective), J at a time with
``--jobs J``, and, in each, recompute and prefetch under the budget
(Note [the tune search] in `shardlang.tune.search`); prints the leading
candidates, explains the choice, and writes the best as a TOML spec that
``run``, ``plan`` and ``check`` take with ``--spec``. With ``--measure K`` the K
best run for a few steps each on N local ranks, and the measured fastest is
chosen. Nothing fits: it says by how much, and exits 1.

Example::

    $ shardlang tune examples/gpt.py --world 4 --memory-budget 300MiB --measure 3 --out spec.toml
    $ shardlang run examples/gpt.py --nproc 4 --spec spec.toml
"""

from __future__ import annotations

import os
from pathlib import Path

from ..compiler import human_bytes
from ..tune.calibrate import beyond_probes
from ..tune.search import tune
from .args import (add_model_arguments, add_spec_argument, byte_size, cost_model, nonnegative_int, positive,
                   spec_path, step_memory_budget)
from .common import batch_part, shown
from .job import build, load_job

TABLE_ROWS = 8


def add_parser(subparsers) -> None:
    """Register ``shardlang tune`` on the top-level parser's subparsers."""
    parser = subparsers.add_parser(
        "tune", help="choose units, strategies, mesh, recompute and prefetch under a memory budget",
        description="Search the layouts of FILE's model for N ranks under a memory budget, predict each with the "
                    "cost model, optionally measure the best, and write the chosen spec as TOML (docs/tune.md).")
    parser.add_argument("file", metavar="FILE", help="job file (see docs/cli.md)")
    add_spec_argument(parser)
    parser.add_argument("--world", metavar="N", type=positive("a number of ranks"), required=True,
                        help="the number of ranks to tune for")
    parser.add_argument("--memory-budget", metavar="SIZE", type=byte_size, default=None,
                        help="bytes per rank the plan must fit, e.g. 80GiB (default: no limit)")
    parser.add_argument("--measure", metavar="K", type=nonnegative_int("a number of candidates"), default=0,
                        help="run the K best candidates on N local ranks for a few steps each and choose the "
                             "measured fastest (default 0: choose by prediction)")
    parser.add_argument("--measure-steps", metavar="S", type=positive("a number of steps"), default=5,
                        help="timed steps per measured candidate, after 2 warm-up steps (default 5)")
    parser.add_argument("--jobs", metavar="J", type=positive("a number of processes"), default=default_jobs(),
                        help="layouts compiled at once, each in a process of its own (default: the cores this "
                             f"process may use, at most {MAX_DEFAULT_JOBS}; each holds one compile in memory)")
    parser.add_argument("--node-size", metavar="G", type=positive("a number of ranks"), default=8,
                        help="ranks per node: on a mesh with a tensor axis, the tp degrees searched are the "
                             "divisors of G that divide N (default 8)")
    parser.add_argument("--out", metavar="PATH", default=None, help="write the chosen spec to PATH as TOML")
    add_model_arguments(parser)
    parser.set_defaults(command=main)


MAX_DEFAULT_JOBS = 4


def default_jobs() -> int:
    """The cores this process may use, at most `MAX_DEFAULT_JOBS` (a 70B compile holds about 1 GB)."""
    return max(1, min(MAX_DEFAULT_JOBS, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else os.cpu_count() or 1))


def main(args) -> int:
    """Tune the job; 0 when a spec was chosen, 1 when nothing fits the budget."""
    job = load_job(args.file, spec_path(args))
    world = args.world
    print(f"shardlang tune {shown(job.path)}: world {world}, budget "
          f"{human_bytes(args.memory_budget) if args.memory_budget else 'none'}, cost model {args.link} / "
          f"{args.compute}", flush=True)
    budget = step_memory_budget(args)
    if budget != args.memory_budget:
        print(f"  the runtime's own {human_bytes(args.memory_budget - budget)} (measured by the calibration) come "
              f"off the budget: each step plans within {human_bytes(budget)}", flush=True)
    result = tune(lambda: build(job), job.loss_fn, job.spec, job.optimizer, batch_part(job, 0, world, 0), world,
                  budget, cost_model(args), say=lambda line: print("  " + line, flush=True),
                  keep=max(1, args.measure or 0), workers=args.jobs,
                  batch_for=lambda parts: batch_part(job, 0, parts, 0), node_size=args.node_size)
    print(f"\nsearched {result.layouts_seen} layouts in {result.seconds:.1f} s with {result.compiles} compiles "
          f"({args.jobs} at a time): "
          f"{sum(not u.compiled for u in result.unfit)} pruned by memory and "
          f"{sum(not b.compiled for b in result.bounded)} by time before compiling, "
          f"{sum(b.compiled for b in result.bounded)} given up by time after compiling"
          + (f", {len(result.skipped)} left out (the model cannot take them)" if result.skipped else "") + "\n")
    if result.best is None:
        print(result.shortfall())
        return 1
    print(result.table(TABLE_ROWS) + "\n")
    chosen = result.best
    if args.measure:
        chosen = _measure(args, job, result)
    print(result.explanation() if chosen is result.best else f"chose {chosen.one_line()} (measured fastest)")
    if args.calibration and (note := beyond_probes(chosen.largest_collective, args.calibration)):
        print(note)
    if args.out:
        Path(args.out).write_text(chosen.spec.to_toml())
        print(f"\nwrote the spec to {args.out}: shardlang run {shown(job.path)} --nproc {world} --spec {args.out}")
    else:
        print("\n" + chosen.spec.to_toml())
    return 0


def _measure(args, job, result):
    from ..tune.measure import measure

    leading = list(result.fitting[:args.measure])
    print(f"measuring the {len(leading)} best on {args.world} local rank{'s' if args.world > 1 else ''} "
          f"({args.measure_steps} steps each after 2 warm-up steps):")
    measured = measure(str(job.path), [e.spec for e in leading], args.world, steps=args.measure_steps)
    print(f"{'#':>3}  {'predicted':>10}  {'measured':>10}  {'ratio':>6}  {'planned peak':>12}  "
          f"{'malloc in use':>13}  {'resident':>10}  spec")
    for i, (e, m) in enumerate(zip(leading, measured), start=1):
        in_use = "n/a" if m.in_use_peak is None else human_bytes(m.in_use_peak)
        print(f"{i:>3}  {e.step_time_s * 1e3:>8.2f}ms  {m.step_time_s * 1e3:>8.2f}ms  "
              f"{m.step_time_s / e.step_time_s:>6.2f}  {human_bytes(e.peak):>12}  {in_use:>13}  "
              f"{human_bytes(m.peak):>10}  {e.one_line()}")
    best = min(range(len(leading)), key=lambda i: measured[i].step_time_s)
    print()
    return leading[best]
