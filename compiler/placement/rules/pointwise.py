"""Elementwise ops: broadcasting arithmetic, activations and their backwards, the optimizer's updates.

An elementwise op runs on each rank's blocks when every argument is blocked the
same way along the output's dims: an argument that broadcasts along the sharded
dim (size 1, or missing) is replicated. A partial sum survives only a linear op:
``add``/``sub`` of partials, ``mul``/``div`` of one partial by replicated
factors, ``neg``, copies. A partial that meets a replicated value in a sum is
reduced first (Megatron's all-reduce before the residual add); an in-place sum
into a partial turns the replicated operand into a partial instead, for free.

A flat parameter and its optimizer state are `Packed`: the optimizer's updates
combine them with each other and with 0-d replicated scalars only.
"""

from __future__ import annotations

import torch

from ..placements import Flattened, Packed, Partial, REPLICATE, PARTIAL, Shard
from ..strategy import OpCall, Strategy

aten = torch.ops.aten

ADDITIVE = {aten.add.Tensor, aten.sub.Tensor, aten.add_.Tensor, aten.sub_.Tensor}
MULTIPLICATIVE = {aten.mul.Tensor, aten.div.Tensor, aten.mul_.Tensor, aten.div_.Tensor}
UNARY_LINEAR = {aten.neg.default, aten.clone.default, aten.detach.default, aten.alias.default,
                aten._to_copy.default, aten.mul.Scalar, aten.div.Scalar, aten.mul_.Scalar, aten.div_.Scalar,
                aten.neg_.default, aten.zeros_like.default}
NONLINEAR = {
    aten.add.Scalar, aten.sub.Scalar, aten.add_.Scalar, aten.rsub.Scalar, aten.rsub.Tensor,
    aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.pow.Scalar, aten.sqrt.default, aten.rsqrt.default,
    aten.reciprocal.default, aten.exp.default, aten.log.default, aten.tanh.default, aten.sigmoid.default,
    aten.sin.default, aten.cos.default, aten.abs.default, aten.sign.default, aten.erf.default,
    aten.relu.default, aten.gelu.default, aten.silu.default, aten.square.default,
    aten.gelu_backward.default, aten.silu_backward.default, aten.tanh_backward.default,
    aten.sigmoid_backward.default, aten.threshold_backward.default, aten.where.self,
    aten.maximum.default, aten.minimum.default, aten.clamp.default, aten.clamp_min.default,
    aten.clamp_max.default, aten.eq.Tensor, aten.eq.Scalar, aten.ne.Scalar, aten.ne.Tensor, aten.lt.Scalar,
    aten.lt.Tensor, aten.gt.Scalar, aten.gt.Tensor, aten.le.Scalar, aten.ge.Scalar, aten.logical_not.default,
    aten.masked_fill.Scalar, aten.lerp_.Scalar, aten.lerp.Scalar, aten.addcmul_.default, aten.addcdiv_.default,
    aten.addcmul.default, aten.addcdiv.default, aten.sqrt_.default, aten.copy_.default, aten.fill_.Scalar,
    aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
}
POINTWISE = ADDITIVE | MULTIPLICATIVE | UNARY_LINEAR | NONLINEAR
_CREATES_LIKE = {aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
                 aten.zeros_like.default}


def _in_place(call: OpCall) -> bool:
    return call.node.target._schema.name.endswith("_") or call.node.target is aten.copy_.default


def pointwise_strategies(call: OpCall) -> list[Strategy]:
    out = call.out_shapes[0]
    shapes = call.shapes
    current = call.placements
    layouts = {p for p, s in zip(current, shapes) if isinstance(p, (Packed, Flattened))}
    if layouts:  # a flat's optimizer update, or a member's flattened gradient
        if len(layouts) > 1:
            return []
        (layout,) = layouts
        inputs = tuple(layout if s == out else REPLICATE for s in shapes)
        return [Strategy(inputs, (layout,))]
    if call.node.target in _CREATES_LIKE:  # ones_like(x): x's local shape, filled; x's values do not matter
        return [Strategy(current, (current[0] if isinstance(current[0], Shard) else REPLICATE,))]
    strategies = [_blocked(shapes, out, None)]
    strategies += [_blocked(shapes, out, d) for d in range(len(out)) if out[d] > 1 and out[d] % call.n == 0]
    partial = _partial_strategy(call)
    if partial is not None:
        strategies.insert(0, partial)
    if _in_place(call):  # the mutated tensor keeps its placement
        strategies = [s for s in strategies if s.outputs[0] == current[0] and s.inputs[0] == current[0]]
    return strategies


def _blocked(shapes, out, dim: int | None) -> Strategy:
    """Every argument blocked along output dim ``dim`` where it has it unbroadcast, else replicated."""
    inputs = []
    for shape in shapes:
        own = None if dim is None else dim - (len(out) - len(shape))
        inputs.append(Shard(own) if own is not None and own >= 0 and shape[own] == out[dim] else REPLICATE)
    return Strategy(tuple(inputs), (REPLICATE if dim is None else Shard(dim),))


def _partial_strategy(call: OpCall) -> Strategy | None:
    """The partial-in, partial-out strategy when the op is linear in its partial arguments, else None."""
    target, current = call.node.target, call.placements
    if not any(isinstance(p, Partial) for p in current):
        return None
    if target in UNARY_LINEAR and len(current) == 1:
        return Strategy((PARTIAL,), (PARTIAL,))
    if target in ADDITIVE:
        if all(isinstance(p, Partial) for p in current) or (_in_place(call) and isinstance(current[0], Partial)):
            return Strategy(tuple(PARTIAL for _ in current), (PARTIAL,))
        return None
    if target in MULTIPLICATIVE:
        partials = [i for i, p in enumerate(current) if isinstance(p, Partial)]
        divides = target in (aten.div.Tensor, aten.div_.Tensor)
        if len(partials) == 1 and not (divides and partials[0] != 0):
            return Strategy(tuple(PARTIAL if i == partials[0] else REPLICATE for i in range(len(current))),
                            (PARTIAL,))
    return None
