"""Run k micro-batches per optimizer step, each with its own gathers, frees and reductions.

Before (``Options(microbatches=k, accumulation="per_microbatch")``): the trace
ran the first micro-batch only (Note [micro-batches] in `compiler.ir.trace`): its
batch leaves are rows ``[0, b)`` of the per-rank batch (slices tagged
``microbatch_rows``), its loss is already divided by k, and the passes before
this one gave it every gather, free, re-gather, reduction, wait and average a
step needs.
After: that micro-batch region (every forward and backward node, and what the
gradients the optimizer reads and the loss are made of) is repeated for
micro-batches 1..k-1, each copy reading rows ``[i*b, (i+1)*b)``; after copy i,
each rank adds the copy's averaged gradient shard into a running sum (kind
"average", shard-sized), and the loss into the step's loss. The optimizer
updates, moved after the last copy, read the sums: the gradient of the mean
loss over all k micro-batches, i.e. of the whole per-rank batch. Every node of
micro-batch i carries ``meta["custom"]["microbatch"] = i`` and the schedule
shows it.

Per step and rank this costs k times one micro-batch step's collectives
(docs/training.md, "Gradient accumulation") and, over one micro-batch step's
memory, one shard-sized accumulator per trainable flat parameter.

Invariant: every collective of the region appears k times, once per
micro-batch; each trainable flat parameter's gradient is reduced once per
micro-batch; the optimizer reads only the accumulated gradients.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..context import CompileContext
from shardlang.errors import CompileError
from ..ir.graph_utils import positions
from ..ir.tags import NodeKind, is_inserted, tag
from ..ir.trace import Phase, phase_of, tag_of
from shardlang.spec.vocabulary import Accumulation
from ._order import ancestors, move_after, optimizer_gradients
from .contract import GraphProperty, graph_pass

_aten = torch.ops.aten


@graph_pass(requires={GraphProperty.BATCH_STATS_ISSUED, GraphProperty.PARAMETERS_GATHERED,
                      GraphProperty.ACTIVATIONS_RECOMPUTED, GraphProperty.GATHERS_FREED,
                      GraphProperty.GATHERS_PREFETCHED, GraphProperty.GRADIENTS_REDUCED},
            establishes={GraphProperty.MICROBATCHES_ACCUMULATED})
def accumulate_microbatches(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    k = ctx.training.microbatches
    if k == 1 or ctx.training.accumulation is not Accumulation.PER_MICROBATCH:
        return gm
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    loss = output.args[0]
    grads = optimizer_gradients(graph)
    region = _region(graph, [*grads.values(), loss])
    order = positions(graph)
    last = max(region, key=order.__getitem__)
    move_after(graph, last, lambda n: n not in region and n.op == "call_function", "micro-batch accumulation")
    body = sorted(region, key=positions(graph).__getitem__)
    for node in body:
        _set_microbatch(node, 0)
    sums, loss_sum, anchor, adds = dict(grads), loss, last, set()
    for i in range(1, k):
        copies: dict[fx.Node, fx.Node] = {}
        with graph.inserting_before(anchor.next):
            for node in body:
                copies[node] = _copy(graph, node, copies, i)
            for flat, grad in grads.items():
                sums[flat] = tag(graph.call_function(_aten.add.Tensor, (sums[flat], copies[grad])), NodeKind.AVERAGE,
                                 flat, Phase.OPTIMIZER)
                _set_microbatch(sums[flat], i)
                adds.add(sums[flat])
            loss_sum = graph.call_function(_aten.add.Tensor, (loss_sum, copies[loss]))
            anchor = loss_sum
    for flat, grad in grads.items():
        for user in list(grad.users):
            if user not in region and user not in adds:
                user.replace_input_with(grad, sums[flat])
    output.replace_input_with(loss, loss_sum)
    gm.recompile()
    return gm


def _region(graph: fx.Graph, results) -> set[fx.Node]:
    """One micro-batch: every forward and backward node, and every node ``results`` are computed from."""
    region = {n for n in graph.nodes if phase_of(n) in (Phase.FORWARD, Phase.BACKWARD)}
    region |= ancestors(results)
    region = {n for n in region if n.op == "call_function"}
    for node in region:
        if phase_of(node) is Phase.OPTIMIZER and not is_inserted(node) and tag_of(node, "flat"):
            raise CompileError(f"micro-batch accumulation: the micro-batch region reads optimizer update {node.name}")
    return region


def _copy(graph: fx.Graph, node: fx.Node, copies: dict, i: int) -> fx.Node:
    """``node`` for micro-batch i: same op on the copies of its inputs; a batch slice moves to rows of block i."""
    new = graph.node_copy(node, lambda arg: copies.get(arg, arg))
    _set_microbatch(new, i)
    rows = tag_of(node, "microbatch_rows")
    if rows is not None:
        if node.target is not _aten.slice.Tensor or node.args[1:4] != (0, 0, rows):
            raise CompileError(f"micro-batch accumulation: {node.name} is not the slice of rows [0, {rows}) it should be")
        new.args = (new.args[0], 0, i * rows, (i + 1) * rows)
    return new


def _set_microbatch(node: fx.Node, i: int) -> None:
    node.meta["custom"] = {**node.meta.get("custom", {}), "microbatch": i}
