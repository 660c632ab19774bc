"""Reduce each flat parameter's gradient, averaged over ranks, as soon as it is complete.

Before: the trace concatenates a trainable flat parameter's member gradients
into one full-size flat gradient (the ``cat`` tagged ``grad_flat``) that the
optimizer reads.
After: right after the last member gradient is produced, the pass packs them
into the reduce layout and issues one collective for the flat parameter:
``reduce_scatter`` when it is sharded (each rank keeps its shard, Note [shard
layout]), ``all_reduce`` when replicated. The ``wait`` and the division by N
come just before the optimizer's first read, so the reduction can overlap the
rest of backward. The optimizer now reads a gradient of the shard's size.

Invariant: each trainable flat parameter has exactly one reduce collective
(kind "reduce_scatter" or "all_reduce") and one "wait_reduce".
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .. import collectives
from ..context import CompileContext
from ..flat import flatten_gradients, pack_gradients
from ..graph_utils import positions, tag
from ..trace import Phase, tag_of


def _underlying_gradient(node: fx.Node) -> fx.Node:
    """Skip the trace's flattening of a gradient, so its reduction can start where backward made it."""
    while tag_of(node, "grad_flat") and len(node.all_input_nodes) == 1:
        node = node.all_input_nodes[0]
    return node


def _pack_dtype(flat) -> torch.dtype | None:
    """The dtype to cast gradients to while packing (mixed precision), None when they already have it."""
    return flat.gradient_reduce_dtype if flat.gradient_reduce_dtype != flat.compute_dtype else None


def reduce_gradients(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    graph = gm.graph
    concatenated = {tag_of(n, "grad_flat"): n for n in graph.nodes
                    if tag_of(n, "grad_flat") and n.target is torch.ops.aten.cat.default}
    for flat in ctx.flats:
        cat = concatenated.get(flat.name)
        if cat is None:
            continue
        grads = [_underlying_gradient(g) for g in cat.args[0]]
        order = positions(graph)
        complete = max(grads, key=order.__getitem__)
        with graph.inserting_before(complete.next):
            if flat.sharded:
                specs = [(m.kind.value, m.dim, m.piece_numel, m.local_shape[m.dim] if m.dim is not None else None,
                          list(m.info.shape)) for m in flat.members]
                packed = graph.call_function(pack_gradients, (flat.world, specs, _pack_dtype(flat), *grads))
                issued = graph.call_function(collectives.reduce_scatter, (packed, flat.axis, flat.world))
                kind = "reduce_scatter"
            else:
                packed = graph.call_function(flatten_gradients, (_pack_dtype(flat), *grads))
                issued = graph.call_function(collectives.all_reduce, (packed, "*", ctx.mesh.size))
                kind = "all_reduce"
            tag(packed, "pack", flat.name, Phase.BACKWARD)
            tag(issued, kind, flat.name, Phase.BACKWARD)
        with graph.inserting_before(cat):
            done = tag(graph.call_function(collectives.wait, (issued,)), "wait_reduce", flat.name, Phase.OPTIMIZER)
            world = flat.world if flat.sharded else ctx.mesh.size
            averaged = tag(graph.call_function(torch.ops.aten.div.Tensor, (done, world)), "average", flat.name,
                           Phase.OPTIMIZER)
            if flat.gradient_reduce_dtype != flat.dtype:  # mixed precision: back to the master dtype
                averaged = tag(graph.call_function(torch.ops.prims.convert_element_type.default,
                                                   (averaged, flat.dtype)), "average", flat.name, Phase.OPTIMIZER)
        cat.replace_all_uses_with(averaged)
    collectives.eliminate_dead_code(graph)
    graph.lint()
    gm.recompile()
    return gm
