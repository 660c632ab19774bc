"""Helpers the training passes share: the gradient each update reads, ancestors, moving nodes later.

Not a pass (no pipeline entry); `clip_gradients` and `accumulate_microbatches`
both need to find the optimizer's inputs and to move the optimizer's nodes
after something new.
"""

from __future__ import annotations

import torch.fx as fx

from shardlang.errors import CompileError
from ..ir.graph_utils import positions
from ..ir.tags import NodeKind, is_inserted, node_tag
from ..ir.trace import Phase, phase_of


def optimizer_gradients(graph: fx.Graph) -> dict[str, fx.Node]:
    """The gradient each trainable flat parameter's update reads: its last node tagged "average"."""
    grads: dict[str, fx.Node] = {}
    for node in graph.nodes:
        t = node_tag(node)
        if t is not None and t.kind is NodeKind.AVERAGE and t.flat is not None:
            grads[t.flat] = node
    return grads


def is_update(node: fx.Node) -> bool:
    """An optimizer node the trace made (the update of a flat parameter, the step count)."""
    return phase_of(node) is Phase.OPTIMIZER and not is_inserted(node)


def ancestors(nodes) -> set[fx.Node]:
    """``nodes`` and every node they read, transitively."""
    seen, stack = set(nodes), list(nodes)
    while stack:
        for arg in stack.pop().all_input_nodes:
            if arg not in seen:
                seen.add(arg)
                stack.append(arg)
    return seen


def move_after(graph: fx.Graph, point: fx.Node, movable, what: str) -> None:
    """Move every ``movable`` node before ``point``, and every node reading a moved one, to just after ``point``.

    Order among the moved nodes is kept. A moved node that ``point`` itself
    needs is a `CompileError` naming it (``what`` says which pass asked).
    """
    order = positions(graph)
    needed = ancestors([point])
    moved: list[fx.Node] = []
    moved_set: set[fx.Node] = set()
    for node in graph.nodes:
        if order[node] >= order[point]:
            break
        if node.op in ("placeholder", "get_attr"):
            continue
        if not (movable(node) or any(a in moved_set for a in node.all_input_nodes)):
            continue
        if node in needed:
            raise CompileError(f"{what}: {node.name} ({node.target}) must come after {point.name}, which needs it")
        moved.append(node)
        moved_set.add(node)
    anchor = point
    for node in moved:
        anchor.append(node)
        anchor = node
