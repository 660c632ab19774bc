"""``shardlang run FILE --nproc N [--steps K] [--seed S] [--weights PATH] [--trace PATH] [--timeout S]
[--checkpoint-dir D ...]``:
train a job.

Trains on N local CPU ranks (gloo), or on the ranks torchrun started (when
WORLD_SIZE is set); rank 0 prints the global loss of each step, then the
schedule's summary and table, and last the line
``peak memory per rank: init <A> MiB, training <B> MiB`` (`shardlang.runtime.peak_memory`).
A model built on the meta device is materialised unit by unit
(`shardlang.step.materialize`); ``--weights`` loads pretrained weights shard by shard. With ``--trace``, the last steps are profiled into
a Chrome trace whose ranges carry the schedule's op names (`shardlang.cli.profile`).
With ``--checkpoint-dir D``, the run saves ``D/step-<k>`` every
``--checkpoint-every`` steps and after the last (``--keep N`` newest kept,
``--async-save`` in the background); ``--resume`` first loads the latest
complete checkpoint in D and goes on from there to ``--steps`` (docs/checkpoints.md).
A fresh run refuses a D that holds checkpoints unless ``--overwrite`` says to
replace them. A step whose loss or gradient norm is not finite stops the run
(exit 1, `NonFiniteError`) before it is saved, unless ``--max-nonfinite`` allows more.
``--timeout`` bounds each collective's wait for late peers; the error then names
the late rank and the schedule op (Note [collective timeout] in
`shardlang.runtime.watch`).
With ``--eval-every K``, every K steps rank 0 also prints the validation loss
on the job's ``make_eval_batch(steps done)``, from the step's evaluation graph
(`Step.evaluate`: forward only, eval mode, on the training state).

Example::

    $ shardlang run examples/mlp.py --nproc 2 --steps 3
    $ shardlang run examples/gpt.py --nproc 4 --steps 6 --checkpoint-dir ckpt --checkpoint-every 3 --resume
    $ torchrun --nproc-per-node 4 -m shardlang run examples/gpt.py --steps 100
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

import attrs

from ..checkpoint import CheckpointDir
from ..checkpoint.store import check_directory, steps_of
from ..checkpoint.periodic import Periodic
from ..errors import CheckpointError, NonFiniteError, SpecError
from .job import Job, build, load_job
from .progress import ProgressOptions, RunReporter, print_while_read
from ..runtime.dist import DEFAULT_COLLECTIVE_TIMEOUT_S, DistContext, init_from_env, read_env, shutdown
from ..runtime.launcher import OutputPrefix, launch
from ..runtime.peak_memory import MIB, PeakMemory
from .args import add_spec_argument, output_file, positive, seconds, spec_path
from .common import compile_job, eval_example, global_mean, load_checked, rank_batch, shown, threads_per_rank

DEFAULT_RUN_STEPS = 5
TRACED_STEPS = 3  # `run --trace` profiles this many steps at the end (after at least one untraced step)
TABLE_ROWS = 40  # `run` keeps its summary to one screen


def add_parser(subparsers) -> None:
    """Register ``shardlang run`` on the top-level parser's subparsers."""
    parser = subparsers.add_parser(
        "run", help="train a job on N local CPU ranks (or under torchrun)",
        description="Train FILE's job sharded over N ranks; rank 0 prints the global loss per step and the "
                    "schedule. Under torchrun (WORLD_SIZE set) the ranks are torchrun's and --nproc, if given, "
                    "must equal WORLD_SIZE.")
    parser.add_argument("file", metavar="FILE", help="job file (see docs/cli.md)")
    parser.add_argument("--nproc", metavar="N", type=positive("a number of ranks"), default=None,
                        help="number of ranks (default: WORLD_SIZE under torchrun, else 1)")
    parser.add_argument("--steps", metavar="K", type=positive("a number of steps"), default=DEFAULT_RUN_STEPS,
                        help=f"training steps (default {DEFAULT_RUN_STEPS})")
    parser.add_argument("--seed", metavar="S", type=int, default=0,
                        help="seed for build_model and for initialising a model built on meta (default 0)")
    add_spec_argument(parser)
    parser.add_argument("--weights", metavar="PATH", default=None,
                        help="load the parameters from a safetensors file or a Hugging Face checkpoint directory "
                             "(each rank reads only its slices); overrides the job file's `weights`")
    parser.add_argument("--trace", metavar="PATH", type=output_file, default=None,
                        help=f"profile the last {TRACED_STEPS} steps into a Chrome trace at PATH (rank r > 0 writes "
                             "PATH's stem + .rank<r>); its ranges carry the schedule's op names")
    parser.add_argument("--timeout", metavar="SECONDS", type=seconds("a timeout"),
                        default=DEFAULT_COLLECTIVE_TIMEOUT_S,
                        help="how long a collective waits for late ranks before the run fails with an error naming "
                             f"them and the schedule op (default {DEFAULT_COLLECTIVE_TIMEOUT_S:g}, as NCCL's)")
    parser.add_argument("--log-every", metavar="K", type=positive("a number of steps"), default=None,
                        help="print the plain 'step k/n  loss ...' line every K steps, and the first and last "
                             "(default: every step when output is not a terminal; under the terminal's progress "
                             "bar, none)")
    parser.add_argument("--metrics", metavar="PATH", type=output_file, default=None,
                        help="write one JSON line per logged step to PATH: loss, step time, throughput, peak "
                             "memory per rank, ETA (docs/cli.md, 'Metrics')")
    parser.add_argument("--max-nonfinite", metavar="K", type=positive("a number of steps"), default=None,
                        help="stop with exit code 1 after K steps whose loss or gradient norm is inf or nan (default "
                             "1; with Options(skip_nonfinite=True), which skips those updates, no limit unless given)")
    parser.add_argument("--eval-every", metavar="K", type=positive("a number of steps"), default=None,
                        help="every K steps, print the validation loss on the job's make_eval_batch(step) "
                             "(forward only, eval mode)")
    saving = parser.add_argument_group("checkpoints (docs/checkpoints.md)")
    saving.add_argument("--checkpoint-dir", metavar="D", default=None,
                        help="save checkpoints into D/step-<k> (after the last step, and every --checkpoint-every)")
    saving.add_argument("--checkpoint-every", metavar="K", type=positive("a number of steps"), default=None,
                        help="also save after every K steps (needs --checkpoint-dir)")
    saving.add_argument("--resume", action="store_true",
                        help="load the latest complete checkpoint in --checkpoint-dir first and continue from it "
                             "(a fresh start when there is none)")
    saving.add_argument("--overwrite", action="store_true",
                        help="start afresh in a --checkpoint-dir that holds another run's checkpoints; they are "
                             "removed once this run's first checkpoint is complete")
    saving.add_argument("--keep", metavar="N", type=positive("a number of checkpoints"), default=None,
                        help="keep only the newest N checkpoints of this run in --checkpoint-dir (default: all); "
                             "never the one just saved, never another run's")
    saving.add_argument("--async-save", nargs="?", const="thread", default=None, choices=("thread", "process"),
                        help="write checkpoints in the background while training goes on, by a thread of each "
                             "rank (the default) or by a process of its own per rank (--async-save process)")
    parser.set_defaults(command=main)


@attrs.frozen
class RunFlags:
    """How long and how one run trains, as plain data (sent to every rank)."""

    steps: int
    seed: int = 0
    trace: str | None = None  # a Chrome trace of the last steps, rank 0's path
    eval_every: int | None = None
    max_nonfinite: int | None = None  # None: 1, or no limit under Options(skip_nonfinite=True)
    spec_file: str | None = None  # --spec: a TOML spec in place of the job's

    @classmethod
    def from_args(cls, args, trace: str | None = None) -> RunFlags:
        return cls(args.steps, args.seed, trace if trace is not None else args.trace, args.eval_every,
                   args.max_nonfinite, spec_path(args))


@attrs.frozen
class Checkpointing:
    """The checkpoint flags of one run, as plain data (sent to every rank)."""

    directory: str | None = None
    every: int | None = None
    resume: bool = False
    keep: int | None = None
    asynchronous: str | None = None  # the checkpointer of async saves: "thread" or "process"
    overwrite: bool = False
    run_id: str | None = None  # recorded in each manifest; --keep prunes by it (Note [replacing a checkpoint])

    @classmethod
    def from_args(cls, args) -> Checkpointing:
        """The flags, checked before anything compiles: the directory can hold checkpoints, and a fresh run does
        not mix with another run's checkpoints unless told to."""
        flags = {"--checkpoint-every": args.checkpoint_every, "--resume": args.resume or None,
                 "--keep": args.keep, "--async-save": args.async_save, "--overwrite": args.overwrite or None}
        if args.checkpoint_dir is None:
            given = [flag for flag, value in flags.items() if value is not None]
            if given:
                raise SpecError(f"{given[0]} needs --checkpoint-dir D (the directory of the checkpoints)")
            return cls()
        if args.resume and args.overwrite:
            raise SpecError("--resume and --overwrite exclude each other: --resume continues from the latest "
                            "checkpoint in --checkpoint-dir, --overwrite starts afresh and replaces them")
        root = Path(args.checkpoint_dir).resolve()
        check_directory(root)
        if not args.resume and not args.overwrite:
            found = CheckpointDir(root).complete()
            if found:
                names = ", ".join(p.name for _, p in found[-3:]) + (f" ({len(found)} in all)" if len(found) > 3 else "")
                raise CheckpointError(f"--checkpoint-dir {root} already holds checkpoints ({names}); pass --resume "
                                      "to continue from the latest, or --overwrite to start afresh and replace "
                                      "them", path=root)
        return cls(str(root), args.checkpoint_every, args.resume, args.keep, args.async_save, args.overwrite,
                   uuid.uuid4().hex)

    def check(self, ctx) -> None:
        """Refuse what this world cannot do before compiling (a checkpointer process in a world of one)."""
        if self.asynchronous is not None:
            from ..checkpoint.background import Checkpointer, check_checkpointer  # imports DCP: only when used

            check_checkpointer(Checkpointer(self.asynchronous), ctx)

    def periodic(self) -> Periodic | None:
        if self.directory is None:
            return None
        return Periodic(CheckpointDir(self.directory, keep=self.keep, run_id=self.run_id), self.every,
                        asynchronous=self.asynchronous is not None, overwrite=self.overwrite,
                        checkpointer=self.asynchronous or "thread")

    def nothing_to_do(self, steps: int) -> str | None:
        """Why a resumed run would train no step (its latest checkpoint is at ``steps`` or past it); else None."""
        if not self.resume:
            return None
        latest = CheckpointDir(self.directory).latest()
        done = steps_of(latest) if latest is not None else None
        if done is None or done < steps:
            return None
        return (f"nothing to do: the latest checkpoint in {self.directory} ({latest.name}) is at step {done}, "
                f"and --steps {steps} asks for no more; pass --steps greater than {done} to train on")


def main(args) -> int:
    """Train the job (``args`` from `add_parser`); the exit code."""
    if "WORLD_SIZE" in os.environ:  # started by torchrun: this process is one rank
        world = read_env().world_size
        if args.nproc is not None and args.nproc != world:
            raise SpecError(f"--nproc {args.nproc} disagrees with WORLD_SIZE={world} set by torchrun; "
                            "drop --nproc or make them equal")
        job = _load(args, world)
        checkpoints = Checkpointing.from_args(args)
        if _nothing_to_do(checkpoints, args.steps, read_env().rank == 0):
            return 0
        ctx = init_from_env(timeout_s=args.timeout)
        try:
            _train(ctx, job, RunFlags.from_args(args), checkpoints, args.weights, _progress(args))
        finally:
            shutdown()
        return 0
    nproc = args.nproc or 1
    job = _load(args, nproc)
    checkpoints = Checkpointing.from_args(args)
    if _nothing_to_do(checkpoints, args.steps, True):
        return 0
    trace = str(Path(args.trace).resolve()) if args.trace else None
    weights = str(Path(args.weights).resolve()) if args.weights else None
    progress = _progress(args)
    if nproc == 1:
        _train(DistContext.single(), job, RunFlags.from_args(args, trace), checkpoints, weights, progress)
    else:
        launch(_run_rank, nproc, str(job.path), RunFlags.from_args(args, trace), checkpoints, weights, progress,
               timeout=None, threads=threads_per_rank(nproc), prefix_output=OutputPrefix.OTHER_RANKS,
               collective_timeout=args.timeout, name=f"shardlang run {shown(job.path)}")
    return 0


def _nothing_to_do(checkpoints: Checkpointing, steps: int, shown: bool) -> bool:
    """Say so (on rank 0) when a resumed run has no step left to train."""
    reason = checkpoints.nothing_to_do(steps)
    if reason is not None and shown:
        print_while_read(reason)
    return reason is not None


def _progress(args) -> ProgressOptions:
    """The reporting flags of one run (the metrics path made absolute for the ranks)."""
    return ProgressOptions(log_every=args.log_every, metrics=str(Path(args.metrics).resolve()) if args.metrics else None)


def _load(args, world: int) -> Job:
    """The job, with its first batches checked, and ``make_eval_batch`` when ``--eval-every`` needs it."""
    job = load_checked(args.file, world, spec_path(args))
    if args.eval_every is not None:
        if job.make_eval_batch is None:
            raise SpecError(f"--eval-every {args.eval_every}: job file {shown(job.path)} defines no make_eval_batch; "
                            "add def make_eval_batch(step: int) returning the global validation batch "
                            "(docs/cli.md, \"Job files\")")
        eval_example(job, world)
    return job


def _run_rank(ctx: DistContext, path: str, flags: RunFlags, checkpoints: Checkpointing = Checkpointing(),
              weights: str | None = None, progress: ProgressOptions = ProgressOptions()) -> None:
    """One rank of ``shardlang run`` under the local launcher (module level: pickled by reference)."""
    _train(ctx, load_job(path, flags.spec_file), flags, checkpoints, weights, progress)


def _train(ctx: DistContext, job: Job, flags: RunFlags, checkpoints: Checkpointing = Checkpointing(),
           weights: str | None = None, progress: ProgressOptions = ProgressOptions()) -> None:
    """Compile and train up to step ``steps`` on this rank; rank 0 prints the global losses and the schedule.

    With ``trace``, the last `TRACED_STEPS` steps (never the first, which warms up) run under the
    profiler and each rank writes its Chrome trace (`shardlang.cli.profile`). With a checkpoint
    directory, checkpoints are saved (and with ``resume`` the latest is loaded first: the run
    continues from its data position, and the step numbering with it). ``weights`` loads pretrained
    weights (`shardlang.step.weights`). The last line is the peak memory per rank (`shardlang.runtime.peak_memory`).
    """
    steps, seed, trace, eval_every, max_nonfinite = (flags.steps, flags.seed, flags.trace, flags.eval_every,
                                                     flags.max_nonfinite)
    say = _printer(ctx)
    backend = ctx.backend.value if ctx.backend else "no process group"
    say(f"shardlang run {shown(job.path)}: {ctx.world_size} rank{'s' if ctx.world_size > 1 else ''} "
        f"({backend}, {ctx.device}), {steps} steps, seed {seed}")
    started = time.perf_counter()
    peak = PeakMemory.start()
    checkpoints.check(ctx)
    model = build(job, seed)
    step = compile_job(job, model, rank_batch(job, 0, ctx.world_size, ctx.rank), ctx, seed, weights)
    del model  # the step holds this rank's state (Note [the step owns the state])
    peak.mark_init()
    say(f"compiled in {time.perf_counter() - started:.2f} s")
    periodic = checkpoints.periodic()
    first = 0
    if periodic is not None and checkpoints.resume:
        restored = periodic.resume(step)
        if restored is None:
            say(f"no checkpoint in {checkpoints.directory} yet: starting at step 1")
        else:
            first = restored.data_position
            restore = getattr(job.make_batch, "restore", None)
            if callable(restore):  # a job's `data` loader (Note [loader batches])
                restore(first, restored.data_state, say)
            by = ("not written by shardlang" if restored.world_size is None else
                  f"written by {restored.world_size} rank{'s' if restored.world_size != 1 else ''}")
            say(f"resumed from {restored.path} (step {restored.steps}, {by})")
    reporter = RunReporter(ctx, steps, progress, first=first)  # how steps are reported (shardlang.cli.progress)
    training = time.perf_counter()
    traced_from = max(first + 1, steps - TRACED_STEPS) if trace else steps
    nonfinite_steps = 0
    tracing = contextlib.ExitStack()
    run_step = step
    for k in range(first, steps):
        if k == traced_from and trace:
            from .profile import rank_path, trace_steps

            run_step = tracing.enter_context(trace_steps(step, rank_path(trace, ctx.rank)))
        batch = rank_batch(job, k, ctx.world_size, ctx.rank)
        begin = time.perf_counter()
        loss = run_step(batch)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        elapsed = time.perf_counter() - begin
        reporter.step(k + 1, loss, elapsed, batch, note="(profiled)" if run_step is not step else "")
        nonfinite = step.nonfinite_report(loss)
        if _nonfinite_anywhere(nonfinite is not None, reporter.last, k + 1, step, ctx):
            nonfinite_steps += 1
            reporter.warn(f"step {k + 1}: {nonfinite or 'not finite on another rank'}")
            limit = _nonfinite_limit(max_nonfinite, step)
            if limit is not None and nonfinite_steps >= limit:
                reporter.close()
                raise NonFiniteError(
                    f"step {k + 1}: the loss or gradient norm was not finite on {nonfinite_steps} step"
                    f"{'s' if nonfinite_steps > 1 else ''} (--max-nonfinite {limit}); training stopped before "
                    "saving this step's state. Lower the learning rate, check the data, or skip such updates "
                    "with Options(skip_nonfinite=True)", step=k + 1, count=nonfinite_steps)
        if periodic is not None:
            saved = periodic.after_step(step, k + 1, last=k + 1 == steps,
                                        data_state=getattr(job.make_batch, "state", None))
            if saved is not None:  # above the bar, if there is one
                reporter.warn(f"checkpoint {'writing' if checkpoints.asynchronous else 'saved'}: {saved}")
        if eval_every is not None and (k + 1) % eval_every == 0:
            _evaluate(step, job, k + 1, ctx, reporter)
    tracing.close()
    reporter.close()
    if periodic is not None:
        periodic.finish(step)
    say(f"trained {steps - first} steps in {time.perf_counter() - training:.2f} s\n")
    if trace and traced_from < steps:
        say(f"measured trace of steps {traced_from + 1}-{steps}: {trace}"
            + (f" (ranks 1-{ctx.world_size - 1}: {shown(rank_path(trace, 1))} ...)" if ctx.world_size > 1 else "")
            + "\n")
    say(step.schedule.summary_text() + "\n")
    say(step.schedule.table(max_rows=TABLE_ROWS))
    init_bytes, training_bytes = _max_over_ranks(peak.values(), ctx)
    say(f"peak memory per rank: init {init_bytes / MIB:.0f} MiB, training {training_bytes / MIB:.0f} MiB")


def _nonfinite_limit(max_nonfinite: int | None, step) -> int | None:
    """Non-finite steps a run may take: 1 by default; none by default when such updates are skipped."""
    if max_nonfinite is not None:
        return max_nonfinite
    return None if step.compiled.context.training.skip_nonfinite else 1


def _nonfinite_anywhere(here: bool, record: dict | None, k: int, step, ctx: DistContext) -> bool:
    """Whether step ``k``'s loss or gradient norm was inf or nan on any rank, decided alike on every rank (a
    rank's loss is its own rows'): from the losses the reporter gathered from every rank when it did so for
    step ``k`` (their mean is not finite when one is; the norm is global), else one small all-reduce."""
    if record is not None and record["step"] == k:
        norm = step.grad_norm
        return not (math.isfinite(record["loss"]) and (norm is None or math.isfinite(float(norm))))
    return _on_any_rank(here, ctx)


def _on_any_rank(flag: bool, ctx: DistContext) -> bool:
    """``flag`` or'ed over the ranks (one small all-reduce)."""
    if not ctx.has_process_group:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _max_over_ranks(values: tuple[int, int], ctx: DistContext) -> tuple[int, int]:
    """Each value's maximum over the ranks (a collective when there is a process group)."""
    t = torch.tensor(values, dtype=torch.int64)
    if ctx.has_process_group:
        device_t = t.to(ctx.device)
        dist.all_reduce(device_t, op=dist.ReduceOp.MAX)
        t = device_t.cpu()
    return int(t[0]), int(t[1])


def _evaluate(step, job: Job, done: int, ctx: DistContext, reporter: RunReporter) -> None:
    """Report the validation loss on ``make_eval_batch(done)``: the mean over ranks of their rows' losses."""
    batch = rank_batch(job, done, ctx.world_size, ctx.rank, evaluation=True)
    first = not step.has_evaluation(batch)
    begin = time.perf_counter()
    loss = global_mean(step.evaluate(batch), ctx)
    line = f"step {done}  val loss {loss:.6f}  time {(time.perf_counter() - begin) * 1e3:.1f} ms"
    reporter.evaluation(done, loss, line + ("  (compiled the evaluation)" if first else ""))


def _printer(ctx: DistContext):
    """``print`` (flushed) on rank 0; nothing elsewhere."""
    if not ctx.is_main:
        return lambda *_args, **_kwargs: None
    return print_while_read
