"""The public entry points: `compile` a sharded training step, or `plan` one without processes."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from .compiler.compile import CompiledStep, compile_step
from .batch import check_example_batch
from .compiler.optim import AdamW
from .errors import ShardlangRuntimeError, SpecError
from .runtime.dist import Backend, DistContext
from .spec import Spec
from .step import Step
from .training import training_of


def compile(model: torch.nn.Module, loss_fn: Callable, spec: Spec, *, optimizer=None, example_batch,
            dist_context: DistContext | None = None, check_each_pass: bool = False, dump_dir=None,
            lr_schedule: Callable | None = None, timeout: float | None = None) -> Step:
    """Compile ``model``'s training step for ``spec`` and bind it to this rank.

    ``loss_fn(model, batch)`` returns a scalar loss; ``example_batch`` is a
    per-rank batch. Every rank must call this with the same model (same
    initial values), spec and optimizer. Without ``dist_context`` the step
    joins torch.distributed's default group when one is initialised and runs
    alone otherwise. ``lr_schedule`` is a function that takes a torch optimizer
    and returns a ``torch.optim.lr_scheduler`` on it (`shardlang.lr`); the step
    applies it after every optimizer step, without retracing. ``timeout`` (seconds)
    sets how long the step's collectives wait for late peers before they fail with
    an error naming the late rank and the schedule op (default: the process group's,
    10 minutes from `shardlang.runtime.init_process_group`; Note [collective timeout]).

    Example::

        step = sl.compile(model, loss_fn, sl.Spec(sl.Mesh(fsdp=-1)), optimizer=sl.AdamW(lr=1e-3),
                          example_batch=batch)
        loss = step(batch)
    """
    ctx = dist_context or _current_context()
    optimizer = optimizer or AdamW(lr=1e-3)
    compiled = _compile(model, loss_fn, spec, optimizer, example_batch, ctx.world_size, check_each_pass, dump_dir)
    return Step(compiled, model, optimizer, ctx, lr_schedule=lr_schedule, spec=spec, timeout_s=timeout)


def plan(build_model: Callable[[], torch.nn.Module] | torch.nn.Module, loss_fn: Callable, spec: Spec, *,
         optimizer=None, example_batch, world_size: int, check_each_pass: bool = False) -> CompiledStep:
    """Compile for ``world_size`` ranks with fake tensors: no processes, no real weights.

    ``build_model`` is called under a `FakeTensorMode`, so even a model too big
    for this machine is planned without allocating it. Returns the compiled step;
    its ``.schedule`` is the plan.

    Example::

        print(sl.plan(make_model, loss_fn, spec, example_batch=batch, world_size=64).schedule)
    """
    optimizer = optimizer or AdamW(lr=1e-3)
    if isinstance(build_model, torch.nn.Module):
        model = build_model
    elif not callable(build_model):
        raise SpecError(f"build_model is {type(build_model).__name__} {_short(build_model)}; expected a "
                        "torch.nn.Module, or a function of no arguments that returns one")
    else:
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = build_model()
        if not isinstance(model, torch.nn.Module):
            raise SpecError(f"build_model() returned {type(model).__name__} {_short(model)}, not a torch.nn.Module")
    return _compile(model, loss_fn, spec, optimizer, example_batch, world_size, check_each_pass, None)


def _compile(model, loss_fn, spec, optimizer, example_batch, world_size, check_each_pass, dump_dir) -> CompiledStep:
    if not isinstance(spec, Spec):
        raise SpecError(f"spec must be a shardlang.Spec, got {type(spec).__name__}: {spec!r}")
    _check_loss_fn(loss_fn)
    check_example_batch(example_batch)
    resolved = spec.resolve(model, world_size)

    def at_depth(prefetch: int) -> CompiledStep:
        return compile_step(
            model, loss_fn, resolved.params, resolved.mesh, optimizer, example_batch,
            reshard_after_forward=resolved.options.reshard_after_forward, prefetch=prefetch,
            param_dtype=_precision(resolved.options, "param_dtype"),
            reduce_dtype=_precision(resolved.options, "reduce_dtype"),
            training=training_of(resolved), bucket_bytes=resolved.options.bucket_bytes,
            recompute=resolved.recompute, check_each_pass=check_each_pass, dump_dir=dump_dir,
        )

    budget = resolved.options.memory_budget
    if budget is None:
        return at_depth(resolved.options.prefetch)
    return _deepest_prefetch_within(budget, at_depth, max_depth=len(resolved.units))


def _deepest_prefetch_within(budget: int, at_depth: Callable[[int], CompiledStep], max_depth: int) -> CompiledStep:
    """The compiled step with the deepest prefetch whose planned peak fits ``budget`` bytes per rank.

    Deeper prefetch keeps more units gathered at once, so the peak grows with
    the depth; a binary search needs about log2(units) compiles.
    """
    best = at_depth(0)
    if best.memory.peak > budget:
        raise SpecError(
            f"Options.memory_budget={budget} bytes per rank is below the planned peak with no prefetch at all "
            f"({best.memory.peak} bytes); raise the budget, shard more (more ranks, ZeRO-3), or shrink the batch"
        )
    low, high = 1, max_depth
    while low <= high:
        depth = (low + high) // 2
        candidate = at_depth(depth)
        if candidate.memory.peak <= budget:
            best, low = candidate, depth + 1
        else:
            high = depth - 1
    return best


def _check_loss_fn(loss_fn) -> None:
    """``loss_fn`` is called as ``loss_fn(model, batch)``; say so before tracing, where it would fail obscurely."""
    if not callable(loss_fn):
        raise SpecError(f"loss_fn is {type(loss_fn).__name__} {_short(loss_fn)}; expected a function "
                        "loss_fn(model, batch) that returns a scalar tensor")
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):
        return  # a builtin or C callable: nothing to check
    try:
        signature.bind(None, None)
    except TypeError:
        name = getattr(loss_fn, "__name__", "loss_fn")
        raise SpecError(f"loss_fn {name}{signature} cannot be called as loss_fn(model, batch); it must take the "
                        "model and the batch, e.g. def loss_fn(model, batch): x, y = batch; "
                        "return F.mse_loss(model(x), y)") from None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _precision(options, field: str):
    policy = options.mixed_precision
    return None if policy is None else getattr(policy, field)


def _current_context() -> DistContext:
    if not (dist.is_available() and dist.is_initialized()):
        return DistContext.single()
    backend = Backend.parse(dist.get_backend())
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if backend is Backend.NCCL else torch.device("cpu")
    if backend is Backend.NCCL and not torch.cuda.is_available():
        raise ShardlangRuntimeError("the default process group uses NCCL but CUDA is not available")
    return DistContext(rank, dist.get_world_size(), device.index or 0, backend, device)
