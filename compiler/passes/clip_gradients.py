"""Clip the gradients by their global norm, over every shard, before any optimizer update.

Before: each trainable flat parameter's reduced, averaged gradient (the last
node tagged "average" for it) is read by its optimizer update, and the updates
may run as soon as their own gradient is ready.
After, with ``Training.clip_grad_norm = max_norm``: once the last averaged
gradient exists, each rank sums the squares of every gradient it holds, scaled
so that a value held by several ranks is counted once (Note [norm over
shards]); one all-reduce (kind "all_reduce", no flat parameter, detail
"gradient norm") adds the ranks' sums; then

    total_norm = sqrt(sum)
    clip_coef  = min(max_norm / (total_norm + 1e-6), 1)

exactly as ``torch.nn.utils.clip_grad_norm_``, and every gradient is
multiplied by ``clip_coef`` before its update reads it. Every optimizer update
(and whatever depends on one) moves after the clipping, since no update may
run on an unclipped gradient.

Note [norm over shards] is in `_norm`, which computes the norm (shared with
`skip_nonfinite_updates`; with ``Training.skip_nonfinite`` the all-reduce
carries one float64 per flat parameter, so that a non-finite norm can name them).

The graph then returns ``(loss, total_norm)`` (the norm before clipping, a
float64, as ``clip_grad_norm_`` returns it); `Step` keeps it as ``grad_norm``.

Invariant: every optimizer node that read an averaged gradient reads the
clipped one (kind "clip"), and comes after the norm's wait.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..ir import collectives
from ..context import CompileContext
from ..ir.graph_utils import positions
from ..ir.tags import NodeKind, tag
from ..ir.trace import Phase
from ._norm import global_norm
from ._order import is_update, move_after, optimizer_gradients
from .contract import GraphProperty, graph_pass

_aten = torch.ops.aten
#: torch.nn.utils.clip_grad_norm_'s guard against a zero norm.
EPS = 1e-6


@graph_pass(requires={GraphProperty.GRADIENTS_REDUCED, GraphProperty.MICROBATCHES_ACCUMULATED},
            establishes={GraphProperty.GRADIENTS_CLIPPED})
def clip_gradients(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    max_norm = ctx.training.clip_grad_norm
    if max_norm is None:
        return gm
    graph = gm.graph
    grads = optimizer_gradients(graph)
    if not grads:
        return gm
    order = positions(graph)
    anchor = max(grads.values(), key=order.__getitem__)
    with graph.inserting_before(anchor.next):
        norm, _per_flat = global_norm(graph, ctx, grads, per_flat=ctx.training.skip_nonfinite)
        coef = _clip_coefficient(graph, norm, max_norm)
    clipped = {}
    with graph.inserting_before(coef.next):
        for flat, grad in grads.items():
            readers = [u for u in grad.users if is_update(u)]
            scale = tag(graph.call_function(_aten._to_copy.default, (coef,), {"dtype": ctx.flat(flat).dtype}),
                        NodeKind.CLIP, flat, Phase.OPTIMIZER)
            clipped[flat] = tag(graph.call_function(_aten.mul.Tensor, (grad, scale)), NodeKind.CLIP, flat,
                                Phase.OPTIMIZER)
            for reader in readers:
                reader.replace_input_with(grad, clipped[flat])
    last = max(clipped.values(), key=positions(graph).__getitem__)
    move_after(graph, last, is_update, "gradient clipping")
    output = next(n for n in graph.nodes if n.op == "output")
    output.args = ((output.args[0], norm),)  # the step returns (loss, total_norm), as clip_grad_norm_ returns it
    collectives.eliminate_dead_code(graph)
    gm.recompile()
    return gm


def _clip_coefficient(graph: fx.Graph, norm: fx.Node, max_norm: float) -> fx.Node:
    """Nodes computing ``min(max_norm / (norm + 1e-6), 1)``, as clip_grad_norm_ does."""
    coef = _op(graph, _aten.reciprocal.default, _op(graph, _aten.add.Tensor, norm, EPS))
    coef = _op(graph, _aten.mul.Tensor, coef, max_norm)
    return _op(graph, _aten.clamp_max.default, coef, 1.0)


def _op(graph: fx.Graph, target, *args, **kwargs) -> fx.Node:
    return tag(graph.call_function(target, args, kwargs), NodeKind.CLIP, None, Phase.OPTIMIZER)
