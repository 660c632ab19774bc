"""Emit: bind the abstract collectives of a compiled graph to real process groups.

The compiler works against axis names (`compiler.ir.collectives`); binding swaps
each abstract collective for the ``torch.ops._c10d_functional`` op on the
process group that serves its axis. Issue and wait stay separate nodes, so an
issued collective runs while the compute between them does (async on gloo's
threads or on NCCL's stream).

A world of one binds nothing: its collectives are identities and it needs no
process group at all.

When the bound graph raises (a collective that timed out, a peer that went
away), `failing_node` finds the node that raised from the traceback alone, at
no cost while the step runs; the schedule op that covers that node is then
`Schedule.op_of_node` (Note [collective timeout] in `shardlang.runtime.watch`).

Note [reduce-scatter as all-to-all]: torch 2.13's gloo runs
``reduce_scatter_tensor`` as a whole all-reduce plus a copy: ``2(N-1)/N`` of the
buffer on the wire and a full-size temporary. On gloo, `bind` therefore lowers
each reduce-scatter to an ``all_to_all_single`` of the N blocks (block r goes to
rank r: ``(N-1)/N`` of the buffer) and, after its wait, a local sum of the N
blocks received. The result is the same sum; only the order of the additions
differs from gloo's (rounding). NCCL keeps its reduce-scatter.
"""

from __future__ import annotations

import copy
import types

import torch
import torch.fx as fx

from ..ir import collectives
from shardlang.errors import CompileError
from ..layout.buffers import BufferPool, buffer_slot
from ..layout.flat import KeptReductionBuffer, flatten_gradients
from ..ir.tags import is_kept
from ..layout.placement import WORLD

_c10d = torch.ops._c10d_functional

#: The axis name that `reduce_gradients` uses for "every rank" (replicated gradients).
WORLD_AXIS = WORLD


def bind(gm: fx.GraphModule, group_names: dict[str, str] | None,
         coordinates: dict[str, int] | None = None, *, reduce_scatter_as_all_to_all: bool = False) -> fx.GraphModule:
    """A copy of ``gm`` whose collectives run on the groups named in ``group_names`` (group key -> c10d group name).

    A group key is a mesh axis (``"fsdp"``), every axis (``"*"``), or several
    axes joined by ``+`` (`MeshShape.group_key`). ``coordinates`` (axis ->
    this rank's coordinate) places `collectives.local_shard`, `local_block` and
    `local_partial`. Collectives over a
    group of one rank stay the identities they are and need no group. With
    ``group_names=None`` (world size 1) the graph is returned unchanged.
    ``reduce_scatter_as_all_to_all`` (gloo) lowers reduce-scatters as Note
    [reduce-scatter as all-to-all] says. The packs marked kept (Note [kept
    reduction buffers] in `passes.keep_reduction_buffers`) write into buffers
    that the returned graph owns (`kept_reduction_buffers`), and so do the
    slots of the step's pool (Note [buffer assignment], `buffer_pool`).

    Example::

        bound = bind(compiled.graph_module, {"fsdp": group.group_name}, {"fsdp": rank},
                     reduce_scatter_as_all_to_all=True)
    """
    if group_names is None:
        _check_unbound_is_local(gm)
        return gm
    bound = copy.deepcopy(gm)
    local: set[fx.Node] = set()  # collectives over one rank, left as identities
    exchanged: dict[fx.Node, tuple[int, object]] = {}  # reduce-scatters lowered to all-to-all: (N, result value)
    for node in list(bound.graph.nodes):
        group = collectives.group_of(node)
        if group is not None and group[1] == 1:
            local.add(node)
            continue
        if node.target is collectives.all_gather:
            shard, axis, size = node.args
            node.target, node.args = _c10d.all_gather_into_tensor.default, (shard, size, _group(group_names, axis))
        elif node.target is collectives.all_gather_into:
            shard, out, axis, size = node.args
            node.target = _c10d.all_gather_into_tensor_out.default
            node.args, node.kwargs = (shard, size, _group(group_names, axis)), {"out": out}
        elif node.target is collectives.reduce_scatter and reduce_scatter_as_all_to_all:
            buffer, axis, size = node.args
            result = node.meta["val"]
            block = result.shape[0]
            node.target = _c10d.all_to_all_single.default
            node.args = (buffer, [block] * size, [block] * size, _group(group_names, axis))
            node.meta = {**node.meta, "val": buffer.meta.get("val")}
            exchanged[node] = (size, result)
        elif node.target is collectives.reduce_scatter:
            buffer, axis, size = node.args
            node.target, node.args = _c10d.reduce_scatter_tensor.default, (buffer, "sum", size, _group(group_names, axis))
        elif node.target in (collectives.all_reduce, collectives.all_reduce_):
            buffer, axis, _size = node.args
            # Note [reductions in place] (`passes.reduce_in_place`) chose which ones reduce their buffer in place.
            op = _c10d.all_reduce_.default if node.target is collectives.all_reduce_ else _c10d.all_reduce.default
            node.target, node.args = op, (buffer, "sum", _group(group_names, axis))
        elif node.target is collectives.local_block:
            full, dim, axis, size = node.args
            block = full.meta["val"].shape[dim] // size
            start = _coordinate(coordinates, axis) * block
            with bound.graph.inserting_before(node):
                narrowed = bound.graph.call_function(torch.ops.aten.narrow.default, (full, dim, start, block))
            node.target, node.args = torch.ops.aten.clone.default, (narrowed,)
            node.kwargs = {"memory_format": torch.contiguous_format}
        elif node.target is collectives.local_partial:
            full, axis, _size = node.args
            if _coordinate(coordinates, axis) == 0:
                node.target, node.args = torch.ops.aten.alias.default, (full,)
            else:
                node.target, node.args = torch.ops.aten.zeros_like.default, (full,)
        elif node.target is collectives.local_shard:
            full, axis, size = node.args
            coordinate = _coordinate(coordinates, axis)
            shard = node.meta["val"].shape[0]
            node.target, node.args = torch.ops.aten.narrow.default, (full, 0, coordinate * shard, shard)
        elif node.target is collectives.wait and node.args[0] not in local:
            node.target = _c10d.wait_tensor.default
            if node.args[0] in exchanged:
                _sum_blocks(bound.graph, node, *exchanged[node.args[0]])
    _keep_reduction_buffers(bound.graph)
    _own_buffer_pool(bound.graph)
    bound.graph.lint()
    bound.recompile()
    return bound


def _keep_reduction_buffers(graph: fx.Graph) -> None:
    """Each pack marked kept fills a buffer of its own, owned by the bound graph (Note [kept reduction buffers])."""
    for node in graph.nodes:
        if node.target is flatten_gradients and is_kept(node):
            node.target = KeptReductionBuffer().fill


def _own_buffer_pool(graph: fx.Graph) -> None:
    """The slots of the step's pool become the bound graph's own, kept between steps (Note [buffer assignment])."""
    pool = BufferPool()
    for node in graph.nodes:
        if node.target is buffer_slot:
            node.target = pool.slot


def buffer_pool(gm: fx.GraphModule) -> BufferPool | None:
    """The pool a bound graph holds its slots in (Note [buffer assignment]); None when it has none.

    Example: ``buffer_pool(bound).nbytes`` after a step: the bytes the pool holds between steps.
    """
    return next((node.target.__self__ for node in gm.graph.nodes
                 if isinstance(getattr(node.target, "__self__", None), BufferPool)), None)


def kept_reduction_buffers(gm: fx.GraphModule) -> dict[str, KeptReductionBuffer]:
    """The reduction buffers a bound graph keeps between steps, by pack node name (Note [kept reduction buffers]).

    A buffer's ``.buffer`` is None until the first step has run. Example::

        bound = bind(compiled.graph_module, names, coordinates)
        [k.buffer.data_ptr() for k in kept_reduction_buffers(bound).values()]   # after a step
    """
    return {node.name: node.target.__self__ for node in gm.graph.nodes
            if isinstance(getattr(node.target, "__self__", None), KeptReductionBuffer)}


def _sum_blocks(graph: fx.Graph, wait: fx.Node, size: int, result) -> None:
    """After the wait of a reduce-scatter lowered to all-to-all: the sum of the ``size`` blocks received."""
    wait.meta = {**wait.meta, "val": wait.args[0].meta.get("val")}
    with graph.inserting_after(wait):
        blocks = graph.call_function(torch.ops.aten.view.default, (wait, [size, *result.shape]))
    with graph.inserting_after(blocks):
        summed = graph.call_function(torch.ops.aten.sum.dim_IntList, (blocks, [0]))
    summed.meta = {**wait.meta, "val": result}
    wait.replace_all_uses_with(summed, delete_user_cb=lambda user: user is not blocks)


def _group(group_names: dict[str, str], axis: str) -> str:
    try:
        return group_names[axis]
    except KeyError:
        raise CompileError(f"no process group bound for mesh axis {axis!r}; bound axes: {sorted(group_names)}") from None


def _coordinate(coordinates: dict[str, int] | None, axis: str) -> int:
    if coordinates is None or axis not in coordinates:
        raise CompileError(f"no coordinate given for mesh axis {axis!r}; given: {sorted(coordinates or {})}")
    return coordinates[axis]


def group_keys(gm: fx.GraphModule) -> tuple[str, ...]:
    """The group keys the graph's collectives use over more than one rank, in order of first use.

    Every rank compiles the same graph, so every rank gets the same keys in the
    same order: the order in which to create process groups.
    """
    keys: dict[str, None] = {}
    for node in gm.graph.nodes:
        group = collectives.group_of(node)
        if group is not None and group[1] > 1 and node.target not in collectives.COORDINATE_DEPENDENT:
            keys[group[0]] = None
    return tuple(keys)


def _check_unbound_is_local(gm: fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        group = collectives.group_of(node)
        if group is not None and group[1] != 1:
            raise CompileError(
                f"{node.name} is a collective over {group[1]} ranks, but no process group was given to bind it"
            )


def failing_node(gm: fx.GraphModule, exc: BaseException) -> fx.Node | None:
    """The node of ``gm`` whose line of generated code raised ``exc``; None when it did not come from ``gm``.

    fx keeps, for each line of the generated ``forward``, the index of the node it
    runs (``GraphModule._lineno_map``, as dynamo reads it); the traceback gives the
    line. Nothing is added to the step: this costs only when an error is explained.

    Example::

        try:
            bound(*inputs)
        except RuntimeError as exc:
            node = failing_node(bound, exc)     # e.g. the wait_tensor node of an all-gather
    """
    lineno_map = getattr(gm, "_lineno_map", None)
    code = getattr(type(gm).forward, "__code__", None)
    if not lineno_map or code is None:
        return None
    tb: types.TracebackType | None = exc.__traceback__
    line = None
    while tb is not None:  # the innermost frame of the generated forward
        if tb.tb_frame.f_code is code:
            line = tb.tb_lineno
        tb = tb.tb_next
    if line is None:
        return None
    index = lineno_map.get(line - code.co_firstlineno)
    nodes = list(gm.graph.nodes)
    return nodes[index] if index is not None and 0 <= index < len(nodes) else None


def is_bound_collective(node: fx.Node) -> bool:
    """Whether ``node`` runs a ``torch.ops._c10d_functional`` op (an issued collective or its wait).

    Example: the node ``wait_tensor(all_gather_into_tensor(shard, 2, "0"))`` and its input both are.
    """
    return node.op == "call_function" and getattr(node.target, "namespace", None) == "_c10d_functional"
