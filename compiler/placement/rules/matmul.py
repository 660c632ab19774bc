"""Matrix products, written as einsum equations: every index either stays or is contracted.

For an equation such as ``mk,kn->mn`` (``mm``) the strategies are: all replicated;
for each output index, every operand that has it sharded on it (``m``: the
first operand's rows, the output's rows); for each contracted index, both
operands sharded on it and the output a partial sum (``k``: Megatron's
row-parallel product); and one operand partial with the others replicated.
``addmm``'s bias is added to the product, so it follows the output as a
broadcast elementwise argument would, partial when the product is.
"""

from __future__ import annotations

import torch

from ..placements import PARTIAL, REPLICATE, Partial, Shard
from ..strategy import OpCall, Strategy

aten = torch.ops.aten

EQUATIONS = {
    aten.mm.default: "mk,kn->mn",
    aten.bmm.default: "bmk,bkn->bmn",
    aten.dot.default: "k,k->",
    aten.mv.default: "mk,k->m",
}
WITH_BIAS = {aten.addmm.default: "mk,kn->mn", aten.baddbmm.default: "bmk,bkn->bmn"}


def einsum_strategies(equation: str, n: int, shapes) -> list[Strategy]:
    """The strategies of a product ``equation`` over operands of logical ``shapes``."""
    operands, out = equation.split("->")
    operands = operands.split(",")
    size = {i: s for op, shape in zip(operands, shapes) for i, s in zip(op, shape)}
    strategies = [Strategy(tuple(REPLICATE for _ in operands), (REPLICATE,))]
    for index in dict.fromkeys("".join(operands)):
        if size[index] % n or size[index] == 1:
            continue
        inputs = tuple(Shard(op.index(index)) if index in op else REPLICATE for op in operands)
        output = Shard(out.index(index)) if index in out else PARTIAL
        strategies.append(Strategy(inputs, (output,)))
    for k in range(len(operands)):
        strategies.append(Strategy(tuple(PARTIAL if i == k else REPLICATE for i in range(len(operands))),
                                   (PARTIAL,)))
    return strategies


def matmul_strategies(call: OpCall) -> list[Strategy]:
    return einsum_strategies(EQUATIONS[call.node.target], call.n, call.shapes)


def addmm_strategies(call: OpCall) -> list[Strategy]:
    """``bias + a @ b``: the product's strategies, the bias placed as a broadcast summand of the output."""
    bias_shape, *operand_shapes = call.shapes
    out = call.out_shapes[0]
    strategies = []
    for s in einsum_strategies(WITH_BIAS[call.node.target], call.n, operand_shapes):
        (output,) = s.outputs
        if isinstance(output, Partial):
            bias = PARTIAL  # a replicated bias becomes one on coordinate 0 and zeros elsewhere, for free
        elif isinstance(output, Shard):
            own = output.dim - (len(out) - len(bias_shape))
            bias = Shard(own) if own >= 0 and bias_shape[own] == out[output.dim] else REPLICATE
        else:
            bias = REPLICATE
        strategies.append(Strategy((bias,) + s.inputs, s.outputs))
    return strategies
