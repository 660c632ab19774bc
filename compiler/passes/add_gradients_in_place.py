"""Sum two gradients into the one nothing reads afterwards, instead of into a new buffer.

Before: autograd's trace sums the gradients of a value used twice with an
out-of-place ``add``: the tied weight of a language model (its embedding's
gradient plus its head's), and every activation that feeds two branches (the
residual stream). Each such ``add`` allocates a buffer as large as its operands.
After: where one operand is a buffer of its own that nothing reads after the
``add`` (a freshly computed gradient), the sum is written into it
(``add_(that, other)``) and the ``add``'s readers read that buffer.

Note [gradient sums in place]: on the 100M GPT of ``examples/gpt.py`` the tied
weight is 48 MiB, above glibc's mmap threshold (at most 32 MiB), so the new
buffer was fresh pages every step: 12,289 page faults, about 20 ms of system
time. Float addition is commutative, so ``b + a`` is ``a + b`` to the bit.
Eager only: inductor plans its own buffers (and reuses them), so its graph is
left as traced.

Invariant: every value computed is the one before, to the bit; a buffer written
in place is one no node reads after the write except through the ``add``'s own
result (not a graph input, not a graph output, not read by a collective).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from shardlang.spec.vocabulary import StepBackend
from ..context import CompileContext
from ..ir.graph_utils import positions, storage_key, tensor_leaves
from ..ir.shapes import propagate_shapes, remember_shapes
from ..ir.trace import Phase, phase_of
from .contract import GraphProperty, graph_pass

_aten = torch.ops.aten


@graph_pass(requires={GraphProperty.GRADIENTS_REDUCED, GraphProperty.MICROBATCHES_ACCUMULATED,
                      GraphProperty.SHAPES_PROPAGATED},
            establishes={GraphProperty.GRADIENT_SUMS_IN_PLACE})
def add_gradients_in_place(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    if ctx.backend is not StepBackend.EAGER:
        return gm
    graph = gm.graph
    order = positions(graph)
    holders: dict = {}  # storage -> the nodes whose value is (a view of) it
    for node in graph.nodes:
        for t in tensor_leaves(node.meta.get("val")):
            holders.setdefault(storage_key(t), []).append(node)
    sums = []  # (the add, the operand it writes into)
    for node in graph.nodes:
        if node.target is not _aten.add.Tensor or node.kwargs or phase_of(node) is not Phase.BACKWARD:
            continue
        a, b = node.args
        written = next((x for x in (b, a) if _dead_after(x, node, a, b, holders, order)), None)
        if written is not None:
            sums.append((node, written))
            # The sum's value will be the written storage: a later sum that reads it must see all its holders.
            shared = holders[storage_key(written.meta["val"])]
            shared.append(node)
            holders[storage_key(node.meta["val"])] = shared
    if not sums:
        return gm
    remember_shapes(gm)  # Note [incremental shapes]: only the sums and what reads them run again
    for node, written in sums:
        a, b = node.args
        node.target, node.args = _aten.add_.Tensor, (written, a if written is b else b)
    gm.recompile()
    return propagate_shapes(gm, ctx)


def _dead_after(x, add: fx.Node, a, b, holders: dict, order) -> bool:
    """Whether the sum may be written into ``x``: same layout as the sum, and its storage unread after ``add``."""
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return False
    vals = [n.meta.get("val") for n in (a, b, add)]
    if not all(isinstance(v, torch.Tensor) for v in vals) or len({_layout(v) for v in vals}) != 1:
        return False
    if not vals[2].is_contiguous() or a is b:
        return False
    for holder in holders.get(storage_key(x.meta["val"]), ()):
        if holder is add:
            continue
        if holder.op != "call_function":  # a graph input, or the output
            return False
        for user in holder.users:
            if user.op == "output" or order[user] > order[add] or _is_collective(user):
                return False
    return True


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.dtype, t.device


def _is_collective(node: fx.Node) -> bool:
    """A collective may read its input from another thread until its wait: never write into it."""
    module = getattr(node.target, "__module__", "") or ""
    return getattr(node.target, "namespace", None) == "_c10d_functional" or module.endswith("collectives")
