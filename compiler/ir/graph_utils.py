"""Small helpers the passes share: node positions, aliases, tags, insertion, the layout of a node's value.

Tags: every node a pass inserts carries a `compiler.ir.tags.NodeTag`; the
schedule is read off these tags, never off node names.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree

from .tags import NodeKind, kind_of
from .trace import Phase, tag_of

_ALIASING_NOT_MARKED_AS_VIEW = {torch.ops.aten._unsafe_view.default}


def positions(graph: fx.Graph) -> Mapping[fx.Node, object]:
    """Each node's position in ``graph``, as a key that compares in graph order (``order[a] < order[b]``).

    The keys are fx's own ``Node._sort_key``, which fx keeps in graph order as
    nodes are inserted and moved: looking one up costs nothing, where numbering
    a 30k-node graph for every flat parameter made the passes quadratic. They
    follow later changes to the graph (nodes inserted since are in it too).
    """
    if _SORT_KEYS:
        return _SortKeys()
    return {n: i for i, n in enumerate(graph.nodes)}


_SORT_KEYS = hasattr(fx.Node, "_sort_key") or "_sort_key" in getattr(fx.Node, "__annotations__", {})


class _SortKeys(Mapping):
    """``positions`` of a graph through fx's sort keys (any node of the graph)."""

    def __getitem__(self, node: fx.Node):
        return node._sort_key

    def __iter__(self):
        raise TypeError("positions() can be looked up, not listed")

    def __len__(self):
        raise TypeError("positions() can be looked up, not counted")


def is_alias_op(node: fx.Node) -> bool:
    """Whether ``node``'s output may share storage with its first input."""
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem:
        return True
    if target in _ALIASING_NOT_MARKED_AS_VIEW:
        return True
    if kind_of(node) is NodeKind.UNPACK:
        return True  # a view of the gathered buffer for a single-member flat
    return isinstance(target, torch._ops.OpOverload) and target.is_view


def unpack_copies(node: fx.Node) -> bool:
    """Whether an ``unpack`` node copies its member out of the gathered buffer (rather than viewing it).

    Decided by running the unpack on a meta buffer of the same length: no data, only storage identity.
    """
    gathered, world, offset, piece, *rest = node.args
    row = max(u.args[2] + u.args[3] for u in gathered.users if kind_of(u) is NodeKind.UNPACK)
    buffer = torch.empty(world * row, device="meta")
    return node.target(buffer, world, offset, piece, *rest)._base is not buffer


def alias_closure(root: fx.Node) -> list[fx.Node]:
    """``root`` and every node that may alias it through a chain of views, in graph order."""
    seen, stack = {root}, [root]
    while stack:
        node = stack.pop()
        for user in node.users:
            if user not in seen and is_alias_op(user) and user.args and user.args[0] is node:
                seen.add(user)
                stack.append(user)
    order = positions(root.graph)
    return sorted(seen, key=order.__getitem__)


def first_user(nodes, order, where=lambda user: True) -> fx.Node | None:
    users = [u for n in nodes for u in n.users if where(u)]
    return min(users, key=order.__getitem__) if users else None


def last_user(nodes, order, where=lambda user: True) -> fx.Node | None:
    users = [u for n in nodes for u in n.users if where(u)]
    return max(users, key=order.__getitem__) if users else None


def phase_is(phase: Phase):
    return lambda node: tag_of(node, "phase") == phase.value


def placeholders_by_flat(graph: fx.Graph, inputs) -> dict[str, fx.Node]:
    """The placeholder of each flat parameter, by flat name."""
    from .trace import InputRole

    nodes = [n for n in graph.nodes if n.op == "placeholder"]
    return {spec.name: node for spec, node in zip(inputs, nodes) if spec.role is InputRole.FLAT}


def tensor_leaves(val) -> list[torch.Tensor]:
    """The tensors of a node's value (``meta["val"]``: a tensor, a tuple of them, or anything else)."""
    return [t for t in pytree.tree_leaves(val) if isinstance(t, torch.Tensor)]


def storage_key(t: torch.Tensor) -> StorageWeakRef:
    """What identifies ``t``'s storage: equal for two (fake) tensors exactly when they share one."""
    return StorageWeakRef(t.untyped_storage())


def tensor_layout(t: torch.Tensor) -> tuple:
    """``t``'s sizes, strides, storage offset, dtype, device and storage bytes (what a propagation must keep)."""
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device, t.untyped_storage().nbytes())
