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

Note [norm over shards]: a rank holds a 1/world piece of a sharded flat
parameter's gradient (zero padding adds nothing) and the whole gradient of a
replicated one. A piece is held by ``mesh.size / flat.world`` ranks (1 for a
sharded flat on a 1-D mesh; every rank for a replicated one; the replicas on a
hybrid mesh), so each rank's sum of squares for a flat is multiplied by
``flat.world / mesh.size`` before the all-reduce: every value then counts once.
Frozen parameters have no gradient and count for nothing, as in torch.

The graph then returns ``(loss, total_norm)`` (the norm before clipping, a
float64, as ``clip_grad_norm_`` returns it); `Step` keeps it as ``grad_norm``.

Invariant: every optimizer node that read an averaged gradient reads the
clipped one (kind "clip"), and comes after the norm's wait.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .. import collectives
from ..context import CompileContext
from ..graph_utils import positions, tag
from ..emit import WORLD_AXIS as WORLD
from ..trace import Phase
from ._order import is_update, move_after, optimizer_gradients

_aten = torch.ops.aten
#: torch.nn.utils.clip_grad_norm_'s guard against a zero norm.
EPS = 1e-6


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
        norm, coef = _clip_coefficient(graph, ctx, grads, max_norm)
    clipped = {}
    with graph.inserting_before(coef.next):
        for flat, grad in grads.items():
            readers = [u for u in grad.users if is_update(u)]
            scale = tag(graph.call_function(_aten._to_copy.default, (coef,), {"dtype": ctx.flat(flat).dtype}),
                        "clip", flat, Phase.OPTIMIZER)
            clipped[flat] = tag(graph.call_function(_aten.mul.Tensor, (grad, scale)), "clip", flat, Phase.OPTIMIZER)
            for reader in readers:
                reader.replace_input_with(grad, clipped[flat])
    last = max(clipped.values(), key=positions(graph).__getitem__)
    move_after(graph, last, is_update, "gradient clipping")
    output = next(n for n in graph.nodes if n.op == "output")
    output.args = ((output.args[0], norm),)  # the step returns (loss, total_norm), as clip_grad_norm_ returns it
    collectives.eliminate_dead_code(graph)
    graph.lint()
    gm.recompile()
    return gm


def _clip_coefficient(graph: fx.Graph, ctx: CompileContext, grads: dict[str, fx.Node],
                      max_norm: float) -> tuple[fx.Node, fx.Node]:
    """Nodes computing the global norm and ``min(max_norm / (norm + 1e-6), 1)``; the norm is all-reduced."""
    total = None
    for name, grad in grads.items():
        flat = ctx.flat(name)
        square = _op(graph, _aten.mul.Tensor, grad, grad)
        local = _op(graph, _aten.sum.dim_IntList, square, [0], False, dtype=torch.float64)
        share = flat.world / ctx.mesh.size if flat.sharded else 1 / ctx.mesh.size  # Note [norm over shards]
        if share != 1:
            local = _op(graph, _aten.mul.Tensor, local, share)
        total = local if total is None else _op(graph, _aten.add.Tensor, total, local)
    buffer = _op(graph, _aten.view.default, total, [1])
    issued = tag(graph.call_function(collectives.all_reduce, (buffer, WORLD, ctx.mesh.size)), "all_reduce", None,
                 Phase.OPTIMIZER, detail="gradient norm")
    summed = tag(graph.call_function(collectives.wait, (issued,)), "wait_reduce", None, Phase.OPTIMIZER)
    norm = _op(graph, _aten.sqrt.default, _op(graph, _aten.view.default, summed, []))
    coef = _op(graph, _aten.reciprocal.default, _op(graph, _aten.add.Tensor, norm, EPS))
    coef = _op(graph, _aten.mul.Tensor, coef, max_norm)
    return norm, _op(graph, _aten.clamp_max.default, coef, 1.0)


def _op(graph: fx.Graph, target, *args, **kwargs) -> fx.Node:
    return tag(graph.call_function(target, args, kwargs), "clip", None, Phase.OPTIMIZER)
