"""The command line: ``shardlang run | plan | check`` on a job file (see `shardlang.job`).

- ``shardlang run FILE --nproc N [--trace PATH]``: train on N local CPU ranks
  (gloo), or on the ranks torchrun started (when WORLD_SIZE is set); rank 0
  prints the global loss of each step, then the schedule's summary and table;
  with ``--trace``, the last steps are profiled into a Chrome trace whose ranges
  carry the schedule's op names (`shardlang.profile`).
- ``shardlang plan FILE --world N [--json] [--chrome-trace PATH] [--plot PNG]``:
  compile for N ranks with fake tensors, no processes; print the plan (schedule,
  memory per op and its peak, communication against the formulas, predicted
  time), or one JSON object (`Plan.to_dict`); write the predicted timeline as a
  Chrome trace, or memory over the schedule as a picture.
- ``shardlang diff A B``: compare two plans (job files planned here, or saved
  ``plan --json`` files): what moved, the bytes, the peak, the predicted time.
- ``shardlang check FILE --world-sizes 1,2,4``: train sharded at each world size
  and once in one process with ``torch.optim`` on the same global batches;
  compare the parameters; exit 1 when a world size is outside the tolerance.

Exit codes: 0 success; 1 a check failed, or a rank failed unexpectedly (its
traceback is printed); 2 bad input (arguments, job file, spec, batch), reported
as one ``shardlang: error: ...`` line.

Example::

    $ shardlang plan examples/gpt.py --world 64 --json | jq .bytes_per_rank
    $ torchrun --nproc-per-node 4 -m shardlang run examples/gpt.py --steps 100
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

import attrs
import torch
import torch.distributed as dist

from . import api
from .batch import split_batch
from .compiler import cost
from .compiler.optim import Adam
from .errors import ShardlangError, ShardlangRuntimeError, SpecError
from .job import Job, build, global_batch, load_job, reference_optimizer
from .training import torch_param_groups
from .runtime.dist import DistContext, init_from_env, read_env, shutdown
from .runtime.launcher import FailureKind, WorkerError, launch

DEFAULT_RUN_STEPS = 5
TRACED_STEPS = 3  # `run --trace` profiles this many steps at the end (after at least one untraced step)
DEFAULT_CHECK_STEPS = 3
TABLE_ROWS = 40  # `run` keeps its summary to one screen

DTYPES = {"float32": torch.float32, "float64": torch.float64}

# Note [check tolerance]: the largest difference `check` accepts between sharded
# training and the one-process torch.optim reference, by dtype and optimizer. The
# measure is, per parameter, max|sharded - reference| / max|reference|, and the max
# over parameters. The two computations differ only in rounding: the order of
# additions (gradients summed across ranks, then divided) and how the optimizer's
# factors are grouped. Measured on examples/gpt.py (AdamW, lr 3e-3) and
# examples/mlp.py (SGD with momentum), world sizes 1, 2, 4, seeds 0-2, 3-20 steps:
#
#                 float64                  float32
#   SGD (mlp)     <= 3.7e-16               <= 5.4e-7
#   AdamW (gpt)   <= 1.4e-12 (3 steps),    <= 1.2e-3 (3 steps), <= 2.0e-3 (10 steps),
#                 <= 4.9e-12 (20 steps)    <= 2.9e-3 (20 steps)
#
# SGD passes rounding through linearly. Adam and AdamW do not: the update
# lr * m / (sqrt(v) + eps) has size ~lr whatever the gradient's size, so where the
# true gradient is zero or nearly so, rounding noise in the gradient becomes a
# parameter change of order lr with a random sign. The GPT has such gradients
# exactly: the key part of each attention's qkv bias adds the same q.b to every
# score of a row, which softmax ignores, so its gradient is pure rounding noise;
# elements whose gradient crosses zero do the same. Its worst elements are there.
#
# Chosen: float64 1e-9 for every optimizer (200x the worst measured; a real bug shows
# at 1e-4 or more), float32 1e-5 for SGD (20x the worst measured) and 1e-2 for
# Adam/AdamW (8x the worst measured at the default 3 steps, 3.4x at 20). Real bugs
# measured against the GPT reference after 3 steps: one rank's gradient only (no
# reduction) 2.0, the learning rate off by 1% 0.2, gradients summed instead of
# averaged 1.6e-2 (Adam all but cancels a gradient scale; float64 sees it 7 orders
# above its tolerance). float32 with Adam is a smoke test, and long float32 checks
# drift toward the limit; `--dtype float64` is the exact check.
TOLERANCES = {
    (torch.float64, False): 1e-9,
    (torch.float64, True): 1e-9,
    (torch.float32, False): 1e-5,
    (torch.float32, True): 1e-2,
}


def tolerance(dtype: torch.dtype, optimizer) -> float | None:
    """The tolerance of `check` for parameters of ``dtype`` trained with ``optimizer`` (Note [check tolerance]).

    None for a dtype `check` does not compare.

    Example::

        >>> tolerance(torch.float32, sl.SGD(lr=0.1))
        1e-05
    """
    return TOLERANCES.get((dtype, isinstance(optimizer, Adam)))  # AdamW is an Adam


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 failed, 2 bad input).

    Example::

        >>> main(["plan", "examples/mlp.py", "--world", "2"])   # doctest: +SKIP
        0
    """
    args = _parser().parse_args(argv)
    try:
        return args.command(args)
    except WorkerError as exc:
        line = _own_error_line(exc)
        if line is None:
            print(f"shardlang: error: {exc}", file=sys.stderr)
            return 1
        print(f"shardlang: error: {line}", file=sys.stderr)
        return 2
    except ShardlangError as exc:
        print(f"shardlang: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `shardlang plan ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


# ---- arguments ---------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: ``shardlang: error: ...``, exit 2."""

    def error(self, message: str):
        self.exit(2, f"shardlang: error: {message} (see '{self.prog} --help')\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="shardlang", description="Train, plan and check sharded training jobs.")
    verbs = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    run = verbs.add_parser("run", help="train a job on N local CPU ranks (or under torchrun)",
                           description="Train FILE's job sharded over N ranks; rank 0 prints the global loss per "
                                       "step and the schedule. Under torchrun (WORLD_SIZE set) the ranks are "
                                       "torchrun's and --nproc, if given, must equal WORLD_SIZE.")
    run.add_argument("file", metavar="FILE", help="job file (see docs/cli.md)")
    run.add_argument("--nproc", metavar="N", type=_positive("a number of ranks"), default=None,
                     help="number of ranks (default: WORLD_SIZE under torchrun, else 1)")
    run.add_argument("--steps", metavar="K", type=_positive("a number of steps"), default=DEFAULT_RUN_STEPS,
                     help=f"training steps (default {DEFAULT_RUN_STEPS})")
    run.add_argument("--seed", metavar="S", type=int, default=0, help="seed for build_model (default 0)")
    run.add_argument("--trace", metavar="PATH", default=None,
                     help=f"profile the last {TRACED_STEPS} steps into a Chrome trace at PATH (rank r > 0 writes "
                          "PATH's stem + .rank<r>); its ranges carry the schedule's op names")
    run.set_defaults(command=_cmd_run)

    plan = verbs.add_parser("plan", help="print the schedule for N ranks without starting any process",
                            description="Compile FILE's job for N ranks with fake tensors and print its schedule.")
    plan.add_argument("file", metavar="FILE", help="job file (see docs/cli.md)")
    plan.add_argument("--world", metavar="N", type=_positive("a world size"), required=True, help="world size")
    plan.add_argument("--json", action="store_true", help="print the plan as one JSON object (only that)")
    plan.add_argument("--chrome-trace", metavar="PATH", default=None,
                      help="write the predicted timeline (compute, all-gather, reduce-scatter lanes, memory counter) "
                           "as a Chrome/Perfetto trace")
    plan.add_argument("--plot", metavar="PNG", default=None,
                      help="draw memory over the schedule, gathers and frees marked (needs matplotlib)")
    _add_model_arguments(plan)
    plan.set_defaults(command=_cmd_plan)

    diff = verbs.add_parser("diff", help="compare two plans: what moved, the bytes, the peak, the time",
                            description="Compare plans A and B. Each is a job file (planned here for --world "
                                        "ranks) or a JSON file written by 'shardlang plan --json'.")
    diff.add_argument("a", metavar="A", help="job file (.py) or plan JSON")
    diff.add_argument("b", metavar="B", help="job file (.py) or plan JSON")
    diff.add_argument("--world", metavar="N", type=_positive("a world size"), default=None,
                      help="world size to plan job files for (required for a job file)")
    diff.add_argument("--world-b", metavar="M", type=_positive("a world size"), default=None,
                      help="world size for B when it differs from A's")
    diff.add_argument("--json", action="store_true", help="print the comparison as one JSON object")
    _add_model_arguments(diff)
    diff.set_defaults(command=_cmd_diff)

    check = verbs.add_parser("check", help="compare sharded training with one-process torch.optim training",
                             description="Train FILE's job sharded at each world size and in one process with "
                                         "torch.optim on the same global batches; compare the parameters. "
                                         "Exit 1 if any world size is outside the tolerance for the dtype.")
    check.add_argument("file", metavar="FILE", help="job file (see docs/cli.md)")
    check.add_argument("--world-sizes", metavar="N,N,...", type=_world_sizes, default=(1, 2, 4),
                       help="comma-separated world sizes (default 1,2,4)")
    check.add_argument("--steps", metavar="K", type=_positive("a number of steps"), default=DEFAULT_CHECK_STEPS,
                       help=f"training steps (default {DEFAULT_CHECK_STEPS})")
    check.add_argument("--seed", metavar="S", type=int, default=0, help="seed for build_model (default 0)")
    check.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                       help="convert the model and floating batch leaves (default: the job's dtype, else as built)")
    check.set_defaults(command=_cmd_check)
    return parser


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The cost model's knobs (docs/plan.md, "The knobs")."""
    group = parser.add_argument_group("cost model")
    group.add_argument("--link", choices=sorted(cost.LINKS), default="gloo-loopback",
                       help="link preset for the alpha-beta model (default gloo-loopback)")
    group.add_argument("--compute", choices=sorted(cost.COMPUTE), default="cpu",
                       help="compute preset for the roofline (default cpu)")
    group.add_argument("--alpha", metavar="SECONDS", type=_nonnegative_float("a latency"), default=None,
                       help="latency of one ring step, overriding the link's")
    group.add_argument("--bandwidth", metavar="BYTES_PER_S", type=_positive_float("a bandwidth"), default=None,
                       help="bytes per second a rank sends, overriding the link's (e.g. 40e9)")
    group.add_argument("--flops", metavar="FLOPS_PER_S", type=_positive_float("a FLOP rate"), default=None,
                       help="matmul rate, overriding the compute preset's (e.g. 400e12)")


def _cost_model(args) -> cost.CostModel:
    link, device = cost.LINKS[args.link], cost.COMPUTE[args.compute]
    if args.alpha is not None:
        link = attrs.evolve(link, alpha_s=args.alpha)
    if args.bandwidth is not None:
        link = attrs.evolve(link, bandwidth=args.bandwidth)
    if args.flops is not None:
        device = attrs.evolve(device, flops_per_s=args.flops)
    return cost.CostModel(link=link, compute=device)


def _float_parser(what: str, ok, expected: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}; expected {expected}")
        return value

    return parse


def _positive_float(what: str):
    return _float_parser(what, lambda v: v > 0 and v != float("inf"), "a number > 0, e.g. 40e9")


def _nonnegative_float(what: str):
    return _float_parser(what, lambda v: v >= 0 and v != float("inf"), "a number >= 0 in seconds, e.g. 5e-6")


def _positive(what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < 1:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}; expected an integer >= 1")
        return value

    return parse


def _world_sizes(text: str) -> tuple[int, ...]:
    parts = [p.strip() for p in text.split(",")]
    try:
        sizes = tuple(int(p) for p in parts)
    except ValueError:
        sizes = ()
    if not sizes or any(n < 1 for n in sizes):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list of world sizes; expected comma-separated integers >= 1, e.g. 1,2,4"
        )
    return tuple(dict.fromkeys(sizes))


# ---- run ---------------------------------------------------------------------


def _cmd_run(args) -> int:
    if "WORLD_SIZE" in os.environ:  # started by torchrun: this process is one rank
        world = read_env().world_size
        if args.nproc is not None and args.nproc != world:
            raise SpecError(f"--nproc {args.nproc} disagrees with WORLD_SIZE={world} set by torchrun; "
                            "drop --nproc or make them equal")
        job = _load_checked(args.file, world)
        ctx = init_from_env()
        try:
            _train(ctx, job, args.steps, args.seed, args.trace)
        finally:
            shutdown()
        return 0
    nproc = args.nproc or 1
    job = _load_checked(args.file, nproc)
    trace = str(Path(args.trace).resolve()) if args.trace else None
    if nproc == 1:
        _train(DistContext.single(), job, args.steps, args.seed, trace)
    else:
        launch(_run_rank, nproc, str(job.path), args.steps, args.seed, trace,
               timeout=None, threads=_threads_per_rank(nproc), prefix_output=False)
    return 0


def _run_rank(ctx: DistContext, path: str, steps: int, seed: int, trace: str | None = None) -> None:
    """One rank of ``shardlang run`` under the local launcher (module level: pickled by reference)."""
    _train(ctx, load_job(path), steps, seed, trace)


def _train(ctx: DistContext, job: Job, steps: int, seed: int, trace: str | None = None) -> None:
    """Compile and train ``steps`` steps on this rank; rank 0 prints the global losses and the schedule.

    With ``trace``, the last `TRACED_STEPS` steps (never the first, which warms up) run under the
    profiler and each rank writes its Chrome trace (`shardlang.profile`).
    """
    say = _printer(ctx)
    backend = ctx.backend.value if ctx.backend else "no process group"
    say(f"shardlang run {_shown(job.path)}: {ctx.world_size} rank{'s' if ctx.world_size > 1 else ''} "
        f"({backend}, {ctx.device}), {steps} steps, seed {seed}")
    started = time.perf_counter()
    model = build(job, seed)
    example = _split(job, global_batch(job, 0), ctx.world_size, ctx.rank, 0)
    step = api.compile(model, job.loss_fn, job.spec, optimizer=job.optimizer, example_batch=example, dist_context=ctx,
                       lr_schedule=job.lr_schedule)
    del model  # the step holds this rank's shards
    say(f"compiled in {time.perf_counter() - started:.2f} s")
    training = time.perf_counter()
    traced_from = max(1, steps - TRACED_STEPS) if trace else steps
    tracing = contextlib.ExitStack()
    run_step = step
    for k in range(steps):
        if k == traced_from and trace:
            from .profile import rank_path, trace_steps

            run_step = tracing.enter_context(trace_steps(step, rank_path(trace, ctx.rank)))
        batch = _split(job, global_batch(job, k), ctx.world_size, ctx.rank, k)
        begin = time.perf_counter()
        loss = run_step(batch)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        elapsed = time.perf_counter() - begin
        say(f"step {k + 1}/{steps}  loss {_global_mean(loss, ctx):.6f}  time {elapsed * 1e3:.1f} ms"
            + ("  (profiled)" if run_step is not step else ""))
    tracing.close()
    say(f"trained {steps} steps in {time.perf_counter() - training:.2f} s\n")
    if trace and traced_from < steps:
        say(f"measured trace of steps {traced_from + 1}-{steps}: {trace}"
            + (f" (ranks 1-{ctx.world_size - 1}: {_shown(rank_path(trace, 1))} ...)" if ctx.world_size > 1 else "")
            + "\n")
    say(step.schedule.summary_text() + "\n")
    say(step.schedule.table(max_rows=TABLE_ROWS))


def _global_mean(loss: torch.Tensor, ctx: DistContext) -> float:
    """The mean of the ranks' local losses: the global batch's loss (equal per-rank batches, mean-reduced loss)."""
    value = loss.detach().to(torch.float64).reshape(())
    if ctx.has_process_group:
        value = value.clone()
        dist.all_reduce(value)
        value /= ctx.world_size
    return float(value)


# ---- plan --------------------------------------------------------------------


def _cmd_plan(args) -> int:
    stdout = sys.stdout
    # With --json, stdout carries the JSON object only: whatever the job file prints goes to stderr.
    quiet = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    model = _cost_model(args)
    with quiet:
        job, plan = _plan_job(args.file, args.world, model)
        _write_pictures(args, plan)
    if args.json:
        stdout.write(plan.to_json(indent=2) + "\n")
        stdout.flush()
        return 0
    print(f"shardlang plan {_shown(job.path)}: world {args.world}, optimizer {job.optimizer!r}\n")
    print(plan.report())
    return 0


def _plan_job(path, world: int, model: cost.CostModel):
    """Plan a job file for ``world`` ranks with fake tensors: (job, `Plan`)."""
    from .compiler.plan_report import make_plan

    job = load_job(path)
    example = _split(job, global_batch(job, 0), world, 0, 0)
    compiled = api.plan(lambda: build(job), job.loss_fn, job.spec, optimizer=job.optimizer,
                        example_batch=example, world_size=world)
    return job, make_plan(compiled, cost_model=model)


def _write_pictures(args, plan) -> None:
    if args.chrome_trace:
        from .compiler.timeline import write_chrome_trace

        write_chrome_trace(args.chrome_trace, plan.schedule, plan.timeline, plan.memory)
        print(f"wrote the predicted timeline to {args.chrome_trace} (open it in ui.perfetto.dev)", file=sys.stderr)
    if args.plot:
        from .plot import plot_memory

        plot_memory(plan, args.plot)
        print(f"wrote memory over the schedule to {args.plot}", file=sys.stderr)


# ---- diff --------------------------------------------------------------------


def _cmd_diff(args) -> int:
    from .compiler.plan_diff import diff_plans

    stdout = sys.stdout
    quiet = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    model = _cost_model(args)
    with quiet:
        a, label_a = _plan_source(args.a, args.world, model, "--world")
        b, label_b = _plan_source(args.b, args.world_b or args.world, model, "--world (or --world-b)")
    comparison = diff_plans(a, b, labels=(label_a, label_b))
    if args.json:
        stdout.write(comparison.to_json(indent=2) + "\n")
        stdout.flush()
    else:
        print(comparison.text())
    return 0


def _plan_source(source: str, world: int | None, model: cost.CostModel, flag: str):
    """A plan to compare: a saved ``plan --json`` file, or a job file planned for ``world`` ranks."""
    import json

    path = Path(source)
    if path.suffix == ".json":
        try:
            with open(path) as f:
                data = json.load(f)
        except FileNotFoundError:
            raise SpecError(f"plan file {source} does not exist") from None
        except json.JSONDecodeError as exc:
            raise SpecError(f"{source} is not a plan JSON file (write one with 'shardlang plan FILE --world N "
                            f"--json > {path.name}'): {exc}") from None
        if not isinstance(data, dict) or "ops" not in data or "world_size" not in data:
            raise SpecError(f"{source} is JSON but not a plan; write one with 'shardlang plan FILE --world N --json'")
        return data, f"{_shown(path)} (world {data['world_size']})"
    if world is None:
        raise SpecError(f"{source} is a job file: give {flag} N to plan it")
    _, plan = _plan_job(source, world, model)
    return plan, f"{_shown(path.resolve())} (world {world})"


# ---- check -------------------------------------------------------------------


def _cmd_check(args) -> int:
    job = load_job(args.file)
    dtype = DTYPES[args.dtype] if args.dtype else None
    reference = build(job, args.seed, dtype)
    model_dtype = _floating_dtype(reference)
    limit = tolerance(model_dtype, job.optimizer)
    if limit is None:
        raise SpecError(f"check compares float32 or float64 parameters; {_shown(job.path)} builds {model_dtype}; "
                        "pass --dtype float32 or --dtype float64")
    batches = [global_batch(job, k, dtype) for k in range(args.steps)]
    for world in args.world_sizes:
        for k, batch in enumerate(batches):
            _split(job, batch, world, 0, k)

    print(f"shardlang check {_shown(job.path)}: {args.steps} steps, {str(model_dtype).removeprefix('torch.')}, "
          f"seed {args.seed}, tolerance {limit:.0e}", flush=True)
    print("  (per parameter max|sharded - reference| / max|reference|, the max over parameters)")
    ref_losses, ref_params, ref_optimizer = _train_reference(job, reference, batches)
    print(f"reference: 1 process, torch.optim.{ref_optimizer}, final loss {ref_losses[-1]:.6f}\n")
    print(f"{'world':<7}{'max rel. param diff':<22}{'final loss':<14}result", flush=True)
    failed = []
    for world in args.world_sizes:
        if world == 1:
            losses, params = _train_sharded(DistContext.single(), job, batches, args.seed, dtype)
        else:
            losses, params = launch(_check_rank, world, str(job.path), batches, args.seed, args.dtype,
                                    timeout=None, threads=_threads_per_rank(world))[0]
        diff = max_relative_difference(params, ref_params)
        passed = diff <= limit  # False for NaN
        if not passed:
            failed.append(world)
        print(f"{world:<7}{diff:<22.3e}{losses[-1]:<14.6f}{'PASS' if passed else 'FAIL'}", flush=True)
    if failed:
        print(f"\nFAIL: world size{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} "
              f"differ from the reference by more than {limit:.0e}")
        return 1
    print("\nPASS")
    return 0


def _check_rank(ctx: DistContext, path: str, batches: list, seed: int, dtype_name: str | None):
    """One rank of ``shardlang check`` (module level: the launcher pickles it by reference)."""
    dtype = DTYPES[dtype_name] if dtype_name else None
    return _train_sharded(ctx, load_job(path), batches, seed, dtype)


def _train_sharded(ctx: DistContext, job: Job, batches: list, seed: int, dtype: torch.dtype | None):
    """Train on the given global batches; rank 0 returns (global losses, full parameters), others None."""
    model = build(job, seed, dtype)
    example = _split(job, batches[0], ctx.world_size, ctx.rank, 0)
    step = api.compile(model, job.loss_fn, job.spec, optimizer=job.optimizer, example_batch=example, dist_context=ctx,
                       lr_schedule=job.lr_schedule)
    losses = [_global_mean(step(_split(job, b, ctx.world_size, ctx.rank, k)), ctx) for k, b in enumerate(batches)]
    params = {name: p.cpu() for name, p in step.full_parameters().items()}  # a collective: every rank calls it
    return (losses, params) if ctx.is_main else None


def _train_reference(job: Job, model: torch.nn.Module, batches: list):
    """One process, torch.optim, the whole global batch per step: (losses, parameters by name, optimizer name)."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = reference_optimizer(job.optimizer, torch_param_groups(trainable, job.spec.param_groups))
    clip = job.spec.options.clip_grad_norm
    scheduler = job.lr_schedule(optimizer) if job.lr_schedule is not None else None
    losses = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(job.spec.options.seed)  # what every rank's generator starts from under random="global"
        for batch in batches:
            optimizer.zero_grad()
            loss = job.loss_fn(model, batch)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_([p for _, p in trainable], clip)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            losses.append(float(loss.detach()))
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}, type(optimizer).__name__


def max_relative_difference(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """Max over parameters of ``max|a - b| / max|b|`` (``max|a - b|`` where the reference is all zero).

    Example::

        >>> max_relative_difference({"w": torch.tensor([1.0, 2.2])}, {"w": torch.tensor([1.0, 2.0])})
        0.1...
    """
    missing = sorted(set(reference) - set(params))
    if missing:
        raise ShardlangRuntimeError(f"the sharded step returned no value for parameters {missing}")
    worst = 0.0
    for name, ref in reference.items():
        if ref.numel() == 0:
            continue
        ref64, got64 = ref.detach().to(torch.float64), params[name].detach().to(torch.float64)
        scale = float(ref64.abs().max()) or 1.0
        diff = float((got64 - ref64).abs().max()) / scale
        if diff != diff:  # NaN: report it, never hide it behind max()
            return diff
        worst = max(worst, diff)
    return worst


# ---- helpers -----------------------------------------------------------------


def _load_checked(path: str, world: int) -> Job:
    """Load the job and check that its first global batch splits over ``world`` ranks, before any rank starts."""
    job = load_job(path)
    _split(job, global_batch(job, 0), world, 0, 0)
    return job


def _split(job: Job, batch, world: int, rank: int, step: int):
    try:
        return split_batch(batch, world, rank)
    except ShardlangRuntimeError as exc:
        raise ShardlangRuntimeError(f"{_shown(job.path)}: make_batch({step}): {exc}") from exc


def _floating_dtype(model: torch.nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.get_default_dtype()


def _threads_per_rank(nproc: int) -> int:
    return max(1, (os.cpu_count() or 1) // nproc)


def _printer(ctx: DistContext):
    """``print`` (flushed) on rank 0; nothing elsewhere."""
    if not ctx.is_main:
        return lambda *_args, **_kwargs: None
    return lambda *args, **kwargs: print(*args, **kwargs, flush=True)


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it is under it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _own_error_line(exc: WorkerError) -> str | None:
    """One line for a job that failed because ranks raised the same shardlang error; None otherwise.

    The launcher sends back each rank's ``"Type: message"``, not the exception itself,
    so shardlang's own errors are recognised by their class names.
    """
    own = _subclass_names(ShardlangError)
    causes = [f for f in exc.failures if f.kind is not FailureKind.STOPPED]
    if not causes or any(f.kind is not FailureKind.RAISED or f.detail.split(":", 1)[0] not in own for f in causes):
        return None
    details = dict.fromkeys(f.detail for f in causes)
    if len(details) != 1:
        return None
    ranks = ", ".join(str(f.rank) for f in causes)
    return f"rank{'s' if len(causes) > 1 else ''} {ranks}: {next(iter(details))}"


def _subclass_names(cls: type) -> set[str]:
    names = {cls.__name__}
    for sub in cls.__subclasses__():
        names |= _subclass_names(sub)
    return names
