"""Localize: the logical step and its `PlacementPlan` -> the graph every rank of the tensor axis runs.

Each call runs on local values with the local arguments its strategy chose
(local sizes for views and expands, local offsets for a flat's members), and
each redistribution the plan records becomes nodes before the call, on the
plan's axis:

    Partial   -> Replicate   all_reduce, wait
    Shard(d)  -> Replicate   all_gather, wait               (d > 0: dim d moved first and back after, copied)
    Replicate -> Shard(d)    local_block(d)                (this rank's block: no communication)
    Replicate -> Partial     local_partial                 (itself on coordinate 0, zeros elsewhere)
    Partial   -> Shard(d)    reduce_scatter, wait          (d > 0: moved and copied as for a gather)
    Shard(d)  -> Shard(e)    all_gather, wait, local_block(e)
    Shard(d)  -> Partial     all_gather, wait, local_partial

A gather (or reduce-scatter) along a dim other than 0 is c10d's along dim 0 of
the tensor with dim d moved first, made contiguous, and moved back after: written here as
nodes, so the memory plan sees the copies the step makes (the analysis reads
the graph that will run).

The result computes, on every rank, that rank's local value of every logical
value, so the loss is the logical loss and each rank's flats hold their local
blocks of the logical update. Its collectives carry `NodeTag`s of kind
ALL_REDUCE / ALL_GATHER with ``detail`` naming the axis and the value, so the
schedule lists them as it lists FSDP's.
"""

from __future__ import annotations

import os

import attrs
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from shardlang.errors import CompileError
from ..ir import collectives
from ..ir.provenance import site_of_node
from ..ir.tags import NodeKind, set_phase, tag
from ..ir.trace import phase_of
from .placements import Packed, Partial, Replicate, Shard
from .propagate import PlacementPlan, Redistribution
from .strategy import tensor_leaves

__all__ = ["localize"]

aten = torch.ops.aten


def localize(graph_module: fx.GraphModule, plan: PlacementPlan) -> fx.GraphModule:
    """The graph each rank of ``plan.axis`` runs: local arguments, and the plan's redistributions as nodes.

    Example: ``local = localize(traced.graph_module, propagate(traced, seeds, "tp", 2))``.
    """
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    before: dict[str, list[Redistribution]] = {}
    for r in plan.redistributions:
        before.setdefault(r.consumer, []).append(r)
    made: dict[tuple[str, object], fx.Node] = {}  # (value, placement) -> its redistributed node, made once
    for node in graph_module.graph.nodes:
        moved = {}
        for r in before.get(node.name, []):
            if (r.arg, r.target) not in made:
                last = next(reversed(graph.nodes))
                made[r.arg, r.target] = _redistribute(graph, env, node, r, plan)
                _in_unit_of(node, last)
            moved[r.arg] = made[r.arg, r.target]
        strategy = plan.strategies.get(node.name)
        args, kwargs = node.args, node.kwargs
        if strategy is not None and strategy.args is not None:
            args = strategy.args
        if strategy is not None and strategy.kwargs is not None:
            kwargs = strategy.kwargs
        if strategy is not None and strategy.lower is not None:
            env[node] = _lowered(graph, node, strategy, fx.node.map_arg(args, lambda a: moved.get(a.name, env[a])),
                                 plan)
            continue
        mapped = graph.node_copy(node, lambda a: moved.get(a.name, env[a]))
        mapped.args = fx.node.map_arg(args, lambda a: moved.get(a.name, env[a]))
        mapped.kwargs = fx.node.map_arg(kwargs, lambda a: moved.get(a.name, env[a]))
        mapped.meta.pop("val", None)  # the logical value's metadata; the local one is another shape
        env[node] = mapped
    local = fx.GraphModule(graph_module, graph)
    local.graph.lint()
    local.recompile()
    _local_values(local, graph_module, plan)
    return local


def _in_unit_of(consumer: fx.Node, last: fx.Node) -> None:
    """The nodes after ``last`` (a redistribution) belong to ``consumer``'s unit, so its recompute can copy them.

    Note [recomputed redistributions]: under recompute, a unit's tp collectives
    run again in its backward, as the region's forward does under torchtitan's
    activation checkpointing; kept instead, each gathered or reduced activation
    would live from forward to backward (at 70B a block's 2 GiB, 80 times over).
    """
    unit = consumer.meta.get("custom", {}).get("unit")
    if unit is None:
        return
    for made in _nodes_after(last):
        made.meta["custom"] = {**made.meta.get("custom", {}), "unit": unit}


def _lowered(graph: fx.Graph, node: fx.Node, strategy, args: tuple, plan: PlacementPlan):
    """The nodes ``strategy.lower`` writes for ``node``, each carrying ``node``'s metadata (phase, source line)."""
    last = next(reversed(graph.nodes))  # the graph's last node before the lowering
    result = strategy.lower(Lowering(graph, node, plan.axis, plan.size), args)
    for made in _nodes_after(last):
        made.meta.update({k: v for k, v in node.meta.items() if k not in ("val", "sl")})
    return result


def _nodes_after(last: fx.Node):
    """The nodes appended to ``last``'s graph after it, in order."""
    made = last.next
    while made.op != "root":
        yield made
        made = made.next


@attrs.frozen
class Lowering:
    """What a strategy's ``lower`` writes with: the graph, and the axis's reductions and coordinate as nodes.

    ``lower(lowering, args)`` gets the call's local arguments and returns the local
    result (a node, or a tuple of nodes for an op of several outputs).
    """

    graph: fx.Graph
    node: fx.Node  # the logical call being lowered
    axis: str
    n: int

    def call(self, target, *args, **kwargs) -> fx.Node:
        return self.graph.call_function(target, args, kwargs)

    def sum(self, x: fx.Node, what: str) -> fx.Node:
        """``x`` summed over the axis (an all-reduce, in the schedule as ``what``)."""
        return _collective(self.graph, collectives.all_reduce, (x, self.axis, self.n), NodeKind.ALL_REDUCE,
                           phase_of(self.node), self._detail(what))

    def max(self, x: fx.Node, what: str) -> fx.Node:
        """``x``'s elementwise max over the axis: every rank's ``x`` gathered, then the max of the ``n``."""
        gathered = _collective(self.graph, collectives.all_gather, (x, self.axis, self.n), NodeKind.ALL_GATHER,
                               phase_of(self.node), self._detail(what))
        return self.call(aten.amax.default, self.call(aten.unflatten.int, gathered, 0, [self.n, -1]), [0])

    def first_row(self, rows: int) -> fx.Node:
        """The first of this rank's block of ``rows`` (a 0-d long): where its block of a split dim starts."""
        device = tensor_leaves(self.node)[0].meta["val"].device  # the call's own (the indices' on a GPU)
        numbers = self.call(aten.arange.default, rows, dtype=torch.long, device=device)
        return self.call(aten.select.int, self.call(collectives.local_block, numbers, 0, self.axis, self.n), 0, 0)

    def _detail(self, what: str) -> str:
        return f"{self.axis}: {what} for {self.node.target}{_at_line(self.node)}"


def _local_values(local: fx.GraphModule, logical: fx.GraphModule, plan: PlacementPlan) -> None:
    """Give every node of ``local`` its fake local value (``meta["val"]``), as the passes expect of a trace."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = []
    with mode:  # fake tensors made in the mode: no storage, whatever the size
        for node in logical.graph.find_nodes(op="placeholder"):
            val = node.meta["val"]
            placement = plan.placements[node.name]
            shape = (plan.flats[placement.flat].local_numel,) if isinstance(placement, Packed) else val.shape
            fake.append(torch.empty(shape, dtype=val.dtype, device=val.device))
    FakeTensorProp(local, mode).propagate_dont_convert_inputs(*fake)


def _redistribute(graph: fx.Graph, env, consumer: fx.Node, r: Redistribution, plan: PlacementPlan) -> fx.Node:
    value = next(a for a in consumer.all_input_nodes if a.name == r.arg)
    x = env[value]
    axis, n, src, dst = plan.axis, plan.size, r.source, r.target
    # no node names: a replicated trace's layers share their template's details (Note [replicated trace])
    detail = f"{axis}: {src!r} -> {dst!r} for {consumer.target}{_at_line(consumer)}"
    phase = phase_of(consumer) or phase_of(value)  # the step's output has no phase: its value's (the loss's)
    if isinstance(src, Partial) and isinstance(dst, Shard):
        return _along(graph, x, dst.dim, phase, lambda v: _collective(
            graph, collectives.reduce_scatter, (v, axis, n), NodeKind.REDUCE_SCATTER, phase, detail))
    if isinstance(src, Partial):
        x = _collective(graph, collectives.all_reduce, (x, axis, n), NodeKind.ALL_REDUCE, phase, detail)
        src = Replicate()
    elif isinstance(src, Shard):
        x = _along(graph, x, src.dim, phase, lambda v: _collective(
            graph, collectives.all_gather, (v, axis, n), NodeKind.ALL_GATHER, phase, detail))
        src = Replicate()
    if not isinstance(src, Replicate):
        raise CompileError(f"{consumer.name}: no redistribution from {r.source!r} to {r.target!r} on {axis!r}")
    if isinstance(dst, Shard):
        x = graph.call_function(collectives.local_block, (x, dst.dim, axis, n))
    elif isinstance(dst, Partial):
        x = graph.call_function(collectives.local_partial, (x, axis, n))
    return x


def _at_line(node: fx.Node) -> str:
    """`` at model.py:12`` for the model line that made ``node``; empty when it is not known."""
    site = site_of_node(node)
    return f" at {os.path.basename(site.file)}:{site.line}" if site is not None and site.file else ""


def _along(graph: fx.Graph, x: fx.Node, dim: int, phase, collective) -> fx.Node:
    """``collective`` (which works along dim 0) applied along ``dim``: that dim moved first and back after."""
    if dim == 0:
        return collective(x)
    x = collective(_copy(graph, graph.call_function(aten.movedim.int, (x, dim, 0)), phase))
    return _copy(graph, graph.call_function(aten.movedim.int, (x, 0, dim)), phase)


def _copy(graph: fx.Graph, moved: fx.Node, phase) -> fx.Node:
    """``moved`` made contiguous (a gather reads and writes whole blocks along dim 0)."""
    copied = graph.call_function(aten.clone.default, (moved,), {"memory_format": torch.contiguous_format})
    if phase is not None:
        set_phase(moved, phase)
        set_phase(copied, phase)
    return copied


def _collective(graph: fx.Graph, target, args, kind: NodeKind, phase, detail: str) -> fx.Node:
    issued = tag(graph.call_function(target, args), kind, None, phase, detail=detail)
    wait_kind = NodeKind.WAIT_GATHER if kind is NodeKind.ALL_GATHER else NodeKind.WAIT_REDUCE
    return tag(graph.call_function(collectives.wait, (issued,)), wait_kind, None, phase, detail=detail)
