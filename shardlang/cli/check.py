"""``shardlang check FILE --world-sizes 1,2,4 [--steps K] [--dtype D] [--weights PATH]``: sharded against torch.optim.

Trains sharded at each world size and once in one process with ``torch.optim``
on the same global batches, compares the parameters at the scale of what
training could move them (`shardlang.cli.compare`, Note [scale of a parameter])
against the tolerance for the dtype and optimizer (`tolerance`, Note [check
tolerance]), and exits 1 when a world size is outside it. A model built on the
meta device is materialised whole for the reference through the same
per-module initialisation the ranks shard (`job.build_reference`, Note
[initial values]); with ``--weights`` both start from the file.

Example::

    $ shardlang check examples/mlp.py --world-sizes 1,2 --dtype float64
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils import _pytree as pytree

from .compare import Movement, relative_difference, scaled_difference
from ..compiler import Adam, StepBackend
from ..errors import SpecError
from .job import Job, build, build_reference, global_batch, load_job, reference_optimizer
from ..runtime.dist import DistContext
from ..runtime.launcher import launch
from ..spec.training import torch_param_groups
from .args import add_spec_argument, positive, spec_path, world_sizes
from .common import compile_job, global_mean, shown, split_for_rank, threads_per_rank

DEFAULT_CHECK_STEPS = 3
DTYPES = {"float32": torch.float32, "float64": torch.float64}

# Note [check tolerance]: the largest difference `check` accepts between sharded
# training and the one-process torch.optim reference, by dtype and optimizer. The
# measure is, per parameter, max|sharded - reference| / scale, with scale the
# largest of the parameter's initial and final size and the run's total movement
# (Note [scale of a parameter] in shardlang/cli/compare.py), and the max over
# parameters. The two computations differ only in rounding: the order of
# additions (gradients summed across ranks, then divided) and how the optimizer's
# factors are grouped. Measured with the older measure, max|sharded - reference| /
# max|reference| (never smaller than today's), on examples/gpt.py (AdamW, lr 3e-3)
# and examples/mlp.py (SGD with momentum), world sizes 1, 2, 4, seeds 0-2, 3-20 steps:
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
# A parameter that starts at zero and whose gradient is zero (examples/bert.py's
# key biases) stays at noise in both runs; only the scale of what training moves
# makes its difference small (0.5-0.7 under the older measure, a false failure).
#
# Chosen: float64 1e-9 for every optimizer (200x the worst measured; a real bug shows
# at 1e-4 or more), float32 1e-5 for SGD (20x the worst measured) and 1e-2 for
# Adam/AdamW (8x the worst measured at the default 3 steps, 3.4x at 20). Real bugs
# measured against the GPT reference after 3 steps: one rank's gradient only (no
# reduction) 2.0, the learning rate off by 1% 0.2, gradients summed instead of
# averaged 1.6e-2 (Adam all but cancels a gradient scale; float64 sees it 7 orders
# above its tolerance). float32 with Adam is a smoke test, and long float32 checks
# drift toward the limit; `--dtype float64` is the exact check. Planted bugs that
# must fail (tests/test_check_noise.py): one unit's gradient scaled by 1 + 1e-6
# (SGD, float64), one flat parameter's update applied twice (AdamW).
# Note [noise floor]: a fixed tolerance cannot tell every model's rounding noise from a bug: Adam and AdamW turn
# the noise of near-zero gradients into changes of order lr (above), and how much depends on the model (a
# ResNet's BatchNorm biases under AdamW in float64 reach 1e-9). So `check` also measures the reference's own
# noise: it trains the one-process reference a second time on the same global batches with their rows in
# another order (reversed), which is the same function summed in another order, and takes the scaled
# difference of the two references as the floor. A world size passes within the fixed tolerance, or within
# FLOOR_MULTIPLE times the floor: sharding changes the order of additions, no more. A floor above
# FLOOR_CEILING times the tolerance is not rounding (the loss depends on the rows' order: per-row randomness,
# a row-order-dependent loss), and is not used. The planted bugs (tests/test_check_noise.py) sit 1e5 times and
# more above the floor.
FLOOR_MULTIPLE = 10.0
FLOOR_CEILING = 1e3

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


def verdict(diff: float, floor: float, limit: float) -> bool:
    """Whether a world size's difference passes: within ``limit``, or within `FLOOR_MULTIPLE` times a
    ``floor`` that is rounding noise (Note [noise floor]).

    Example::

        >>> verdict(3e-9, 1e-9, 1e-9), verdict(3e-8, 1e-9, 1e-9), verdict(0.5, 0.1, 1e-9)
        (True, False, False)
    """
    if diff <= limit:  # False for NaN
        return True
    return floor_is_noise(floor, limit) and diff <= FLOOR_MULTIPLE * floor


def floor_is_noise(floor: float, limit: float) -> bool:
    """A floor this small is the order of additions, not a loss that depends on the rows' order."""
    return 0.0 < floor <= FLOOR_CEILING * limit


def reordered(batch):
    """``batch`` with its rows reversed: every tensor leaf's dim 0 (the global batch's rows)."""
    leaves, spec = pytree.tree_flatten(batch)
    rows = {leaf.shape[0] for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1}
    if len(rows) != 1:  # leaves of several row counts: no single order to change
        return batch
    return pytree.tree_unflatten([leaf.flip(0) if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1 else leaf
                                  for leaf in leaves], spec)


def add_parser(subparsers) -> None:
    """Register ``shardlang check`` on the top-level parser's subparsers."""
    parser = subparsers.add_parser(
        "check", help="compare sharded training with one-process torch.optim training",
        description="Train FILE's job sharded at each world size and in one process with torch.optim on the same "
                    "global batches; compare the parameters. Exit 1 if any world size is outside the tolerance "
                    "for the dtype.")
    parser.add_argument("file", metavar="FILE", help="job file (see docs/cli.md)")
    add_spec_argument(parser)
    parser.add_argument("--world-sizes", metavar="N,N,...", type=world_sizes, default=(1, 2, 4),
                        help="comma-separated world sizes (default 1,2,4)")
    parser.add_argument("--steps", metavar="K", type=positive("a number of steps"), default=DEFAULT_CHECK_STEPS,
                        help=f"training steps (default {DEFAULT_CHECK_STEPS})")
    parser.add_argument("--seed", metavar="S", type=int, default=0, help="seed for build_model (default 0)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="convert the model and floating batch leaves (default: the job's dtype, else as built)")
    parser.add_argument("--weights", metavar="PATH", default=None,
                        help="start from the parameters in a safetensors file or a Hugging Face checkpoint "
                             "directory (sharded: each rank reads its slices; the reference: load_state_dict); "
                             "overrides the job file's `weights`")
    parser.set_defaults(command=main)


def main(args) -> int:
    """Train sharded and with torch.optim, compare, print the table; 0 when every world size passes, else 1."""
    job = load_job(args.file, spec_path(args))
    dtype = DTYPES[args.dtype] if args.dtype else None
    weights = str(Path(args.weights).resolve()) if args.weights else None
    reference = build_reference(job, args.seed, dtype, weights)
    model_dtype = _floating_dtype(reference)
    limit = tolerance(model_dtype, job.optimizer)
    if limit is None:
        raise SpecError(f"check compares float32 or float64 parameters; {shown(job.path)} builds {model_dtype}; "
                        "pass --dtype float32 or --dtype float64")
    batches = [global_batch(job, k, dtype) for k in range(args.steps)]
    for world in args.world_sizes:
        for k, batch in enumerate(batches):
            split_for_rank(job, batch, world, 0, k)

    print(f"shardlang check {shown(job.path)}: {args.steps} steps, {str(model_dtype).removeprefix('torch.')}, "
          f"seed {args.seed}, tolerance {limit:.0e}", flush=True)
    print("  (per parameter max|sharded - reference| / max(max|initial|, max|reference|, total movement), "
          "the max over parameters; docs/cli.md)")
    ref_losses, ref_params, ref_optimizer, movement = _train_reference(job, reference, batches)
    print(f"reference: 1 process, {'torch.compile (inductor), ' if compiled(job) else ''}torch.optim.{ref_optimizer}, "
          f"final loss {ref_losses[-1]:.6f}, "
          f"total movement {movement.total:.3e}")
    _, floor_params, _, _ = _train_reference(job, build_reference(job, args.seed, dtype, weights),
                                             [reordered(b) for b in batches])
    floor, floor_worst = scaled_difference(floor_params, ref_params, movement)
    noise = floor_is_noise(floor, limit)
    print(f"noise floor: {floor:.3e} (the reference again with each batch's rows reversed, worst {floor_worst})"
          + ("" if noise or floor == 0 else "; above the ceiling: the loss depends on the rows' order, so only "
                                            "the fixed tolerance applies") + "\n")
    print(f"{'world':<7}{'max scaled diff':<18}{'final loss':<14}{'result':<8}worst parameter", flush=True)
    failed, multiples = [], []
    for world in args.world_sizes:
        if world == 1:
            losses, params = _train_sharded(DistContext.single(), job, batches, args.seed, dtype, weights)
        else:
            losses, params = launch(_check_rank, world, str(job.path), batches, args.seed, args.dtype, weights,
                                    spec_path(args),
                                    timeout=None, threads=threads_per_rank(world),
                                    name=f"shardlang check {shown(job.path)} at world size {world}")[0]
        diff, worst = scaled_difference(params, ref_params, movement)
        passed = verdict(diff, floor, limit)
        multiples.append(f"world {world}: {diff / floor:.3g}x" if floor > 0 else f"world {world}: -")
        if not passed:
            failed.append(world)
        print(f"{world:<7}{diff:<18.3e}{losses[-1]:<14.6f}{'PASS' if passed else 'FAIL':<8}{worst}", flush=True)
    print(f"\nin units of the noise floor: {', '.join(multiples)} (pass: within {limit:.0e}, or "
          f"{FLOOR_MULTIPLE:g}x the floor{'' if noise else ', not used here'})")
    if failed:
        print(f"\nFAIL: world size{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} "
              f"differ from the reference by more than {limit:.0e}"
              + (f" and {FLOOR_MULTIPLE:g}x the noise floor" if noise else ""))
        return 1
    print("\nPASS")
    return 0


def _check_rank(ctx: DistContext, path: str, batches: list, seed: int, dtype_name: str | None,
                weights: str | None = None, spec_file: str | None = None):
    """One rank of ``shardlang check`` (module level: the launcher pickles it by reference)."""
    dtype = DTYPES[dtype_name] if dtype_name else None
    return _train_sharded(ctx, load_job(path, spec_file), batches, seed, dtype, weights)


def _train_sharded(ctx: DistContext, job: Job, batches: list, seed: int, dtype: torch.dtype | None,
                   weights: str | None = None):
    """Train on the given global batches; rank 0 returns (global losses, full parameters), others None."""
    model = build(job, seed, dtype)
    step = compile_job(job, model, split_for_rank(job, batches[0], ctx.world_size, ctx.rank, 0), ctx, seed, weights)
    losses = [global_mean(step(split_for_rank(job, b, ctx.world_size, ctx.rank, k)), ctx)
              for k, b in enumerate(batches)]
    params = {name: p.cpu() for name, p in step.full_parameters().items()}  # a collective: every rank calls it
    return (losses, params) if ctx.is_main else None


def _train_reference(job: Job, model: torch.nn.Module, batches: list):
    """One process, torch.optim, the whole global batch per step.

    Returns (losses, parameters by name, optimizer name, `Movement`): the
    movement is what Note [scale of a parameter] measures against.
    """
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    # Note [compiled reference]: a step compiled by inductor is compared with the one-process model compiled the
    # same way, so that the check measures shardlang's error, not inductor's reassociation against eager.
    forward = torch.compile(model) if compiled(job) else model
    optimizer = reference_optimizer(job.optimizer, torch_param_groups(trainable, job.spec.param_groups))
    clip = job.spec.options.clip_grad_norm
    scheduler = job.lr_schedule(optimizer) if job.lr_schedule is not None else None
    losses = []
    movement = Movement.start(model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(job.spec.options.seed)  # what every rank's generator starts from under random="global"
        for batch in batches:
            optimizer.zero_grad()
            loss = job.loss_fn(forward, batch)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_([p for _, p in trainable], clip)
            optimizer.step()
            movement.record(model)
            if scheduler is not None:
                scheduler.step()
            losses.append(float(loss.detach()))
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return losses, params, type(optimizer).__name__, movement


def compiled(job: Job) -> bool:
    """Whether the job's step runs under inductor (`Options(backend="inductor")`)."""
    return job.spec.options.backend is StepBackend.INDUCTOR


def max_relative_difference(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """Max over parameters of ``max|a - b| / max|b|``: the measure before Note [scale of a parameter].

    Example::

        >>> max_relative_difference({"w": torch.tensor([1.0, 2.2])}, {"w": torch.tensor([1.0, 2.0])})
        0.1...
    """
    return relative_difference(params, reference)[0]


def _floating_dtype(model: torch.nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.get_default_dtype()
