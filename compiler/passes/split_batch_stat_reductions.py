"""Turn each traced ``shardlang::all_reduce_sum`` (batch statistics) into an issued all-reduce and its wait.

Before: synchronised BatchNorm (`compiler.ir.sync_batch_norm`) left one custom-op
node per reduction of batch statistics, in forward and in backward.
After: each is ``all_reduce -> wait`` on the abstract collectives, tagged kind
"all_reduce" / "wait_reduce" with no flat parameter, so binding, the schedule
and the verifier treat them like every other collective.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..ir import collectives
from ..context import CompileContext
from ..ir.tags import NodeKind, tag
from ..ir.trace import phase_of
from .contract import GraphProperty, graph_pass


@graph_pass(establishes={GraphProperty.BATCH_STATS_ISSUED})
def split_batch_stat_reductions(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    graph = gm.graph
    nodes = [n for n in graph.nodes if n.target is torch.ops.shardlang.all_reduce_sum.default]
    if not nodes:
        return gm
    for node in nodes:
        x, axis, size = node.args
        phase = phase_of(node)
        with graph.inserting_before(node):
            issued = tag(graph.call_function(collectives.all_reduce, (x, axis, size)), NodeKind.ALL_REDUCE, None, phase,
                         detail="batch statistics")
            done = tag(graph.call_function(collectives.wait, (issued,)), NodeKind.WAIT_REDUCE, None, phase)
        node.replace_all_uses_with(done)
        graph.erase_node(node)
    gm.recompile()
    return gm
