"""The traced step may mutate its parameters only in the optimizer, and its batch never.

make_fx records an in-place op on an input as a mutation of that placeholder.
Two of them give silently wrong numbers once the step is sharded:

- a parameter changed in place in forward or backward (``w.clamp_`` under
  ``no_grad``, weight-norm style): after the gather passes, the parameter is a
  view of a gathered buffer, which is freed, so the change is lost at N > 1
  and kept at N = 1;
- a batch leaf changed in place: the step may run one batch more than once
  (``shardlang check`` runs it through the reference too; micro-batches slice
  it) and the caller's tensor changes under it.

Buffers (BatchNorm statistics) are meant to be updated in place and are left
alone. Example::

    check_input_mutations(gm.graph, traced_inputs)   # TraceError naming the op, the input and the user's line
"""

from __future__ import annotations

import torch
import torch.fx as fx

from shardlang.errors import TraceError
from .provenance import site_of_node

# `trace.InputRole` and `trace.Phase` values, by value: trace.py runs this check on a failed trace's partial graph
_FLAT, _BATCH, _OPTIMIZER = "flat", "batch", "optimizer"


def check_input_mutations(graph: fx.Graph, inputs) -> None:
    """Raise `TraceError` at the first in-place op outside the optimizer on a parameter or batch placeholder.

    ``inputs`` are the graph's `trace.GraphInput` in placeholder order.
    """
    placeholders = {n: spec for n, spec in zip((n for n in graph.nodes if n.op == "placeholder"), inputs)}
    for node in graph.nodes:
        if node.meta.get("custom", {}).get("phase") == _OPTIMIZER:
            continue
        for arg in written_args(node):
            spec = placeholders.get(alias_base(arg))
            if spec is None or spec.role.value not in (_FLAT, _BATCH):
                continue
            member = arg.meta.get("custom", {}).get("member")
            what = (f"batch leaf {spec.name}" if spec.role.value == _BATCH
                    else f"parameter {member!r}" if member else f"a parameter of flat parameter {spec.name!r}")
            site = site_of_node(node)
            fix = ("shardlang splits the batch over ranks and may run one batch more than once (micro-batches, "
                   "shardlang check), so the caller's tensor must not change: write x = x * 2 instead of x.mul_(2)"
                   if spec.role.value == _BATCH else
                   "inside the step a parameter is a view of a gathered copy that is freed after use, so the "
                   "change would be lost on more than one rank: compute a new tensor (w = w.clamp(...)), or "
                   "change the parameter outside the step")
            where = f" at {site}" if site else ""
            raise TraceError(f"the step changes {what} in place with {node.target} (node {node.name}){where}\n"
                             f"what to do: {fix}", site=site)


def written_args(node: fx.Node) -> list[fx.Node]:
    """The nodes an aten op writes in place (each element of a written list: ``_foreach_*_``); none for other calls."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return []
    written = []
    for i, argument in enumerate(target._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
        written += [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, fx.Node)]
    return written


def alias_base(node: fx.Node) -> fx.Node:
    """Follow views (and in-place ops, which return their input) back to the tensor they alias."""
    while node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.args \
            and isinstance(node.args[0], fx.Node):
        schema = node.target._schema
        first = schema.arguments[0].alias_info if schema.arguments else None
        if not (node.target.is_view or (first is not None and first.is_write)):
            break
        node = node.args[0]
    return node
