"""ZERO1: update this rank's slice of each whole flat parameter, then all-gather the updated slices.

Before: a ZERO1 flat parameter's placeholder is the whole flat parameter
(padded, Note [whole-flat shards] in `compiler.layout.flat`); forward and backward
read views of it, and `reduce_gradients` has reduce-scattered its gradient
to this rank's slice. The optimizer nodes still update the placeholder
itself.
After: a ``local_shard`` node (this rank's slice, a view; placed by
`emit.bind` at the rank's coordinate) stands for the placeholder in every
optimizer node, so the update touches the slice in place and the optimizer
state has the slice's size. Right after the flat parameter's last optimizer
node, an ``all_gather_into`` writes every rank's updated slice back into the
placeholder, in place; its ``wait`` sits at the end of the step, so the
gathers overlap the remaining updates. The next step's forward reads the
updated whole.

Invariant: each trainable ZERO1 flat parameter has one "all_gather" (phase
optimizer, meta ``update``) after its update and one "wait_update" for it;
no optimizer node reads its placeholder except through ``local_shard``.
"""

from __future__ import annotations

import torch.fx as fx

from ..ir import collectives
from ..context import CompileContext
from ..ir.graph_utils import placeholders_by_flat, positions
from ..ir.tags import NodeKind, tag
from shardlang.spec.vocabulary import Strategy
from ..ir.trace import Phase, phase_of, tag_of
from .contract import GraphProperty, graph_pass


@graph_pass(requires={GraphProperty.GRADIENTS_REDUCED, GraphProperty.NONFINITE_SKIPPED},
            establishes={GraphProperty.UPDATED_SHARDS_GATHERED})
def gather_updated_shards(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    flats = [f for f in ctx.flats if f.strategy is Strategy.ZERO1 and f.trainable]
    if not flats:
        return gm
    graph = gm.graph
    placeholders = placeholders_by_flat(graph, ctx.inputs)
    output = next(n for n in graph.nodes if n.op == "output")
    for flat in flats:
        full = placeholders[flat.name]
        updates = [u for u in full.users if phase_of(u) is Phase.OPTIMIZER]
        if not updates:
            continue  # the optimizer does not touch it (no state, zero lr is still an update: never here)
        order = positions(graph)
        first = min(updates, key=order.__getitem__)
        last = max((n for n in graph.nodes if tag_of(n, "flat") == flat.name), key=order.__getitem__)
        with graph.inserting_before(first):
            shard = graph.call_function(collectives.local_shard, (full, flat.axis, flat.world))
            shard.meta["custom"] = {"phase": Phase.OPTIMIZER.value, "flat": flat.name}
        for user in updates:
            user.replace_input_with(full, shard)
        with graph.inserting_after(last):
            issued = tag(graph.call_function(collectives.all_gather_into, (shard, full, flat.axis, flat.world)),
                         NodeKind.ALL_GATHER, flat.name, Phase.OPTIMIZER, update=True)
        with graph.inserting_before(output):
            tag(graph.call_function(collectives.wait, (issued,)), NodeKind.WAIT_UPDATE, flat.name, Phase.OPTIMIZER)
    gm.recompile()
    return gm
