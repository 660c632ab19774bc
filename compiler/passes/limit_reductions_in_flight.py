"""Wait for each gradient reduction before the next one is issued: one in flight at a time.

Before: `reduce_gradients` issues each flat parameter's reduction as soon as
its gradient is complete and waits for it just before the optimizer reads it,
at the end of backward. Every reduction is then in flight at once, and an
in-flight reduction holds its whole packed gradient (``N * S`` elements, plus
gloo's own copy): at the end of backward the rank holds the full model's
gradients, which is what sharding was meant to avoid.
After: the wait of each reduction moves to just before the next reduction is
issued, as FSDP2 waits for the previous reduce-scatter when it issues the
next. A reduction still overlaps the backward compute between its gradient
and the next unit's, and at most one packed gradient is alive at a time.

Invariant: between any two gradient reductions, the earlier one is waited for.
"""

from __future__ import annotations

import torch.fx as fx

from ..context import CompileContext
from ..ir.graph_utils import positions
from ..ir.tags import NodeKind, kind_of, node_tag
from .contract import GraphProperty, graph_pass

_REDUCTIONS = (NodeKind.REDUCE_SCATTER, NodeKind.ALL_REDUCE)


@graph_pass(requires={GraphProperty.GRADIENTS_REDUCED, GraphProperty.MICROBATCHES_ACCUMULATED},
            establishes={GraphProperty.REDUCTIONS_LIMITED})
def limit_reductions_in_flight(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    graph = gm.graph
    issues = [n for n in graph.nodes if kind_of(n) in _REDUCTIONS and node_tag(n).flat is not None]
    waits = {n.args[0]: n for n in graph.nodes if kind_of(n) is NodeKind.WAIT_REDUCE and n.args}
    for issued, following in zip(issues, issues[1:]):
        wait = waits.get(issued)
        if wait is None:
            continue
        order = positions(graph)
        if order[wait] > order[following]:
            following.prepend(wait)
    gm.recompile()
    return gm
