"""Emit: bind the abstract collectives of a compiled graph to real process groups.

The compiler works against axis names (`compiler.collectives`); binding swaps
each abstract collective for the ``torch.ops._c10d_functional`` op on the
process group that serves its axis. Issue and wait stay separate nodes, so an
issued collective runs while the compute between them does (async on gloo's
threads or on NCCL's stream).

A world of one binds nothing: its collectives are identities and it needs no
process group at all.
"""

from __future__ import annotations

import copy

import torch
import torch.fx as fx

from . import collectives
from .errors import CompileError

_c10d = torch.ops._c10d_functional

#: The axis name that `reduce_gradients` uses for "every rank" (replicated gradients).
WORLD_AXIS = "*"


def bind(gm: fx.GraphModule, group_names: dict[str, str] | None) -> fx.GraphModule:
    """A copy of ``gm`` whose collectives run on the groups named in ``group_names`` (axis -> c10d group name).

    With ``group_names=None`` (world size 1) the graph is returned unchanged.
    """
    if group_names is None:
        _check_unbound_is_local(gm)
        return gm
    bound = copy.deepcopy(gm)
    for node in bound.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is collectives.all_gather:
            shard, axis, size = node.args
            node.target, node.args = _c10d.all_gather_into_tensor.default, (shard, size, _group(group_names, axis))
        elif node.target is collectives.reduce_scatter:
            buffer, axis, size = node.args
            node.target, node.args = _c10d.reduce_scatter_tensor.default, (buffer, "sum", size, _group(group_names, axis))
        elif node.target is collectives.all_reduce:
            buffer, axis, _size = node.args
            node.target, node.args = _c10d.all_reduce.default, (buffer, "sum", _group(group_names, axis))
        elif node.target is collectives.wait:
            node.target = _c10d.wait_tensor.default
    bound.graph.lint()
    bound.recompile()
    return bound


def _group(group_names: dict[str, str], axis: str) -> str:
    try:
        return group_names[axis]
    except KeyError:
        raise CompileError(f"no process group bound for mesh axis {axis!r}; bound axes: {sorted(group_names)}") from None


def _check_unbound_is_local(gm: fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in collectives.COLLECTIVES and node.args[2] != 1:
            raise CompileError(
                f"{node.name} is a collective over {node.args[2]} ranks, but no process group was given to bind it"
            )
