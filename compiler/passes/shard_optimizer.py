"""Run the optimizer update on this rank's shard, in place.

Before: the optimizer nodes (phase "optimizer") update a flat parameter's
placeholder and its state placeholders in place, from the averaged gradient
that `reduce_gradients` produced (clipped by `clip_gradients` when asked).
After: the same nodes, proven to read nothing but the shard, the shard-sized
state, the reduced gradient and 0-d hyperparameters; the placeholders are
re-typed to shard size and every node's shape is re-derived
(`compiler.ir.shapes`). The update is elementwise (`compiler.layout.optim`), so it is
the same code on a shard as on the whole, and in place, so parameters and
optimizer state are never held twice.

Invariant: no optimizer node reads a forward or backward value other than a
reduced gradient; every flat and state placeholder has the local size.
"""

from __future__ import annotations

import torch.fx as fx

from ..context import CompileContext
from shardlang.errors import CompileError
from ..ir.tags import NodeKind, is_inserted, kind_of
from ..ir.shapes import propagate_shapes
from ..ir.trace import Phase, phase_of
from .contract import GraphProperty, graph_pass

_READABLE_KINDS = {NodeKind.WAIT_REDUCE, NodeKind.AVERAGE, NodeKind.CLIP, NodeKind.SKIP}


@graph_pass(requires={GraphProperty.GRADIENTS_REDUCED, GraphProperty.UPDATED_SHARDS_GATHERED},
            establishes={GraphProperty.OPTIMIZER_SHARDED, GraphProperty.SHAPES_PROPAGATED})
def shard_optimizer(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    for node in gm.graph.nodes:
        if phase_of(node) is not Phase.OPTIMIZER or is_inserted(node):
            continue
        for arg in node.all_input_nodes:
            if arg.op == "placeholder" or phase_of(arg) is Phase.OPTIMIZER:
                continue
            if kind_of(arg) in _READABLE_KINDS:
                continue
            raise CompileError(
                f"optimizer node {node.name} ({node.target}) reads {arg.name}, a {phase_of(arg)} value; "
                "the update may read only shards, optimizer state, reduced gradients and hyperparameters"
            )
    return propagate_shapes(gm, ctx)
