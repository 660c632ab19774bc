"""Views and data movement: reshapes, transposes, permutes, slices, selects, concatenation, splits.

None of these does arithmetic, so a partial sum stays partial through them. A
shard follows its dim where the op moves it. A reshape keeps a shard when the
sharded dim is the outermost one of the group of dims it merges into, or splits
from, and that group's outermost output dim divides by the ranks: then each
rank's block of the group is contiguous, before and after. Splitting heads,
``(b, s, h*d) -> (b, s, h, d)``, keeps a shard of ``h*d`` as a shard of ``h``.
Where the dim the op slices, selects or concatenates along is sharded, the
value is gathered first. Ops that take sizes get each rank's local sizes.
"""

from __future__ import annotations

import math

import torch

from ..placements import PARTIAL, REPLICATE, Shard, local_shape
from ..strategy import OpCall, Strategy

__all__ = ["VIEW_RULES", "dim_groups", "reshape_shard_map"]

aten = torch.ops.aten


def dim_groups(source: tuple[int, ...], target: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of ``source`` dims with runs of ``target`` dims that hold the same elements.

    Example: ``dim_groups((8, 32, 64), (8, 32, 4, 16)) == [([0], [0]), ([1], [1]), ([2], [2, 3])]``.
    """
    groups, i, j = [], 0, 0
    while i < len(source) or j < len(target):
        if i == len(source):
            groups.append(([], [j]))
            j += 1
            continue
        if j == len(target):
            groups.append(([i], []))
            i += 1
            continue
        gi, gj, pi, pj = [i], [j], source[i], target[j]
        while pi != pj:
            if pi < pj and i + 1 < len(source):
                i += 1
                gi.append(i)
                pi *= source[i]
            elif j + 1 < len(target):
                j += 1
                gj.append(j)
                pj *= target[j]
            else:
                break
        groups.append((gi, gj))
        i, j = i + 1, j + 1
    return groups


def _major(dims: list[int], shape: tuple[int, ...]) -> int | None:
    return next((d for d in dims if shape[d] > 1), None)


def reshape_shard_map(source: tuple[int, ...], target: tuple[int, ...], n: int) -> dict[int, int]:
    """Source dim -> target dim, for each source dim whose shard is a shard of a target dim after the reshape."""
    mapping = {}
    for gi, gj in dim_groups(source, target):
        major_in, major_out = _major(gi, source), _major(gj, target)
        if major_in is None or major_out is None:
            continue
        if math.prod(source[d] for d in gi) != math.prod(target[d] for d in gj):
            continue
        if source[major_in] % n == 0 and target[major_out] % n == 0:
            mapping[major_in] = major_out
    return mapping


def _common(call: OpCall, outputs_of) -> list[Strategy]:
    """Replicated and partial strategies of a one-input view, plus a shard for each dim ``outputs_of`` maps."""
    strategies = [Strategy((REPLICATE,), (REPLICATE,)), Strategy((PARTIAL,), (PARTIAL,))]
    for d, out in outputs_of.items():
        strategies.append(Strategy((Shard(d),), (Shard(out),)))
    return strategies


def _with_local_sizes(call: OpCall, strategies: list[Strategy], size_arg: int = 1) -> list[Strategy]:
    """Rewrite the sizes argument (position ``size_arg``) to the output's local shape under each strategy."""
    out = call.out_shapes[0]
    done = []
    for s in strategies:
        args = list(call.node.args)
        args[size_arg] = list(local_shape(out, s.outputs[0], call.n, call.node.name))
        done.append(Strategy(s.inputs, s.outputs, tuple(args), s.kwargs))
    return done


def view_strategies(call: OpCall) -> list[Strategy]:
    (source,) = call.shapes
    out = call.out_shapes[0]
    return _with_local_sizes(call, _common(call, reshape_shard_map(source, out, call.n)))


def expand_strategies(call: OpCall) -> list[Strategy]:
    (source,) = call.shapes
    out = call.out_shapes[0]
    offset = len(out) - len(source)
    kept = {d: d + offset for d in range(len(source)) if source[d] == out[d + offset] and source[d] > 1}
    return _with_local_sizes(call, _common(call, {d: o for d, o in kept.items() if source[d] % call.n == 0}))


def _dim(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


def permute_like_strategies(call: OpCall) -> list[Strategy]:
    """``t``, ``transpose``, ``permute``: a shard moves with its dim."""
    (source,) = call.shapes
    ndim = len(source)
    target, args = call.node.target, call.node.args
    if target is aten.t.default:
        order = list(range(ndim))[::-1]
    elif target is aten.transpose.int:
        order = list(range(ndim))
        a, b = _dim(args[1], ndim), _dim(args[2], ndim)
        order[a], order[b] = order[b], order[a]
    else:
        order = [_dim(d, ndim) for d in args[1]]
    return _common(call, {src: order.index(src) for src in range(ndim) if source[src] % call.n == 0})


def unsqueeze_strategies(call: OpCall) -> list[Strategy]:
    (source,) = call.shapes
    at = _dim(call.node.args[1], len(source) + 1)
    return _common(call, {d: d + (d >= at) for d in range(len(source)) if source[d] % call.n == 0})


def squeeze_strategies(call: OpCall) -> list[Strategy]:
    (source,) = call.shapes
    out = call.out_shapes[0]
    kept = [d for d in range(len(source)) if not (source[d] == 1 and _squeezed(call, d, len(source)))]
    return _common(call, {d: kept.index(d) for d in kept if source[d] % call.n == 0 and len(kept) == len(out)})


def _squeezed(call: OpCall, d: int, ndim: int) -> bool:
    if call.node.target is aten.squeeze.default:
        return True
    dims = call.node.args[1]
    dims = dims if isinstance(dims, (list, tuple)) else [dims]
    return d in {_dim(x, ndim) for x in dims}


def select_strategies(call: OpCall) -> list[Strategy]:
    """``select(x, dim, i)`` and ``slice(x, dim, start, end)``: blocks of the other dims stay where they are."""
    (source,) = call.shapes
    out = call.out_shapes[0]
    at = _dim(call.node.args[1] if len(call.node.args) > 1 else 0, len(source))
    whole = call.node.target is aten.slice.Tensor and out[at] == source[at]
    removes = call.node.target is aten.select.int
    mapping = {}
    for d in range(len(source)):
        if (d == at and not whole) or source[d] % call.n:
            continue
        mapping[d] = d - (removes and d > at)
    return _common(call, mapping)


def backward_of_select_strategies(call: OpCall) -> list[Strategy]:
    """``select_backward`` / ``slice_backward(grad, input_sizes, dim, ...)``: zeros around the gradient."""
    (grad,) = call.shapes
    out = call.out_shapes[0]
    at = _dim(call.node.args[2], len(out))
    inserts = call.node.target is aten.select_backward.default
    mapping = {}
    for d in range(len(grad)):
        o = d + (inserts and d >= at)
        if o != at and grad[d] % call.n == 0:
            mapping[d] = o
    return _with_local_sizes(call, _common(call, mapping))


def cat_strategies(call: OpCall) -> list[Strategy]:
    """``cat(tensors, dim)`` and ``stack(tensors, dim)``: every input blocked alike along another dim."""
    shapes = call.shapes
    out = call.out_shapes[0]
    stacks = call.node.target is aten.stack.default
    at = _dim(call.node.args[1] if len(call.node.args) > 1 else 0, len(out))
    k = len(shapes)
    strategies = [Strategy((REPLICATE,) * k, (REPLICATE,)), Strategy((PARTIAL,) * k, (PARTIAL,))]
    ndim = len(shapes[0])
    for d in range(ndim):
        o = d + (stacks and d >= at)
        if o == at or any(s[d] % call.n for s in shapes if len(s) == ndim):
            continue
        strategies.append(Strategy(tuple(Shard(d) for _ in shapes), (Shard(o),)))
    return strategies


def split_strategies(call: OpCall) -> list[Strategy]:
    """``split`` / ``split_with_sizes`` / ``unbind``: every piece blocked like the input along another dim."""
    (source,) = call.shapes
    pieces = len(call.out_shapes)
    unbinds = call.node.target is aten.unbind.int
    at = _dim(call.node.args[1] if unbinds else (call.node.args[2] if len(call.node.args) > 2 else 0), len(source))
    strategies = [Strategy((REPLICATE,), (REPLICATE,) * pieces), Strategy((PARTIAL,), (PARTIAL,) * pieces)]
    for d in range(len(source)):
        if d == at or source[d] % call.n:
            continue
        strategies.append(Strategy((Shard(d),), (Shard(d - (unbinds and d > at)),) * pieces))
    return strategies


VIEW_RULES = {
    aten.view.default: view_strategies,
    aten._unsafe_view.default: view_strategies,
    aten.reshape.default: view_strategies,
    aten.expand.default: expand_strategies,
    aten.t.default: permute_like_strategies,
    aten.transpose.int: permute_like_strategies,
    aten.permute.default: permute_like_strategies,
    aten.unsqueeze.default: unsqueeze_strategies,
    aten.squeeze.dim: squeeze_strategies,
    aten.squeeze.dims: squeeze_strategies,
    aten.squeeze.default: squeeze_strategies,
    aten.select.int: select_strategies,
    aten.slice.Tensor: select_strategies,
    aten.select_backward.default: backward_of_select_strategies,
    aten.slice_backward.default: backward_of_select_strategies,
    aten.cat.default: cat_strategies,
    aten.stack.default: cat_strategies,
    aten.split.Tensor: split_strategies,
    aten.split_with_sizes.default: split_strategies,
    aten.unbind.int: split_strategies,
}

