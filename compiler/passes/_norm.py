"""The global gradient norm over every shard, from one all-reduce: shared by clipping and skipping.

Not a pass (no pipeline entry); `clip_gradients` and `skip_nonfinite_updates`
both read the global norm of the reduced gradients, and a step that does both
computes it once.

Note [norm over shards]: a rank holds a 1/world piece of a sharded flat
parameter's gradient (zero padding adds nothing) and the whole gradient of a
replicated one. A piece is held by ``mesh.size / flat.world`` ranks (1 for a
sharded flat on a 1-D mesh; every rank for a replicated one; the replicas on a
hybrid mesh), so each rank's sum of squares for a flat is multiplied by
``flat.world / mesh.size`` before the all-reduce: every value then counts once.
With a tensor axis of ``tp`` ranks the sums are then all-reduced over it too; a
flat replicated over it (no member split there: flats never mix the two,
`build_flat_params`) is the same on every tensor rank, so it counts ``1/tp``.
Frozen parameters have no gradient and count for nothing, as in torch.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..context import CompileContext
from ..layout.placement import WORLD
from ..ir.tags import NodeKind, node_tag, tag
from ..ir.trace import Phase
from ..ir import collectives

_aten = torch.ops.aten


def global_norm(graph: fx.Graph, ctx: CompileContext, grads: dict[str, fx.Node],
                per_flat: bool) -> tuple[fx.Node, fx.Node | None]:
    """Nodes (inserted where the graph's insertion point is) for the global norm, a float64 0-d tensor.

    With ``per_flat``, the all-reduce carries one float64 per flat parameter (the
    squared norm of each flat's gradient, in ``grads`` order) instead of their sum,
    and that vector is returned too: a non-finite norm can then name the flats.
    The all-reduce is tagged "all_reduce", detail "gradient norm"; the norm node
    carries ``norm=True`` in its tag, so a later pass finds it (`find_norm`), and
    ``flats``: the flat parameters of the vector's entries, in order.
    """
    locals_ = []
    for name, grad in grads.items():
        flat = ctx.flat(name)
        square = _op(graph, _aten.mul.Tensor, grad, grad)
        local = _op(graph, _aten.sum.dim_IntList, square, [0], False, dtype=torch.float64)
        share = flat.world / ctx.mesh.size if flat.sharded else 1 / ctx.mesh.size  # Note [norm over shards]
        tensor = ctx.config.tensor
        if tensor is not None and not flat.tensor_sharded:
            share /= tensor.size
        if share != 1:
            local = _op(graph, _aten.mul.Tensor, local, share)
        locals_.append(local)
    if per_flat:
        buffer = _op(graph, _aten.stack.default, locals_)
    else:
        total = locals_[0]
        for local in locals_[1:]:
            total = _op(graph, _aten.add.Tensor, total, local)
        buffer = _op(graph, _aten.view.default, total, [1])
    issued = tag(graph.call_function(collectives.all_reduce, (buffer, WORLD, ctx.mesh.size)), NodeKind.ALL_REDUCE, None,
                 Phase.OPTIMIZER, detail="gradient norm")
    summed = tag(graph.call_function(collectives.wait, (issued,)), NodeKind.WAIT_REDUCE, None, Phase.OPTIMIZER)
    if ctx.config.tensor is not None:  # and over the tensor axis, whose ranks hold other blocks
        axis = ctx.config.tensor
        issued = tag(graph.call_function(collectives.all_reduce, (summed, axis.name, axis.size)), NodeKind.ALL_REDUCE,
                     None, Phase.OPTIMIZER, detail=f"gradient norm over {axis.name}")
        summed = tag(graph.call_function(collectives.wait, (issued,)), NodeKind.WAIT_REDUCE, None, Phase.OPTIMIZER)
    total = _op(graph, _aten.sum.default, summed) if per_flat else _op(graph, _aten.view.default, summed, [])
    norm = tag(graph.call_function(_aten.sqrt.default, (total,)), NodeKind.CLIP, None, Phase.OPTIMIZER, norm=True,
               flats=tuple(grads) if per_flat else ())
    return norm, (summed if per_flat else None)


def find_norm(graph: fx.Graph) -> tuple[fx.Node | None, fx.Node | None]:
    """The norm node `global_norm` made, and its per-flat vector (None when it made none)."""
    for node in graph.nodes:
        if (t := node_tag(node)) is not None and t.norm:
            vector = node.args[0].args[0] if node.args[0].target is _aten.sum.default else None
            return node, vector
    return None, None


def norm_flat_order(graph: fx.Graph) -> tuple[str, ...]:
    """The flat parameters of the per-flat squared-norm vector `global_norm` reduced, in its order; () if none."""
    norm, _ = find_norm(graph)
    return node_tag(norm).flats if norm is not None else ()


def _op(graph: fx.Graph, target, *args, **kwargs) -> fx.Node:
    return tag(graph.call_function(target, args, kwargs), NodeKind.CLIP, None, Phase.OPTIMIZER)
