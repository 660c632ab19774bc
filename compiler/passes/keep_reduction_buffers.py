"""Mark the all-reduce buffers that the bound step keeps between steps, as torch DDP keeps its buckets.

Note [kept reduction buffers]: a replicated flat parameter's gradient (the DDP
strategy, and ``replicate()`` parameters in any spec) is concatenated by
`flat.flatten_gradients` into one full-size buffer that an all-reduce sums in
place (Note [reductions in place] in `compiler.passes.reduce_in_place`), that the average
divides in place, and that the update reads, all within the step. Made anew
every step, that buffer is an allocation above glibc's mmap threshold: fresh
pages every step, faulted in by the cat and unmapped at the end (measured at
100M N=2: 35k-67k more minor page faults per step than torch DDP, whose
buckets live as long as the model; docs/benchmarks.md). A marked buffer is
instead owned by the bound graph (`emit.bind` swaps its `flatten_gradients`
for a `flat.KeptReductionBuffer`'s ``fill``): allocated on the first step,
written by the same cat after. The values are the same to the bit; the bytes
are held between steps, and the memory plan counts them as state
(`Category.REDUCTION_BUFFERS`, `compiler.analysis.memory`).

Not marked: reduce-scatter inputs (ZeRO-1/2/3: holding a full gradient
between steps would undo their sharding), a hybrid mesh's all-reduce of a
reduce-scattered shard (not a pack), collectives over one rank (there is no
pack left after `elide_local_reductions`), the k packs per flat of
``microbatches=k, accumulation="per_microbatch"`` (k buffers held per flat
would be k times what torch DDP holds; "keep" reduces once and is kept), and
every buffer when the inductor backend runs the step (inductor plans its own buffers, and a
Python-owned buffer would be a mutation of a global in its trace).

Before: packs tagged ``kind="pack"``. After: each `flatten_gradients` pack
read only by an all-reduce over more than one rank has ``kept=True`` in its
tag, when ``ctx.keep_reduction_buffers`` is on and the backend is eager; the
graph's code is unchanged.

Invariant: a kept pack is a new buffer (several gradients, or a cast) read by
exactly one node, an all-reduce over more than one rank; the bound graph
reduces it in place, divides it in place and the update reads it, within the
step only.
"""

from __future__ import annotations

import torch.fx as fx

from ..ir import collectives
from shardlang.spec.vocabulary import StepBackend
from ..context import CompileContext
from ..layout.flat import is_new_flat_buffer
from ..ir.tags import retag
from shardlang.spec.vocabulary import Accumulation
from .contract import GraphProperty, graph_pass


@graph_pass(requires={GraphProperty.GRADIENTS_REDUCED, GraphProperty.MICROBATCHES_ACCUMULATED},
            establishes={GraphProperty.REDUCTION_BUFFERS_KEPT})
def keep_reduction_buffers(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    if not ctx.keep_reduction_buffers or ctx.backend is not StepBackend.EAGER or ctx.mesh.size == 1:
        return gm
    if ctx.training.microbatches > 1 and ctx.training.accumulation is Accumulation.PER_MICROBATCH:
        return gm  # one pack per flat and micro-batch: k kept buffers each
    for node in gm.graph.nodes:
        if is_keepable(node):
            retag(node, kept=True)
    return gm


def is_keepable(node: fx.Node) -> bool:
    """Whether ``node`` is a new `flatten_gradients` buffer read only by an all-reduce over more than one rank.

    New: a concatenation of several gradients, or a cast. One gradient
    flattened is a view of it, not a buffer of its own (Note [reductions in place]).
    """
    if not is_new_flat_buffer(node):
        return False
    (user,) = node.users
    return user.target is collectives.all_reduce and user.args[0] is node and collectives.over_ranks(user)
