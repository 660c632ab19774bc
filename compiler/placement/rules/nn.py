"""The ops of networks: reductions, softmax, norms, embedding, attention.

Each has the all-replicated strategy, plus the shards it keeps exact: a
reduction keeps a shard of a dim it does not reduce, and a ``sum`` over a
sharded dim gives a partial sum; softmax and norms keep shards of the dims they
do not normalise over; attention keeps a shard of the batch or of the heads (the
product of a column-parallel projection); an embedding keeps a shard of its
feature dim, or looks up in a shard of its vocabulary (Note
[vocabulary-parallel lookup]). The loss is `compiler.placement.rules.loss`'s.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..placements import PARTIAL, REPLICATE, Shard
from ..strategy import OpCall, Strategy
from .views import _dim

aten = torch.ops.aten


def replicated(call: OpCall) -> Strategy:
    """The strategy every op has: all arguments and outputs whole on every rank."""
    return Strategy(tuple(REPLICATE for _ in call.placements), tuple(REPLICATE for _ in call.out_shapes))


def _reduced_dims(call: OpCall, ndim: int) -> tuple[list[int], bool]:
    args = call.node.args
    whole = call.node.target in (aten.sum.default, aten.mean.default)
    if whole or len(args) < 2 or args[1] is None or args[1] == []:
        return list(range(ndim)), False
    dims = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
    keepdim = bool(args[2]) if len(args) > 2 else bool(call.node.kwargs.get("keepdim", False))
    return sorted({_dim(d, ndim) for d in dims}), keepdim


def reduction_strategies(call: OpCall) -> list[Strategy]:
    """``sum`` and ``mean`` over dims: a shard of a kept dim stays; ``sum`` over a sharded dim is partial."""
    (source,) = call.shapes
    reduced, keepdim = _reduced_dims(call, len(source))
    sums = call.node.target in (aten.sum.dim_IntList, aten.sum.default)
    strategies = [replicated(call), Strategy((PARTIAL,), (PARTIAL,))]
    for d in range(len(source)):
        if source[d] % call.n or source[d] == 1:
            continue
        if d in reduced:
            if sums:
                strategies.append(Strategy((Shard(d),), (PARTIAL,)))
            continue
        out = d if keepdim else d - sum(r < d for r in reduced)
        strategies.append(Strategy((Shard(d),), (Shard(out),)))
    return strategies


def _batch_dims_strategies(call: OpCall, free_dims: range, outputs) -> list[Strategy]:
    """Every tensor argument of the source's rank sharded on ``d`` for each free dim ``d``; others replicated."""
    shapes = call.shapes
    ndim = len(shapes[0])
    strategies = [replicated(call)]
    for d in free_dims:
        if shapes[0][d] % call.n or shapes[0][d] == 1:
            continue
        inputs = tuple(Shard(d) if len(s) == ndim and s[d] == shapes[0][d] else REPLICATE for s in shapes)
        strategies.append(Strategy(inputs, outputs(d)))
    return strategies


def softmax_strategies(call: OpCall) -> list[Strategy]:
    """``_softmax`` / ``_log_softmax`` and their backwards: shards of the other dims."""
    ndim = len(call.shapes[0])
    at = _dim(call.node.args[1] if call.node.target in (aten._softmax.default, aten._log_softmax.default)
              else call.node.args[2], ndim)
    return _batch_dims_strategies(call, [d for d in range(ndim) if d != at], lambda d: (Shard(d),))


def layer_norm_strategies(call: OpCall) -> list[Strategy]:
    """``native_layer_norm``: shards of the dims before the normalised ones, for the output, mean and rstd."""
    ndim = len(call.shapes[0])
    normalized = len(call.node.args[1])
    return _batch_dims_strategies(call, range(ndim - normalized), lambda d: (Shard(d), Shard(d), Shard(d)))


def layer_norm_backward_strategies(call: OpCall) -> list[Strategy]:
    """``native_layer_norm_backward``: the input's gradient keeps the shard; weight and bias gradients are partial."""
    ndim = len(call.shapes[0])
    normalized = len(call.node.args[2])
    n_out = len(call.out_shapes)
    return _batch_dims_strategies(call, range(ndim - normalized),
                                  lambda d: (Shard(d),) + (PARTIAL,) * (n_out - 1))


def attention_strategies(call: OpCall) -> list[Strategy]:
    """Scaled dot-product attention, forward and backward: every ``(b, h, s, d)`` tensor sharded on b or on h."""
    outs = call.out_shapes
    shapes = call.shapes
    strategies = [replicated(call)]
    for d in (0, 1):
        if any(len(s) >= 3 and s[d] > 1 and s[d] % call.n for s in shapes):
            continue
        inputs = tuple(Shard(d) if len(s) >= 3 and s[d] > 1 else REPLICATE for s in shapes)
        outputs = tuple(Shard(d) if o is not None and len(o) >= 2 and o[d] > 1 else REPLICATE for o in outs)
        strategies.append(Strategy(inputs, outputs))
    return strategies


def vocabulary_block(low, indices: fx.Node, vocabulary: int, outside=0):
    """(whether each index falls in this rank's rows, the index within them, ``outside`` where it does not).

    ``low`` is the `compiler.placement.localize.Lowering` of the call.
    """
    shifted = low.call(aten.sub.Tensor, indices, low.first_row(vocabulary))
    inside = low.call(aten.logical_and.default, low.call(aten.ge.Scalar, shifted, 0),
                      low.call(aten.lt.Scalar, shifted, vocabulary // low.n))
    return inside, low.call(aten.where.self, inside, shifted, low.call(aten.full_like.default, shifted, outside))


def _lookup_in_vocabulary_block(vocabulary: int):
    """Note [vocabulary-parallel lookup]: each rank looks up the tokens in its rows and zeros the others.

    The sum over the axis of those partial lookups is the lookup in the whole
    table (Megatron's vocabulary-parallel embedding): the result is `Partial`, and
    the reduction the next op needs (an all-reduce, or a reduce-scatter under
    sequence parallelism) is propagation's as anywhere else.
    """
    def lower(low, args: tuple) -> fx.Node:
        weight, indices = args[0], args[1]
        inside, local = vocabulary_block(low, indices, vocabulary)
        looked_up = low.call(aten.embedding.default, weight, local)
        return low.call(aten.mul.Tensor, looked_up, low.call(aten.unsqueeze.default, inside, -1))
    return lower


def _gradient_of_vocabulary_block(vocabulary: int):
    """The backward of Note [vocabulary-parallel lookup]: this rank's rows' gradient, from its tokens alone."""
    def lower(low, args: tuple) -> fx.Node:
        grad, indices = args[0], args[1]
        inside, local = vocabulary_block(low, indices, vocabulary)
        masked = low.call(aten.mul.Tensor, grad, low.call(aten.unsqueeze.default, inside, -1))
        return low.call(aten.embedding_dense_backward.default, masked, local, vocabulary // low.n, -1, False)
    return lower


def _plain_lookup(call: OpCall, padding_at: int) -> bool:
    """Whether a lookup has no padding row and no frequency scaling: what a vocabulary block can take exactly."""
    args = call.node.args
    padding = args[padding_at] if len(args) > padding_at else call.node.kwargs.get("padding_idx", -1)
    scale = args[padding_at + 1] if len(args) > padding_at + 1 else call.node.kwargs.get("scale_grad_by_freq", False)
    return padding == -1 and not scale


def embedding_strategies(call: OpCall) -> list[Strategy]:
    """``embedding(weight, indices)``: a shard of the feature dim, of the indices' dims, or of the vocabulary."""
    weight, indices = call.shapes
    out = call.out_shapes[0]
    strategies = [replicated(call)]
    if weight[0] % call.n == 0 and _plain_lookup(call, 2):
        strategies.append(Strategy((Shard(0), REPLICATE), (PARTIAL,), lower=_lookup_in_vocabulary_block(weight[0])))
    if weight[1] % call.n == 0:
        strategies.append(Strategy((Shard(1), REPLICATE), (Shard(len(out) - 1),)))
    for d in range(len(indices)):
        if indices[d] % call.n == 0 and indices[d] > 1:
            strategies.append(Strategy((REPLICATE, Shard(d)), (Shard(d),)))
    return strategies


def embedding_backward_strategies(call: OpCall) -> list[Strategy]:
    """``embedding_dense_backward(grad, indices, num_weights, ...)``: feature shards, or a partial sum over rows."""
    grad, indices = call.shapes
    strategies = [replicated(call), Strategy((PARTIAL, REPLICATE), (PARTIAL,))]
    vocabulary = call.node.args[2]
    if vocabulary % call.n == 0 and _plain_lookup(call, 3):
        strategies.append(Strategy((REPLICATE, REPLICATE), (Shard(0),),
                                   lower=_gradient_of_vocabulary_block(vocabulary)))
    if grad[-1] % call.n == 0:
        strategies.append(Strategy((Shard(len(grad) - 1), REPLICATE), (Shard(1),)))
    for d in range(len(indices)):
        if indices[d] % call.n == 0 and indices[d] > 1:
            strategies.append(Strategy((Shard(d), Shard(d)), (PARTIAL,)))
    return strategies


NN_RULES = {
    aten.sum.dim_IntList: reduction_strategies,
    aten.sum.default: reduction_strategies,
    aten.mean.dim: reduction_strategies,
    aten.mean.default: reduction_strategies,
    aten._softmax.default: softmax_strategies,
    aten._softmax_backward_data.default: softmax_strategies,
    aten.native_layer_norm.default: layer_norm_strategies,
    aten.native_layer_norm_backward.default: layer_norm_backward_strategies,
    aten._scaled_dot_product_flash_attention_for_cpu.default: attention_strategies,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: attention_strategies,
    aten.embedding.default: embedding_strategies,
    aten.embedding_dense_backward.default: embedding_backward_strategies,
}
