"""Reduce a buffer made for its reduction alone in place, and average a reduction's own result in place.

Note [reductions in place]: ``_c10d_functional.all_reduce`` clones its input
and reduces the clone: one more pass over the whole gradient and a buffer as
large. A buffer that `flat.flatten_gradients` concatenated (or cast) for this
reduction is read by nothing else, so it can be reduced in place. Likewise the
average divides the result of its reduction when nothing else reads that
result. The values are the same to the bit.

Before: every reduction over more than one rank is ``collectives.all_reduce``
(or ``reduce_scatter``) on its packed gradient, then ``wait``, then the average
``div``, each value in a buffer of its own.

After: where the all-reduce's input is a new flat buffer (several gradients
concatenated, or a cast; one gradient flattened is a view of it, not a buffer
of its own), the all-reduce is ``collectives.all_reduce_``, which returns its
input; where an average alone reads the wait of a reduction over more than one
rank that nothing else reads, it is ``div_``. Their ``meta["val"]`` share the
storage they are made in, so the schedule, the memory plan and the verifier
read what the bound step does, and `emit.bind` only swaps in process groups.
A world of one is left alone: its collectives are identities and its average a
view (`reduce_gradients`).

Example: for ``pack -> all_reduce -> wait -> div`` over two ranks, the pass
leaves ``pack -> all_reduce_ -> wait -> div_``, all four one storage.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..ir import collectives
from ..ir.tags import NodeKind, kind_of
from ..layout.flat import is_new_flat_buffer
from ..context import CompileContext
from .contract import GraphProperty, graph_pass

_aten = torch.ops.aten


@graph_pass(requires={GraphProperty.GRADIENTS_REDUCED, GraphProperty.OPTIMIZER_SHARDED,
                      GraphProperty.REDUCTION_BUFFERS_KEPT},
            establishes={GraphProperty.REDUCTIONS_IN_PLACE})
def reduce_in_place(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    made = made_in_place(gm.graph)
    for node in gm.graph.nodes:  # in graph order: a value's source is rewritten before it
        source = made.get(node)
        if source is None:
            continue
        if node.target is collectives.all_reduce:
            node.target = collectives.all_reduce_
        elif node.target is _aten.div.Tensor:
            node.target = _aten.div_.Tensor
        node.meta["val"] = source.meta["val"]
    gm.recompile()
    return gm


def made_in_place(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """The nodes whose values are made in another node's storage, each mapped to that node.

    An all-reduce maps to its pack, a wait to its issue, an average to the wait it divides.
    """
    made: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if node.target is collectives.all_reduce and collectives.over_ranks(node) and is_new_flat_buffer(node.args[0]):
            made[node] = node.args[0]
        elif node.target is collectives.wait and node.args[0] in made:
            made[node] = node.args[0]
        elif _divides_its_reduction(node):
            made[node] = node.args[0]
    return made


def _divides_its_reduction(node: fx.Node) -> bool:
    """Whether ``node`` is an average that alone reads the wait of a reduction over more than one rank."""
    if node.target is not _aten.div.Tensor or kind_of(node) is not NodeKind.AVERAGE:
        return False
    wait = node.args[0]
    if not isinstance(wait, fx.Node) or wait.target is not collectives.wait or len(wait.users) != 1:
        return False
    issue = wait.args[0]
    return (issue.target in (collectives.all_reduce, collectives.reduce_scatter) and collectives.over_ranks(issue)
            and len(issue.users) == 1)
