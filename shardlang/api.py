"""The public entry points: `compile` a sharded training step, or `plan` one without processes."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import math

import attrs
import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from .compiler import (
    COMPUTE_PRESETS, LINK_PRESETS, AdamW, CompiledStep, CostModel, TensorShape, collection_paused, compile_eval,
    compile_step, fit_budget, human_bytes, tied_parameters, with_buffer_pool,
)
from .step.batch import check_example_batch
from shardlang.spec.vocabulary import Recompute
from .errors import ShardlangRuntimeError, SpecError
from .step.materialize import Init, has_meta, materialize
from .step.ownership import check_not_handed_over, release
from .runtime.dist import Backend, DistContext
from .spec.spec import Spec
from .step.step import Step
from .step.variants import DEFAULT_SHAPE_LIMIT, Recipe


def compile(model: torch.nn.Module, loss_fn: Callable, spec: Spec, *, optimizer=None, example_batch,
            dist_context: DistContext | None = None, check_each_pass: bool = False, dump_dir=None,
            lr_schedule: Callable | None = None, timeout: float | None = None, init_seed: int = 0,
            init_weights: Callable | None = None, weights=None, shape_limit: int = DEFAULT_SHAPE_LIMIT) -> Step:
    """Compile ``model``'s training step for ``spec`` and bind it to this rank; the step owns the state.

    ``loss_fn(model, batch)`` returns a scalar loss; ``example_batch`` is a
    per-rank batch. Every rank must call this with the same model, spec and
    optimizer. Without ``dist_context`` the step joins torch.distributed's
    default group when one is initialised and runs alone otherwise.
    ``lr_schedule`` is a function that takes a torch optimizer and returns a
    ``torch.optim.lr_scheduler`` on it (`shardlang.step.lr`); the step applies it
    after every optimizer step, without retracing.

    ``timeout`` (seconds) sets how long the step's collectives wait for late
    peers before they fail with an error naming the late rank and the schedule
    op (default: the process group's, 10 minutes from
    `shardlang.runtime.init_process_group`; Note [collective timeout]).

    ``model`` may be built on the meta device (``with torch.device("meta"):``):
    each rank then materialises only its shards, one unit at a time
    (`shardlang.step.materialize`, Note [materialisation]), initialising every
    module with ``reset_parameters()`` and then ``init_weights(module)`` when
    given, under seeds derived from ``init_seed`` and the module's name, so the
    values are the same at every world size and spec. ``weights`` (a
    safetensors file or a Hugging Face checkpoint directory) loads every
    parameter instead, each rank reading only its slices (`shardlang.step.weights`).
    A model with real values is sharded as it is (its values must be equal on
    every rank).

    Afterwards ``model`` holds meta tensors and calling it raises: the step
    has the weights (Note [the step owns the state]); ``step.load_into(model)``
    brings them back whole, for small models.

    A batch of another shape (a last partial batch, other sequence lengths;
    ranks may differ in the same step) compiles once more on first sight, with
    the same spec and options, over the same shards and optimizer state
    (`shardlang.step.variants`); past ``shape_limit`` distinct shapes a `ShapeWarning`
    names them. The step keeps a reference to ``model`` to trace it again.

    Example::

        with torch.device("meta"):
            model = GPT(config)
        step = sl.compile(model, loss_fn, sl.Spec(sl.Mesh(fsdp=-1)), optimizer=sl.AdamW(lr=1e-3),
                          example_batch=batch)
        loss = step(batch)
    """
    ctx = dist_context or _current_context()
    optimizer = optimizer or AdamW(lr=1e-3)
    check_not_handed_over(model)
    init = Init(seed=init_seed, init_weights=init_weights, weights=weights)
    compiled, recipe = _compile_with_recipe(model, loss_fn, spec, optimizer, example_batch, ctx.world_size,
                                            check_each_pass, dump_dir, runtime_cost_model(ctx.backend))
    state = None
    if has_meta(model) or weights is not None:
        state = materialize(compiled, model, ctx.rank, ctx.device, init)
    step = Step(compiled, model, optimizer, ctx, lr_schedule=lr_schedule, state=state, spec=spec, timeout_s=timeout,
                recipe=recipe, shape_limit=shape_limit, loss_fn=loss_fn)
    release(model)
    return step


def plan(build_model: Callable[[], torch.nn.Module] | torch.nn.Module, loss_fn: Callable, spec: Spec, *,
         optimizer=None, example_batch, world_size: int, check_each_pass: bool = False,
         evaluate: bool = False, cost_model=None, budget_hints=None, traces=None) -> CompiledStep:
    """Compile for ``world_size`` ranks with fake tensors: no processes, no real weights.

    ``build_model`` is called under a `FakeTensorMode`, so even a model too big
    for this machine is planned without allocating it. Returns the compiled step;
    its ``.schedule`` is the plan. With ``evaluate=True`` it is the step's
    evaluation graph instead (``Step.evaluate``: ``loss_fn`` forward only, in
    eval mode), on the same flat parameters. ``cost_model`` (a
    `compiler.CostModel`; default: gloo on this CPU) is what a memory budget's
    search predicts step times with; ``budget_hints`` (`compiler.analysis.budget.BudgetHints`)
    what a search over many layouts tells that search (`shardlang tune`); ``traces`` (a
    `compiler.trace_cache.TraceCache`) the traces that search's layouts of one model share
    (Note [shared traces]).

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
    if evaluate:
        return _compile_eval(model, loss_fn, spec, optimizer, example_batch, world_size, check_each_pass, cost_model)
    return _compile(model, loss_fn, spec, optimizer, example_batch, world_size, check_each_pass, None, cost_model,
                    budget_hints, traces)


def _compile_eval(model, loss_fn, spec, optimizer, example_batch, world_size, check_each_pass,
                  cost_model=None) -> CompiledStep:
    """The evaluation graph over the flat parameters the training step would have (no training trace)."""
    if not isinstance(spec, Spec):
        raise SpecError(f"spec must be a shardlang.Spec, got {type(spec).__name__}: {spec!r}")
    resolved = spec.resolve(model, world_size)
    if resolved.options.memory_budget is not None:  # the budget picks the step's options; its evaluations reuse them
        trained = _compile(model, loss_fn, spec, optimizer, example_batch, world_size, False, None, cost_model)
        flats, config = trained.flats, trained.context.config
    else:
        config = resolved.config
        flats = config.flats()
    return compile_eval(model, loss_fn, flats, config, example_batch, check_each_pass=check_each_pass)


def _compile(model, loss_fn, spec, optimizer, example_batch, world_size, check_each_pass, dump_dir,
             cost_model=None, budget_hints=None, traces=None) -> CompiledStep:
    return _compile_with_recipe(model, loss_fn, spec, optimizer, example_batch, world_size, check_each_pass,
                                dump_dir, cost_model, budget_hints, traces)[0]


@collection_paused  # the budget's search too: Note [no collection while compiling]
def _compile_with_recipe(model, loss_fn, spec, optimizer, example_batch, world_size, check_each_pass,
                         dump_dir, cost_model=None, budget_hints=None, traces=None) -> tuple[CompiledStep, Recipe]:
    """The compiled step for ``example_batch``, and the `Recipe` that compiles other batch shapes identically."""
    if not isinstance(spec, Spec):
        raise SpecError(f"spec must be a shardlang.Spec, got {type(spec).__name__}: {spec!r}")
    _check_loss_fn(loss_fn)
    check_example_batch(example_batch)
    resolved = spec.resolve(model, world_size)

    backend = _link_backend(cost_model)

    def at(config, traced=None, *, batch=example_batch, buffers=None, tied=None, dump_dir=dump_dir,
           buffer_pool=True) -> CompiledStep:
        step = compile_step(model, loss_fn, config, optimizer, batch, check_each_pass=check_each_pass,
                            dump_dir=dump_dir, traced=traced, buffers=buffers, tied=tied, buffer_pool=False,
                            traces=traces)
        # the pool keeps the peak of the plan for the cost model's link (Note [pool after the search])
        return with_buffer_pool(step, backend) if buffer_pool else step

    recipe = Recipe(model, loss_fn, resolved, optimizer, at,
                    {name: TensorShape.of(b) for name, b in model.named_buffers()}, tied_parameters(model),
                    None if dump_dir is None else str(dump_dir))
    budget = resolved.options.memory_budget
    if budget is not None:
        return _fit_budget(budget, resolved, at, example_batch, cost_model, budget_hints), recipe
    return at(resolved.config), recipe


def _fit_budget(budget: int, resolved, at, example_batch, cost_model=None, budget_hints=None) -> CompiledStep:
    """Options.memory_budget: recompute per unit and prefetch depth chosen by `compiler.analysis.budget.fit_budget`.

    Units the spec gives a recompute policy other than "none" keep it; the
    search chooses for the others (the root unit only when it is the only one).
    One trace serves every configuration tried.
    """
    fixed = {u: p for u, p in resolved.recompute.items() if p is not Recompute.NONE}
    free = [u for u in resolved.units if u and u not in fixed] or [u for u in resolved.units if u not in fixed]
    config = resolved.config
    backend = _link_backend(cost_model)
    first = at(config.scheduled(recompute=fixed), buffer_pool=False)  # Note [pool after the search]
    cache = {(tuple(sorted((u, p.value) for u, p in fixed.items())), resolved.options.prefetch): first}

    def compile_at(recompute, depth):
        key = (tuple(sorted((u, p.value) for u, p in recompute.items())), depth)
        if key not in cache:
            cache[key] = at(config.scheduled(recompute=recompute, prefetch=depth), traced=first.traced,
                            buffer_pool=False)
        return cache[key]

    step, choice = fit_budget(budget, compile_at, free, base_prefetch=resolved.options.prefetch,
                              max_prefetch=len(resolved.units), fixed=fixed, cost_model=cost_model,
                              hints=lambda leanest: _what_would_fit(budget, leanest, resolved, example_batch),
                              finish=lambda step: with_buffer_pool(step, backend),
                              kept_under=budget_hints.kept_under if budget_hints else None,
                              give_up=budget_hints.give_up if budget_hints else None)
    return attrs.evolve(step, budget=choice)


def runtime_cost_model(backend: Backend) -> CostModel | None:
    """The cost model a step compiled on real ranks searches its memory budget with and keeps its pool's peak
    under: the default (gloo on this CPU; None) on gloo, the nvlink and h100-bf16 presets on NCCL, so that the
    plan searched is the one with NCCL's collective scratch. ``shardlang plan --link nvlink --compute h100-bf16``
    shows the same choice."""
    if backend is Backend.GLOO:
        return None
    return CostModel(link=LINK_PRESETS["nvlink"], compute=COMPUTE_PRESETS["h100-bf16"])


def _link_backend(cost_model) -> str:
    """The backend whose plan (collective scratch) a budget search and a pool read: the cost model's link's."""
    return (cost_model or CostModel()).link.backend  # the budget search's default model when None


def _what_would_fit(budget: int, leanest: CompiledStep, resolved, example_batch) -> list[str]:
    """Ways to fit ``budget`` from the leanest configuration's memory plan: more ranks, a smaller batch, ZeRO-3."""
    memory = leanest.memory
    parts = memory.breakdown
    world = resolved.mesh.size
    hints = []
    sharded = parts["parameters"] + parts["optimizer_state"] + parts["gradient_shards"]
    rest = memory.peak - sharded
    if budget > rest and sharded:
        ranks = math.ceil(world * sharded / (budget - rest))
        hints.append(f"about {ranks} ranks instead of {world} (parameters, optimizer state and gradient shards, "
                     f"{human_bytes(sharded)} of the peak, shrink as 1/N)")
    else:
        hints.append(f"more ranks alone cannot: {human_bytes(rest)} of the peak (activations, gathered units, "
                     "temporaries) does not shrink with them")
    per_batch = parts["activations"] + parts["temporaries"]
    rows = _rows(example_batch)
    if per_batch and rows:
        fraction = (budget - (memory.peak - per_batch)) / per_batch
        if fraction > 0:
            hints.append(f"a per-rank batch of about {max(1, math.floor(rows * fraction))} rows instead of {rows} "
                         f"(activations and temporaries, {human_bytes(per_batch)}, scale with it)")
    if parts.get("reduction_buffers"):
        hints.append(f"Options(keep_reduction_buffers=False): the all-reduce buffers kept between steps are "
                     f"{human_bytes(parts['reduction_buffers'])} of the peak")
    others = sorted({f.unit or "<root>" for f in leanest.flats if f.strategy.value != "zero3" and f.sharded})
    unsharded = sorted({f.unit or "<root>" for f in leanest.flats if not f.params_sharded and f.world > 1})
    if others or unsharded:
        units = sorted(set(others) | set(unsharded))
        hints.append(f"ZeRO-3 for {', '.join(units[:4])}{' ...' if len(units) > 4 else ''} (they keep parameters "
                     "gathered or whole); strategies=[('*', sl.ZeRO3)]")
    return hints


def _rows(batch) -> int:
    leaves = [t for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim() > 0]
    return leaves[0].shape[0] if leaves else 0


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


def _current_context() -> DistContext:
    if not (dist.is_available() and dist.is_initialized()):
        return DistContext.single()
    backend = Backend.parse(dist.get_backend())
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if backend is Backend.NCCL else torch.device("cpu")
    if backend is Backend.NCCL and not torch.cuda.is_available():
        raise ShardlangRuntimeError("the default process group uses NCCL but CUDA is not available")
    return DistContext(rank, dist.get_world_size(), device.index or 0, backend, device)
