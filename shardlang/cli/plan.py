"""``shardlang plan FILE --world N [--memory-budget 80GiB] [--recompute P=POLICY] [--json] ...``: plan without processes.

Compiles for N ranks with fake tensors, no processes; prints the plan
(schedule, memory per op and its peak, communication against the formulas,
predicted time), or one JSON object (`Plan.to_dict`); writes the predicted
timeline as a Chrome trace, or memory over the schedule as a picture.
`plan_job` is shared with ``shardlang diff``. ``--recompute PATTERN=POLICY``
(repeatable) replaces the spec's recompute rules; ``--memory-budget`` sets
``Options.memory_budget``, and the plan then starts with what the budget search
chose and why (docs/plan.md, "Recompute and the memory budget").

Example::

    $ shardlang plan examples/gpt.py --world 64 --json | jq .bytes_per_rank
"""

from __future__ import annotations

import contextlib
import sys

import attrs

from .. import api
from ..compiler import cost
from ..job import build, global_batch, load_job
from .args import add_model_arguments, byte_size, cost_model, output_file, positive, recompute_rule
from .common import shown, split_for_rank


def add_parser(subparsers) -> None:
    """Register ``shardlang plan`` on the top-level parser's subparsers."""
    parser = subparsers.add_parser(
        "plan", help="print the schedule for N ranks without starting any process",
        description="Compile FILE's job for N ranks with fake tensors and print its schedule.")
    parser.add_argument("file", metavar="FILE", help="job file (see docs/cli.md)")
    parser.add_argument("--world", metavar="N", type=positive("a world size"), required=True, help="world size")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object (only that)")
    parser.add_argument("--chrome-trace", metavar="PATH", type=output_file, default=None,
                        help="write the predicted timeline (compute, all-gather, reduce-scatter lanes, memory counter) "
                             "as a Chrome/Perfetto trace")
    parser.add_argument("--plot", metavar="PNG", type=output_file, default=None,
                        help="draw memory over the schedule, gathers and frees marked (needs matplotlib)")
    parser.add_argument("--memory-budget", metavar="BYTES", type=byte_size, default=None,
                        help="bytes one rank may use at its peak, e.g. 80GiB: choose recompute per unit and the "
                             "prefetch depth that fit at the least predicted time (Options.memory_budget)")
    parser.add_argument("--recompute", metavar="PATTERN=POLICY", type=recompute_rule, action="append", default=None,
                        help="recompute rule, e.g. 'layers.*=full' (none, full, selective); repeat for more, first "
                             "match wins; replaces the spec's recompute")
    add_model_arguments(parser)
    parser.set_defaults(command=main)


def main(args) -> int:
    """Plan the job and print (or write) the plan; the exit code."""
    stdout = sys.stdout
    # With --json, stdout carries the JSON object only: whatever the job file prints goes to stderr.
    quiet = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    model = cost_model(args)
    with quiet:
        job, plan = plan_job(args.file, args.world, model, memory_budget=args.memory_budget,
                             recompute=args.recompute)
        _write_pictures(args, plan)
    if args.json:
        stdout.write(plan.to_json(indent=2) + "\n")
        stdout.flush()
        return 0
    print(f"shardlang plan {shown(job.path)}: world {args.world}, optimizer {job.optimizer!r}\n")
    print(plan.report())
    return 0


def plan_job(path, world: int, model: cost.CostModel, memory_budget: int | None = None, recompute=None):
    """Plan a job file for ``world`` ranks with fake tensors: (job, `Plan`).

    ``memory_budget`` and ``recompute`` (a list of ``(pattern, policy)``)
    override the job's spec when given.
    """
    from ..compiler.plan_report import make_plan

    job = load_job(path)
    spec = job.spec
    if recompute is not None:
        spec = attrs.evolve(spec, recompute=recompute)
    if memory_budget is not None:
        spec = attrs.evolve(spec, options=attrs.evolve(spec.options, memory_budget=memory_budget))
    example = split_for_rank(job, global_batch(job, 0), world, 0, 0)
    compiled = api.plan(lambda: build(job), job.loss_fn, spec, optimizer=job.optimizer,
                        example_batch=example, world_size=world)
    return job, make_plan(compiled, cost_model=model)


def _write_pictures(args, plan) -> None:
    if args.chrome_trace:
        from ..compiler.timeline import write_chrome_trace

        write_chrome_trace(args.chrome_trace, plan.schedule, plan.timeline, plan.memory)
        print(f"wrote the predicted timeline to {args.chrome_trace} (open it in ui.perfetto.dev)", file=sys.stderr)
    if args.plot:
        from ..plot import plot_memory

        plot_memory(plan, args.plot)
        print(f"wrote memory over the schedule to {args.plot}", file=sys.stderr)
