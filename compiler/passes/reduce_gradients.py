"""Reduce each flat parameter's gradient, averaged over ranks, as soon as it is complete.

Before: the trace concatenates a trainable flat parameter's member gradients
into one full-size flat gradient (the ``cat`` tagged ``grad_flat``) that the
optimizer reads.
After: right after the last member gradient is produced, the pass packs them
into the reduce layout and issues one collective for the flat parameter:
``reduce_scatter`` when it is sharded (each rank keeps its shard, Note [shard
layout]), ``all_reduce`` when replicated. In the whole layout (ZERO1, and a
unit sharded flat) the packed gradient is the whole flat gradient, padded
(Note [whole-flat shards]). On a mesh with
more than one axis a sharded gradient's shard is then all-reduced across the
other axes (Note [hybrid reduction]). Every gradient is divided by the whole
world, so it is the mean over every rank's batch (in a world of one, the
"average" is a view: nothing to divide). The ``wait`` and the
division come just before the optimizer's first read, so the reduction can overlap the
rest of backward. The optimizer now reads a gradient of the shard's size.

Invariant: each trainable flat parameter's gradient is summed over every rank
exactly once: one "reduce_scatter" over its axis and, on a hybrid mesh, one
"all_reduce" over the other axes; or one "all_reduce" over every rank when
replicated. Each reduce collective has one "wait_reduce".
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..ir import collectives
from ..context import CompileContext
from ..layout.flat import flatten_gradients, pack_gradients, pack_whole_gradients
from ..ir.graph_utils import positions
from ..ir.tags import NodeKind, kind_of, set_phase, tag
from ..layout.placement import WORLD
from ..ir.trace import Phase, tag_of
from .contract import GraphProperty, graph_pass


def _underlying_gradient(node: fx.Node) -> fx.Node:
    """Skip the trace's flattening of a gradient, so its reduction can start where backward made it."""
    while tag_of(node, "grad_flat") and len(node.all_input_nodes) == 1:
        node = node.all_input_nodes[0]
    return node


def _pack_dtype(flat) -> torch.dtype | None:
    """The dtype to cast gradients to while packing (mixed precision), None when they already have it."""
    return flat.gradient_reduce_dtype if flat.gradient_reduce_dtype != flat.compute_dtype else None


@graph_pass(establishes={GraphProperty.GRADIENTS_REDUCED})
def reduce_gradients(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    graph = gm.graph
    concatenated = {tag_of(n, "grad_flat"): n for n in graph.nodes
                    if tag_of(n, "grad_flat") and n.target is torch.ops.aten.cat.default}
    across: list[tuple[fx.Node, fx.Node]] = []  # hybrid: (reduce-scatter wait, all-reduce issue), placed below
    for flat in ctx.flats:
        cat = concatenated.get(flat.name)
        if cat is None:
            continue
        grads = [_underlying_gradient(g) for g in cat.args[0]]
        order = positions(graph)
        complete = max(grads, key=order.__getitem__)
        with graph.inserting_before(complete.next):
            if flat.params_sharded and not flat.whole_layout:
                specs = [(m.kind.value, m.dim, m.piece_numel, m.local_shape[m.dim] if m.dim is not None else None,
                          list(m.info.shape)) for m in flat.members]
                packed = graph.call_function(pack_gradients, (flat.world, specs, _pack_dtype(flat), *grads))
            elif flat.sharded:  # the whole flat gradient, padded (Note [whole-flat shards])
                packed = graph.call_function(pack_whole_gradients, (flat.padded_numel, _pack_dtype(flat), *grads))
            else:
                packed = graph.call_function(flatten_gradients, (_pack_dtype(flat), *grads))
            if flat.sharded:
                issued = graph.call_function(collectives.reduce_scatter, (packed, flat.axis, flat.world))
                kind = NodeKind.REDUCE_SCATTER
            else:
                issued = graph.call_function(collectives.all_reduce, (packed, WORLD, ctx.mesh.size))
                kind = NodeKind.ALL_REDUCE
            tag(packed, NodeKind.PACK, flat.name, Phase.BACKWARD)
            tag(issued, kind, flat.name, Phase.BACKWARD)
        replicas = ctx.mesh.complement(flat.axis) if flat.sharded else ""
        with graph.inserting_before(cat):
            done = tag(graph.call_function(collectives.wait, (issued,)), NodeKind.WAIT_REDUCE, flat.name,
                       Phase.OPTIMIZER)
            if replicas and ctx.mesh.group_size(replicas) > 1:  # Note [hybrid reduction]
                summed = graph.call_function(collectives.all_reduce, (done, replicas, ctx.mesh.group_size(replicas)))
                tag(summed, NodeKind.ALL_REDUCE, flat.name, Phase.OPTIMIZER)
                across.append((done, summed))
                done = tag(graph.call_function(collectives.wait, (summed,)), NodeKind.WAIT_REDUCE, flat.name,
                           Phase.OPTIMIZER)
            # x / 1 is x to the bit: a world of one skips the pass over every gradient (a view instead).
            average = (torch.ops.aten.div.Tensor, (done, ctx.mesh.size)) if ctx.mesh.size > 1 else \
                (torch.ops.aten.alias.default, (done,))
            averaged = tag(graph.call_function(*average), NodeKind.AVERAGE, flat.name, Phase.OPTIMIZER)
            if flat.gradient_reduce_dtype != flat.dtype:  # mixed precision: back to the master dtype
                averaged = tag(graph.call_function(torch.ops.prims.convert_element_type.default,
                                                   (averaged, flat.dtype)), NodeKind.AVERAGE, flat.name,
                               Phase.OPTIMIZER)
        cat.replace_all_uses_with(averaged)
    _overlap_hybrid_reductions(graph, across)
    collectives.eliminate_dead_code(graph)
    gm.recompile()
    return gm


def _overlap_hybrid_reductions(graph: fx.Graph, across: list[tuple[fx.Node, fx.Node]]) -> None:
    """Move each reduce-scatter's wait, with the all-reduce it feeds, up to just before the next reduction's pack.

    Note [hybrid reduction]: on a ``replicate x shard`` mesh a sharded gradient
    is reduce-scattered within its shard group, then its shard is all-reduced
    across the groups that hold the same shard, then divided by the whole
    world. The all-reduce cannot start before the reduce-scatter is done, so
    its wait and the all-reduce's issue go where the next flat parameter's
    reduction begins (one unit of backward later); the last ones stay where
    the optimizer phase begins.
    """
    if not across:
        return
    order = positions(graph)
    packs = sorted((n for n in graph.nodes if kind_of(n) is NodeKind.PACK), key=order.__getitem__)
    for rs_wait, ar_issue in across:
        issue_at = order[rs_wait.args[0]]
        later = [p for p in packs if order[p] > issue_at]
        if not later or order[later[0]] > order[rs_wait]:
            continue
        later[0].prepend(rs_wait)
        rs_wait.append(ar_issue)
        set_phase(rs_wait, Phase.BACKWARD)
        set_phase(ar_issue, Phase.BACKWARD)
