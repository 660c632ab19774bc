"""Skip the optimizer update of a step whose global gradient norm is not finite, inside the step.

Before: every optimizer update mutates its state in place (the flat parameter
or its ``local_shard``, the optimizer state, the step count), each chain of
in-place ops starting at a graph input; `clip_gradients` may have computed the
global norm (its tag carries ``norm=True``).
After, with ``Training.skip_nonfinite``: the global norm exists, from one
all-reduce of one float64 per flat parameter (`_norm.global_norm`), so every
rank reads the same reduced values and takes the same decision; then
``finite = isfinite(norm)``, and Note [skip by select]: each chain of in-place
updates of a graph input ``x`` runs out of place, and its end is written back
as ``x.copy_(where(finite, new, x))``. A step with an inf or nan gradient
leaves every parameter, moment and the step count as they were, as
``torch.amp.GradScaler`` skips ``optimizer.step()``. The graph returns
``(loss, norm, squared norm per flat)``; `Step` counts the skipped steps.

Note [skip by select]: the select costs one elementwise pass per state tensor
and a temporary per chain op (the update no longer runs in place), and no
control flow: the graph stays one straight line of ops, the same on every rank.

Invariant: every mutation of a graph input in the optimizer phase is a
``copy_`` whose source is a ``where`` on the finite flag, after the norm's wait.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..ir import collectives
from ..context import CompileContext
from shardlang.errors import CompileError
from ..ir.graph_utils import positions
from ..ir.tags import NodeKind, tag
from ..ir.trace import Phase, phase_of
from ._norm import find_norm, global_norm
from ._order import is_update, move_after, optimizer_gradients
from .contract import GraphProperty, graph_pass

_aten = torch.ops.aten


@graph_pass(requires={GraphProperty.GRADIENTS_REDUCED, GraphProperty.GRADIENTS_CLIPPED},
            establishes={GraphProperty.NONFINITE_SKIPPED})
def skip_nonfinite_updates(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    if not ctx.training.skip_nonfinite:
        return gm
    graph = gm.graph
    grads = optimizer_gradients(graph)
    if not grads:
        return gm
    output = next(n for n in graph.nodes if n.op == "output")
    norm, per_flat = find_norm(graph)
    if norm is None:
        order = positions(graph)
        anchor = max(grads.values(), key=order.__getitem__)
        with graph.inserting_before(anchor.next):
            norm, per_flat = global_norm(graph, ctx, grads, per_flat=True)
        output.args = ((output.args[0], norm),)
    with graph.inserting_after(norm):
        finite = tag(graph.call_function(_aten.isfinite.default, (norm,)), NodeKind.SKIP, None, Phase.OPTIMIZER)
    move_after(graph, finite, is_update, "skipping non-finite updates")
    for root, chain in _update_chains(graph):
        _select(graph, root, chain, finite)
    loss, norm_out = output.args[0]
    output.args = ((loss, norm_out, per_flat),)
    collectives.eliminate_dead_code(graph)
    gm.recompile()
    return gm


def _update_chains(graph: fx.Graph) -> list[tuple[fx.Node, list[fx.Node]]]:
    """Each graph input the optimizer mutates, with its chain of in-place update nodes in order."""
    chains: dict[fx.Node, list[fx.Node]] = {}
    root_of: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if not (is_update(node) and _mutates(node) and isinstance(node.args[0], fx.Node)):
            continue
        target = node.args[0]
        root = target if target.op == "placeholder" or _is_local_shard(target) else root_of.get(target)
        if root is None:
            continue  # a temporary updated in place: not state
        chains.setdefault(root, []).append(node)
        root_of[node] = root
    return list(chains.items())


def _select(graph: fx.Graph, root: fx.Node, chain: list[fx.Node], finite: fx.Node) -> None:
    """Note [skip by select]: the chain runs out of place; ``root.copy_(where(finite, end, root))`` after it."""
    for node in chain:
        node.target = _out_of_place(node)
    last = chain[-1]
    with graph.inserting_after(last):
        chosen = graph.call_function(_aten.where.self, (finite, last, root))
    with graph.inserting_after(chosen):
        written = graph.call_function(_aten.copy_.default, (root, chosen))
    for new in (chosen, written):
        new.meta["custom"] = dict(last.meta.get("custom", {}))
        if "val" in last.meta:
            new.meta["val"] = last.meta["val"]


def _mutates(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and schema.is_mutable and phase_of(node) is Phase.OPTIMIZER


def _is_local_shard(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is collectives.local_shard


def _out_of_place(node: fx.Node):
    """``aten.mul_.Tensor`` -> ``aten.mul.Tensor``, and so on; a CompileError names an op without one."""
    packet = node.target.overloadpacket.__name__
    overload = node.target._overloadname
    functional = getattr(getattr(_aten, packet.rstrip("_"), None), overload, None)
    if not packet.endswith("_") or functional is None:
        raise CompileError(f"skip_nonfinite: the optimizer update {node.name} ({node.target}) has no out-of-place "
                           "form to select from; use an optimizer written with in-place aten ops that have one")
    return functional
