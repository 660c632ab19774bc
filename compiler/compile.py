"""The compiler's front door: model + placements -> compiled graph and schedule.

    trace (compiler.ir.trace) -> annotate (compiler.layout.flat) -> passes (compiler.passes.pipeline)
      -> schedule (compiler.schedule.schedule, checked by compiler.schedule.verify)

Binding to process groups (`compiler.lower.emit`) is left to the caller, so the same
`CompiledStep` serves planning (no processes) and running.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import attrs
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from .collection import collection_paused
from .config import StepConfig
from shardlang.spec.vocabulary import StepBackend
from .ir.lazy_code import graph_module
from .ir.replicate import trace_step_replicated
from .ir.shapes import drop_shape_memo, remember_shapes, shape_memo
from .ir.tags import verify_tags
from .ir.trace import TensorShape, TracedStep, trace_step
from .layout.flat import FlatParam
from .layout.optim import GroupedOptimizer
from .context import CompileContext
from .analysis.memory import backend_scratch, gloo_scratch, plan_memory
from .analysis.pool_choice import slots_within_peak
from .passes.assign_buffers import assign_buffers, assign_slots, candidate_lives, pools_buffers
from .passes.contract import GraphProperty
from .placement.step import tensor_parallel_step
from .passes.pipeline import DEFAULT_PASSES, run_passes
from .schedule.schedule import Schedule, read_schedule
from .schedule.verify import verify, verify_structure
from .trace_cache import TraceCache, trace_key


@attrs.frozen
class CompiledStep:
    """A compiled (unbound) training step: its graph, its context and its schedule."""

    graph_module: fx.GraphModule
    context: CompileContext
    schedule: Schedule
    traced: TracedStep
    budget: object = None  # `compiler.analysis.budget.BudgetChoice`, when Options.memory_budget chose the options

    @property
    def flats(self) -> tuple[FlatParam, ...]:
        return self.context.flats

    @functools.cached_property
    def memory(self):
        """The static memory plan (`compiler.analysis.memory.MemoryPlan`) with the default collective scratch.

        Planned on first access and kept: the graph and schedule it reads do not change after compile.
        """
        return plan_memory(self.graph_module, self.schedule, self.context.inputs)

    def memory_on(self, backend: str):
        """The memory plan with the collective scratch of ``backend``'s links (Note [collective scratch]):
        ``memory`` for "gloo", none for NCCL. Planned once per backend and kept, as ``memory`` is."""
        scratch = backend_scratch(backend)
        if scratch is gloo_scratch:
            return self.memory
        if backend not in self._plans_on:
            self._plans_on[backend] = plan_memory(self.graph_module, self.schedule, self.context.inputs,
                                                  scratch=scratch)
        return self._plans_on[backend]

    @functools.cached_property
    def _plans_on(self) -> dict:
        return {}

    @property
    def timeline(self):
        """The predicted timeline (`compiler.analysis.cost.Timeline`) under the default `CostModel` (gloo, CPU)."""
        from .analysis.cost import CostModel

        return CostModel(fused=self.context.backend is StepBackend.INDUCTOR).predict(self.schedule, self.graph_module)


@collection_paused
def compile_step(model: torch.nn.Module, loss_fn: Callable, config: StepConfig, optimizer, example_batch, *,
                 passes=DEFAULT_PASSES, check_each_pass: bool = False, dump_dir=None,
                 traced: TracedStep | None = None, buffers: Mapping[str, TensorShape] | None = None,
                 tied: Mapping[str, str] | None = None, buffer_pool: bool = True,
                 traces: TraceCache | None = None) -> CompiledStep:
    """Trace and compile one training step of ``model`` for ``config`` (`compiler.config.StepConfig`).

    ``example_batch`` is a per-rank batch (its shapes are compiled in). With
    ``check_each_pass`` the schedule verifier also runs after every pass
    (structural checks only; the final schedule is always verified).
    ``traced``, the ``traced`` of an earlier `CompiledStep` of the same model,
    batch and placements, skips tracing: the passes run on a copy of its graph
    (the memory budget's search compiles one trace under many `Scheduling`
    records this way). ``buffers`` stands in for the module's buffers when it
    holds no storage, and ``tied`` for its tied parameters (`trace_step`).
    ``buffer_pool=False`` leaves the step's pool out (`with_buffer_pool` adds
    it later): the budget's search compares schedules without it (Note [pool
    after the search] in `compiler.analysis.budget`). ``traces`` (a
    `compiler.trace_cache.TraceCache`) serves, without ``traced``, the trace of
    an earlier configuration that traces the same step (Note [shared traces]).
    """
    flats = config.flats()
    grouped = GroupedOptimizer.build(optimizer, config.training.group_overrides)
    if traced is None:
        logical = config.logical_flats(flats)  # Note [tp-local flats]

        def trace() -> TracedStep:
            return _trace(model, loss_fn, config, logical, grouped, example_batch, buffers, tied)

        traced = trace() if traces is None else traces.traced(
            trace_key(model, loss_fn, config, logical, optimizer, example_batch, buffers, tied), model, trace)
    ctx = CompileContext(config, flats, traced.inputs)
    check = structural_check if check_each_pass else None
    gm = copy_graph_module(traced.graph_module)
    # Note [incremental shapes], Note [shape memo]: shape propagation re-runs only what changed, once per trace
    remember_shapes(gm, shape_memo(traced.graph_module))
    gm = drop_shape_memo(run_passes(gm, ctx, passes, check=check, dump_dir=dump_dir))
    schedule = read_schedule(gm, ctx)
    verify(schedule)
    compiled = CompiledStep(gm, ctx, schedule, traced)
    return with_buffer_pool(compiled) if buffer_pool else compiled


def _trace(model, loss_fn, config: StepConfig, logical, optimizer, example_batch, buffers, tied) -> TracedStep:
    """The traced logical step of ``config`` over its ``logical`` flats, localized to a tensor axis where it has one."""
    local = None if config.tensor is None else functools.partial(tensor_parallel_step, axis=config.tensor)
    traced_as = dict(data_parallel_size=config.mesh.size, training=config.training, buffers=buffers, tied=tied)
    if _is_fake(model):  # Note [replicated trace]: planning; a tensor axis localizes the short traces
        traced = trace_step_replicated(model, loss_fn, logical, optimizer, example_batch, then=local, **traced_as)
    else:
        traced = trace_step(model, loss_fn, logical, optimizer, example_batch, **traced_as)
        traced = traced if local is None else local(traced)
    return attrs.evolve(traced, graph_module=copy_graph_module(traced.graph_module))  # kept as traced


def with_buffer_pool(compiled: CompiledStep, backend: str = "gloo") -> CompiledStep:
    """``compiled`` with the slots of the step's pool that do not raise its planned peak (Note [buffer
    assignment], `analysis.pool_choice`); ``compiled`` as it is when there are none.

    ``backend``: the links whose plan's peak the pool keeps (`CompiledStep.memory_on`); gloo's by
    default, the step's own ``memory``.
    """
    ctx = compiled.context
    if not pools_buffers(ctx):
        return compiled
    lives = candidate_lives(compiled.graph_module.graph)
    slots = assign_slots(lives)
    held = slots_within_peak(lives, slots, compiled.memory_on(backend)) if lives else set()
    chosen = {node.name: index for node, index in slots.items() if index in held}  # a copy keeps the names
    if not chosen:
        return compiled
    memo = shape_memo(compiled.traced.graph_module)
    pooled_gm = drop_shape_memo(assign_buffers(copy_graph_module(compiled.graph_module), ctx, chosen, memo))
    schedule = read_schedule(pooled_gm, ctx)
    verify(schedule)
    return attrs.evolve(compiled, graph_module=pooled_gm, schedule=schedule)


def _is_fake(model: torch.nn.Module) -> bool:
    """Whether the model's parameters are fake tensors (`shardlang.plan`): only the plan is wanted."""
    params = list(model.parameters())
    return bool(params) and all(isinstance(p, FakeTensor) for p in params)


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule over a copy of ``gm``'s graph: new nodes, each with a shallow copy of its meta.

    Its code is written when first read or run (Note [lazy code] in `compiler.ir.lazy_code`).

    Passes replace meta entries rather than mutate them, so the copy can be
    compiled while ``gm`` stays as it was.
    """
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return graph_module(gm, graph)


def structural_check(gm: fx.GraphModule, ctx: CompileContext, established: frozenset[GraphProperty]) -> None:
    """After each pass: the graph is well formed, its tags are sound, its gathers are waited for and freed.

    Gathers are freed once `reshard_after_forward` ran; between `gather_parameters` and it, they are not yet.
    """
    gm.graph.lint()
    verify_tags(gm.graph, (f.name for f in ctx.flats))
    gathered_unfreed = (GraphProperty.PARAMETERS_GATHERED in established
                        and GraphProperty.GATHERS_FREED not in established)
    verify_structure(read_schedule(gm, ctx), frees_placed=not gathered_unfreed)
