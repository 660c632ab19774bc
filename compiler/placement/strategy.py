"""How an op may run on one axis: strategies, and the choice among them by what redistribution costs.

A rule (`compiler.placement.rules`) looks at one call of the traced step, an
`OpCall`: its tensor arguments' logical shapes and current placements. It
returns the `Strategy`s under which running the op on every rank's local values
gives the local values of the logical result: the placement each tensor argument
must have, the placement of each output, and the arguments rewritten with local
sizes where the op takes sizes (``view``, ``expand``, ``embedding_dense_backward``).

`choose` keeps the strategy whose redistributions move the fewest bytes
(DTensor's sharding propagation chooses the same way). Moving to a placement a
rank can make alone (Replicate to Shard: its own block; Replicate to Partial:
itself on coordinate 0, zeros elsewhere) costs nothing; Shard to Replicate is an
all-gather, Partial to Replicate an all-reduce (twice the bytes on a ring), and
Partial to Shard a reduce-scatter (Note [sequence shards] says how it is priced).
Among strategies of equal cost the first wins, so a rule lists its preferred one first.
"""

from __future__ import annotations

import math

import attrs
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .placements import Flattened, Packed, Partial, Placement, Replicate, Shard

__all__ = ["OpCall", "Strategy", "choose", "redistribution_cost", "tensor_leaves"]


def tensor_leaves(node: fx.Node) -> list[fx.Node]:
    """The tensor-valued nodes among ``node``'s arguments, in pytree order of ``(args, kwargs)``."""
    leaves = pytree.tree_leaves((node.args, node.kwargs))
    return [a for a in leaves if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]


@attrs.frozen
class OpCall:
    """One call of the step as a rule sees it: the node, its tensor arguments' placements and logical shapes."""

    node: fx.Node
    placements: tuple[Placement, ...]  # of each of `tensor_leaves(node)`, in order
    n: int  # ranks on the axis
    loss_parallel: bool = False  # the loss may run on vocabulary blocks (Note [loss parallelism])

    @property
    def leaves(self) -> list[fx.Node]:
        return tensor_leaves(self.node)

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(a.meta["val"].shape) for a in self.leaves)

    def placement_of(self, arg: fx.Node) -> Placement:
        """The current placement of the tensor argument ``arg``."""
        return self.placements[self.leaves.index(arg)]

    @property
    def out_shapes(self) -> tuple[tuple[int, ...] | None, ...]:
        """The logical shape of each output (None for a non-tensor output), a 1-tuple for one tensor."""
        val = self.node.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else (val,)
        return tuple(tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in vals)


@attrs.frozen
class Strategy:
    """Required input placements, output placements, and the arguments with local sizes (None: unchanged).

    ``lower``: where the local computation is not the op itself on local values (a
    lookup in a vocabulary shard), ``lower(lowering, args)`` writes the nodes that
    compute it from the local ``args`` and returns the result
    (`compiler.placement.localize.Lowering`).
    """

    inputs: tuple[Placement, ...]
    outputs: tuple[Placement | None, ...]
    args: tuple | None = None
    kwargs: dict | None = None
    lower: object = None


def redistribution_cost(shape: tuple[int, ...], source: Placement, target: Placement,
                        sequence_dim: int | None = None) -> float:
    """The elements a rank sends to turn ``source`` into ``target`` (alpha-free: only the ranking matters).

    Note [sequence shards]: a partial value wanted as `Shard(sequence_dim)` is
    reduce-scattered, half an all-reduce's bytes; any other partial made a shard
    is priced as the all-reduce it would replace. So without sequence
    parallelism (``sequence_dim`` None) activations stay whole between tp
    regions, Megatron's plan; with it, the reduction after a row-parallel
    product leaves the residual stream split on the sequence, and the gather
    before the next column-parallel product puts the other half of the bytes back.
    """
    if source == target:
        return 0.0
    size = float(math.prod(shape))
    if isinstance(source, Flattened) and isinstance(target, Flattened):
        return redistribution_cost(source.shape, source.inner, target.inner, sequence_dim)
    if isinstance(source, Packed) or isinstance(target, Packed):
        return math.inf  # a flat keeps its layout: only a member can move
    if isinstance(target, Partial) and isinstance(source, Replicate):
        return 0.0
    if isinstance(target, Shard) and isinstance(source, Replicate):
        return 0.0
    if isinstance(source, Partial):
        if isinstance(target, Shard) and target.dim == sequence_dim:
            return size  # a reduce-scatter (Note [sequence shards])
        return 2.0 * size  # an all-reduce
    if isinstance(source, Shard):
        return size  # an all-gather (to another Shard or to Partial: then a local step)
    return math.inf


PARAMETER_WEIGHT = 1000.0  # moving a parameter costs this many times its bytes (Note [parameters stay put])


def choose(call: OpCall, strategies: list[Strategy], available=None, parameters=None,
           prefer: Placement | None = None, sequence_dim: int | None = None) -> Strategy | None:
    """The strategy whose redistributions cost least; the first of equals; None when none can run.

    ``prefer``: where the output's one reader wants it (Note [gradients where
    their parameters are] in `compiler.placement.propagate`). Bringing the output
    there is counted in a strategy's cost, and among the strategies of least cost
    the first whose output is placed so wins.

    ``available[i]`` holds placements argument ``i`` already has from an earlier
    redistribution: using one of those again costs nothing. ``parameters[i]``
    says argument ``i`` is a parameter (or a view of one): moving it costs
    `PARAMETER_WEIGHT` times as much. ``sequence_dim``: Note [sequence shards].

    Note [parameters stay put]: on a tensor axis, a parameter keeps the
    placement its rule gave it and the activations move around it, as in every
    tensor-parallel plan (Megatron's, DTensor's). Moving a parameter every step
    is what the data axes' sharding does, once, for all of them; here it is the
    choice of last resort, when no activation can move instead.
    """
    shapes = call.shapes
    available = available or [()] * len(shapes)
    parameters = parameters or [False] * len(shapes)
    best, best_cost = None, math.inf
    for strategy in strategies:
        cost = sum(0.0 if want in ready else redistribution_cost(s, have, want, sequence_dim) *
                   (PARAMETER_WEIGHT if param else 1)
                   for s, have, want, ready, param in zip(shapes, call.placements, strategy.inputs, available,
                                                          parameters))
        if prefer is not None:
            cost += redistribution_cost(call.out_shapes[0], strategy.outputs[0], prefer, sequence_dim)
        preferred = prefer is not None and strategy.outputs[0] == prefer
        if cost < best_cost or (cost == best_cost and preferred and best.outputs[0] != prefer):
            best, best_cost = strategy, cost
    return best
