"""``shardlang tune`` against a grid of hand-written specs, measured side by side in one sitting.

    python -m benchmarks.tune --size 10M --world 2 --calibration machine.json \\
        --budgets 4GiB,TIGHT --out docs/benchmarks/tune/10M-n2.json

For examples/gpt.py at ``--size`` (``GPT_SIZE``) on ``--world`` local ranks:

1. the grid: 16 hand-written specs (ZeRO-3, ZeRO-2, ZeRO-1, DDP; per-block units
   or the whole model as one unit; prefetch 1 or 2), each planned with the cost
   model (predicted step, planned peak) and measured (`shardlang.tune.measure`:
   the median of --steps steps (default 5) after 2 warm-up steps, the slowest rank's; the largest
   training peak of a rank);
2. for each budget: ``tune --measure 3`` (the search, then its 3 best measured),
   and the best of the grid specs whose planned peak fits that budget. ``TIGHT``
   is a budget between the grid's smallest and median planned peaks.

It writes every number to ``--out`` and prints: tune's measured pick against the
grid's best (target: within 5%), and the distribution of measured / predicted
step time over the grid (target: within 15% after ``calibrate``).

``--replan RESULTS.json`` measures nothing: it plans the grid of an earlier
run's results with ``--calibration`` and prints that distribution against the
steps measured then (two calibrations compared on one sitting's measurements):

    python -m benchmarks.tune --size 100M --world 2 --calibration other.json \\
        --replan docs/benchmarks/tune/100M-n2.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "examples" / "gpt.py"


def grid(spec, world):
    """The 16 hand-written specs: strategy x units x prefetch, on the job's mesh."""
    import attrs

    out = []
    for strategy in ("zero3", "zero2", "zero1", "ddp"):
        for units in (("blocks.*",), ()):
            for prefetch in (1, 2):
                out.append(attrs.evolve(spec, units=units, strategies=[("*", strategy)],
                                        options=attrs.evolve(spec.options, prefetch=prefetch)))
    return out


def describe(spec) -> str:
    units = "blocks" if spec.units else "whole"
    return f"{spec.strategies[0].strategy.value} {units} prefetch {spec.options.prefetch}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="10M", choices=("tiny", "10M", "100M"))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--calibration", default=None, help="a `shardlang calibrate` file (default: the presets)")
    parser.add_argument("--budgets", default="4GiB,TIGHT", help="comma-separated budgets; TIGHT as above")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument("--replan", metavar="RESULTS", default=None,
                        help="plan an earlier run's grid with --calibration against its measured steps; measure nothing")
    args = parser.parse_args()
    os.environ["GPT_SIZE"] = args.size  # read by the job at import, here and in every measured rank
    sys.path.insert(0, str(ROOT))

    from shardlang import api
    from shardlang.cli.args import byte_size
    from shardlang.cli.common import rank_batch
    from shardlang.cli.job import build, load_job
    from shardlang.compiler import CostModel, human_bytes, make_plan
    from shardlang.tune.calibrate import read_calibration
    from shardlang.tune.measure import measure
    from shardlang.tune.search import tune

    model = read_calibration(args.calibration) if args.calibration else CostModel()
    job = load_job(JOB)
    world = args.world
    example = rank_batch(job, 0, world, 0)
    specs = grid(job.spec, world)

    def planned(spec):
        return make_plan(api.plan(lambda: build(job), job.loss_fn, spec, optimizer=job.optimizer,
                                  example_batch=example, world_size=world, cost_model=model), cost_model=model)

    if args.replan:
        earlier = json.loads(Path(args.replan).read_text())
        if (earlier["size"], earlier["world"]) != (args.size, world):
            sys.exit(f"--replan {args.replan}: measured at {earlier['size']}, N={earlier['world']}; "
                     f"give --size {earlier['size']} --world {earlier['world']}")
        print_ratios([row["measured_s"] / planned(spec).timeline.step_time_s
                      for spec, row in zip(specs, earlier["grid"])])
        return
    print(f"{args.size} GPT, N={world}: planning and measuring {len(specs)} hand-written specs", flush=True)
    rows = []
    measured = measure(str(JOB), specs, world, steps=args.steps)
    for spec, m in zip(specs, measured):
        plan = planned(spec)
        rows.append({"spec": describe(spec), "predicted_s": plan.timeline.step_time_s, "planned_peak": plan.memory.peak,
                     "measured_s": m.step_time_s, "measured_peak": m.peak, "measured_in_use": m.in_use_peak})
        print(f"  {describe(spec):<26} predicted {plan.timeline.step_time_s * 1e3:8.2f} ms  measured "
              f"{m.step_time_s * 1e3:8.2f} ms  ratio {m.step_time_s / plan.timeline.step_time_s:5.2f}  planned peak "
              f"{human_bytes(plan.memory.peak):>10}  measured peak {human_bytes(m.peak):>10}", flush=True)
    peaks = sorted(r["planned_peak"] for r in rows)
    tight = (peaks[0] + peaks[len(peaks) // 2]) // 2
    results = {"size": args.size, "world": world, "cost_model": {"link": model.link.name, "compute": model.compute.name,
                                                                 "contention": model.contention},
               "grid": rows, "budgets": []}
    for text in args.budgets.split(","):
        budget = tight if text.strip().upper() == "TIGHT" else byte_size(text)
        fitting = [r for r in rows if r["planned_peak"] <= budget]
        best = min(fitting, key=lambda r: r["measured_s"]) if fitting else None
        began = time.perf_counter()
        result = tune(lambda: build(job), job.loss_fn, job.spec, job.optimizer, example, world, budget, model, keep=3)
        searched = time.perf_counter() - began
        leading = list(result.fitting[:3])
        picks = measure(str(JOB), [e.spec for e in leading], world, steps=args.steps) if leading else []
        chosen = min(range(len(picks)), key=lambda i: picks[i].step_time_s) if picks else None
        entry = {"budget": budget, "tight": text.strip().upper() == "TIGHT", "search_s": searched,
                 "layouts": result.layouts_seen, "compiles": result.compiles,
                 "candidates": [{"spec": e.one_line(), "predicted_s": e.step_time_s, "planned_peak": e.peak,
                                 "measured_s": p.step_time_s, "measured_peak": p.peak, "measured_in_use": p.in_use_peak}
                                for e, p in zip(leading, picks)],
                 "chosen": chosen, "grid_best": best}
        results["budgets"].append(entry)
        if chosen is not None and best is not None:
            pick = picks[chosen]
            print(f"budget {human_bytes(budget)}: tune chose {leading[chosen].one_line()}, measured "
                  f"{pick.step_time_s * 1e3:.2f} ms (peak {human_bytes(pick.peak)}); the grid's best that fits is "
                  f"{best['spec']}, {best['measured_s'] * 1e3:.2f} ms: ratio {pick.step_time_s / best['measured_s']:.3f}"
                  f" (search {searched:.1f} s, {entry['compiles']} compiles)", flush=True)
        else:
            print(f"budget {human_bytes(budget)}: {'nothing fits' if chosen is None else 'no grid spec fits'}")
    results["ratio_distribution"] = print_ratios([r["measured_s"] / r["predicted_s"] for r in rows])
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


def print_ratios(ratios: list[float]) -> list[float]:
    """Print the distribution of measured / predicted step times against the 15% target; the ratios, sorted."""
    ratios = sorted(ratios)
    within = sum(abs(x - 1) <= 0.15 for x in ratios)
    print(f"measured / predicted over the grid: {', '.join(f'{x:.2f}' for x in ratios)}; min {ratios[0]:.2f}, "
          f"median {statistics.median(ratios):.2f}, max {ratios[-1]:.2f}; {within} of {len(ratios)} within 15%")
    return ratios


if __name__ == "__main__":
    main()
