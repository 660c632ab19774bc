"""``shardlang plan FILE --world N [--batch-step K] [--memory-budget 80GiB] [--recompute P=POLICY] [--json] ...``: plan without processes.

Compiles for N ranks with fake tensors, no processes, for the per-rank batch
of ``make_batch(K)`` (default step 0: batches of other shapes compile their
own graph, with the same collectives and their own memory and time); prints the plan
(schedule, memory per op and its peak, communication against the formulas,
predicted time), or one JSON object (`Plan.to_dict`); writes the predicted
timeline as a Chrome trace, or memory over the schedule as a picture.
`plan_job` is shared with ``shardlang diff``. ``--recompute PATTERN=POLICY``
(repeatable) replaces the spec's recompute rules; ``--memory-budget`` sets
``Options.memory_budget``, and the plan then starts with what the budget search
chose and why (docs/plan.md, "Recompute and the memory budget"). With
``--eval``, the plan of the step's evaluation (``Step.evaluate``: forward
only, on ``make_eval_batch(0)``'s shapes when the job defines it).

Example::

    $ shardlang plan examples/gpt.py --world 64 --json | jq .bytes_per_rank
"""

from __future__ import annotations

import contextlib
import sys

import attrs
import torch
from torch.utils import _pytree as pytree

from .. import api
from ..compiler import CostModel
from ..spec.tensor_axes import is_tensor_axis
from ..tune.calibrate import beyond_probes
from .job import build, global_batch, load_job
from .args import (add_model_arguments, add_spec_argument, byte_size, cost_model, nonnegative_int, output_file, positive,
                   recompute_rule, spec_path, step_memory_budget)
from .common import eval_example, shown, split_for_rank


def add_parser(subparsers) -> None:
    """Register ``shardlang plan`` on the top-level parser's subparsers."""
    parser = subparsers.add_parser(
        "plan", help="print the schedule for N ranks without starting any process",
        description="Compile FILE's job for N ranks with fake tensors and print its schedule.")
    parser.add_argument("file", metavar="FILE", help="job file (see docs/cli.md)")
    add_spec_argument(parser)
    parser.add_argument("--world", metavar="N", type=positive("a world size"), required=True, help="world size")
    parser.add_argument("--batch-step", metavar="K", type=nonnegative_int("a step"), default=0,
                        help="plan for the shape of make_batch(K)'s per-rank batch (default 0); the collectives are "
                             "the same for every shape, memory and time are not")
    parser.add_argument("--eval", action="store_true",
                        help="plan the evaluation step instead (forward only, eval mode; on make_eval_batch(0)'s "
                             "shapes when the job defines it)")
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
        job = load_job(args.file, spec_path(args))
        args.link.check_axes(job.spec.mesh.axis_names, shown(job.path))  # before compiling: a typo'd axis
        plan = plan_loaded(job, args.world, model, memory_budget=step_memory_budget(args),
                           recompute=args.recompute, batch_step=args.batch_step, evaluate=args.eval)
        _write_pictures(args, plan)
    note = beyond_probes(plan.schedule.largest_collective, args.calibration) if args.calibration else None
    if args.json:
        stdout.write(plan.to_json(indent=2) + "\n")
        stdout.flush()
        if note:
            print(note, file=sys.stderr)
        return 0
    shapes = " ".join(str(tuple(t.shape)) for t in plan_example_leaves(job, args.world, args.batch_step))
    what = "evaluation (forward only)" if args.eval else f"optimizer {job.optimizer!r}"
    print(f"shardlang plan {shown(job.path)}: world {args.world}, {what}, "
          f"per-rank batch of step {args.batch_step}: {shapes}\n")
    if any(is_tensor_axis(a) for a in job.spec.mesh.axis_names):  # where each parameter lies on every axis
        with torch.device("meta"):
            print("placements on every axis:\n" + job.spec.resolve(job.build_model(), args.world).describe() + "\n")
    print(plan.report())
    if note:
        print("\n" + note)
    return 0


def plan_job(path, world: int, model: CostModel, memory_budget: int | None = None, recompute=None,
             batch_step: int = 0, evaluate: bool = False, spec_file: str | None = None):
    """Plan a job file for ``world`` ranks with fake tensors, for the batch of ``batch_step``: (job, `Plan`).

    ``memory_budget`` and ``recompute`` (a list of ``(pattern, policy)``)
    override the job's spec when given. With a memory budget the plan of step
    K searches for K's shape; a running step keeps what its first batch chose
    (Note [same collectives for every shape] in `shardlang.step.variants`). With ``evaluate``, the plan
    of the step's evaluation, on ``make_eval_batch(0)``'s shapes when the job defines it.
    """
    job = load_job(path, spec_file)
    return job, plan_loaded(job, world, model, memory_budget, recompute, batch_step, evaluate)


def plan_loaded(job, world: int, model: CostModel, memory_budget: int | None = None, recompute=None,
                batch_step: int = 0, evaluate: bool = False):
    """`plan_job`'s `Plan` for a job already loaded (`load_job`)."""
    from ..compiler import make_plan

    spec = job.spec
    if recompute is not None:
        spec = attrs.evolve(spec, recompute=recompute)
    if memory_budget is not None:
        spec = attrs.evolve(spec, options=attrs.evolve(spec.options, memory_budget=memory_budget))
    return make_plan(_plan(job, spec, world, batch_step, evaluate, model), cost_model=model)


def _plan(job, spec, world: int, batch_step: int, evaluate: bool = False, cost_model=None):
    if evaluate:
        example = eval_example(job, world)
    else:
        example = split_for_rank(job, global_batch(job, batch_step), world, 0, batch_step)
    return api.plan(lambda: build(job), job.loss_fn, spec, optimizer=job.optimizer, example_batch=example,
                    world_size=world, evaluate=evaluate, cost_model=cost_model)


def plan_example_leaves(job, world: int, batch_step: int) -> list:
    """The leaves of rank 0's batch of ``batch_step`` (what the plan was compiled for)."""
    return pytree.tree_leaves(split_for_rank(job, global_batch(job, batch_step), world, 0, batch_step))


def _write_pictures(args, plan) -> None:
    if args.chrome_trace:
        from ..compiler import write_chrome_trace

        write_chrome_trace(args.chrome_trace, plan.schedule, plan.timeline, plan.memory)
        print(f"wrote the predicted timeline to {args.chrome_trace} (open it in ui.perfetto.dev)", file=sys.stderr)
    if args.plot:
        from .plot import plot_memory

        plot_memory(plan, args.plot)
        print(f"wrote memory over the schedule to {args.plot}", file=sys.stderr)
