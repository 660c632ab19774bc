"""The loss on logits split by vocabulary: log-softmax and negative log-likelihood on shards (loss parallelism).

Note [loss parallelism]: with the output head column-parallel, the logits come
out split on the vocabulary over tp. Without loss parallelism the loss needs
them whole, and they are gathered: ``b*s*V`` elements a rank, ``(1 - 1/tp)`` of
them moved and held. With it (``OpCall.loss_parallel``), each rank works on its
block, and only per-row numbers cross the axis:

- ``_log_softmax`` over the split dim: the rows' max (the n ranks' maxima
  gathered, then their max: a max is exact however it is taken) and the rows'
  sum of exponentials (an all-reduce) make the log-sum-exp every rank subtracts;
- its backward: ``grad - exp(out) * sum(grad)``, the sum all-reduced;
- ``nll_loss_forward``: each rank picks the targets that fall in its rows (the
  others become ``ignore_index``), so the loss is a partial sum, divided by the
  whole batch's count of targets for a mean;
- ``nll_loss_backward``: the same masked targets, with the whole count as
  ``total_weight``, put each row's gradient on the rank that holds its target.

Every other reader of the log-probabilities sees them as the `Shard` they are,
so it stays exact (what DTensor's ``loss_parallel`` context gets wrong for other
users of ``log_softmax``, pytorch#190746). Class weights have no such strategy:
with them the logits are gathered.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ...ir.tags import LOGITS_NEVER_GATHERED
from ..placements import PARTIAL, REPLICATE, Shard
from ..strategy import OpCall, Strategy
from .nn import replicated, softmax_strategies, vocabulary_block
from .views import _dim

aten = torch.ops.aten

_MEAN, _NONE = 1, 0  # torch's reduction enum: none 0, mean 1, sum 2


def log_softmax_strategies(call: OpCall) -> list[Strategy]:
    """``_log_softmax`` and its backward: shards of the other dims; with loss parallelism, of the normalised one."""
    strategies = softmax_strategies(call)
    shape = call.shapes[0]
    forward = call.node.target is aten._log_softmax.default
    dim = _dim(call.node.args[1] if forward else call.node.args[2], len(shape))
    if call.loss_parallel and shape[dim] % call.n == 0 and shape[dim] > 1:
        lower = _log_softmax_of_blocks(dim) if forward else _log_softmax_backward_of_blocks(dim)
        strategies.append(Strategy(tuple(Shard(dim) for _ in call.shapes), (Shard(dim),), lower=lower))
    return strategies


def _log_softmax_of_blocks(dim: int):
    def lower(low, args: tuple) -> fx.Node:
        x = args[0]
        row_max = low.max(low.call(aten.amax.default, x, [dim], True), "the logits' row maxima")
        shifted = low.call(aten.sub.Tensor, x, row_max)
        exp_sum = low.call(aten.sum.dim_IntList, low.call(aten.exp.default, shifted), [dim], True)
        total = low.sum(exp_sum, "the logits' row sums of exponentials")
        return low.call(aten.sub.Tensor, shifted, low.call(aten.log.default, total))
    return lower


def _log_softmax_backward_of_blocks(dim: int):
    def lower(low, args: tuple) -> fx.Node:
        grad, out = args[0], args[1]
        total = low.sum(low.call(aten.sum.dim_IntList, grad, [dim], True), "the log-softmax gradient's row sums")
        return low.call(aten.sub.Tensor, grad, low.call(aten.mul.Tensor, low.call(aten.exp.default, out), total))
    return lower


def _splittable(call: OpCall, logp: fx.Node, weight: object) -> bool:
    """Whether an NLL call can take its log-probabilities split on the classes: 2-D, no class weights."""
    shape = tuple(logp.meta["val"].shape)
    return (call.loss_parallel and weight is None and len(shape) == 2 and shape[1] % call.n == 0
            and all(a is logp or a.meta["val"].dim() <= 1 for a in call.leaves))


def nll_forward_strategies(call: OpCall) -> list[Strategy]:
    """``nll_loss_forward(logp, target, weight, reduction, ignore_index)``: whole; or on class blocks, partial."""
    strategies = [replicated(call)]
    logp = call.node.args[0]
    if _splittable(call, logp, call.node.args[2]):
        inputs = tuple(Shard(1) if a is logp else REPLICATE for a in call.leaves)
        strategies.append(Strategy(inputs, (PARTIAL, REPLICATE), lower=_nll_of_blocks(call)))
    return strategies


def _nll_of_blocks(call: OpCall):
    logp = call.node.args[0]
    (rows, classes), dtype = logp.meta["val"].shape, logp.meta["val"].dtype
    reduction, ignore_index = call.node.args[3], call.node.args[4]
    # what gathering the logits would have moved and held: b*s*V*(1 - 1/n) elements a rank (Note [loss parallelism])
    never_gathered = rows * (classes // call.n) * (call.n - 1) * logp.meta["val"].element_size()

    def lower(low, args: tuple) -> tuple[fx.Node, fx.Node]:
        local_logp, target = args[0], args[1]
        _inside, local = vocabulary_block(low, target, classes, outside=ignore_index)
        nll = low.call(aten.nll_loss_forward.default, local_logp, local, None, _NONE, ignore_index)
        nll.meta[LOGITS_NEVER_GATHERED] = never_gathered  # the plan's line (`Schedule.logits_never_gathered`)
        each = low.call(operator.getitem, nll, 0)
        counted = low.call(aten.sum.default, low.call(aten.ne.Scalar, target, ignore_index))
        total = low.call(aten._to_copy.default, counted, dtype=dtype)
        if reduction == _NONE:
            return each, total
        summed = low.call(aten.sum.default, each)
        return (low.call(aten.div.Tensor, summed, total) if reduction == _MEAN else summed), total
    return lower


def nll_backward_strategies(call: OpCall) -> list[Strategy]:
    """``nll_loss_backward(grad, logp, target, weight, reduction, ignore_index, total_weight)``, on class blocks."""
    strategies = [replicated(call)]
    logp = call.node.args[1]
    if _splittable(call, logp, call.node.args[3]):
        inputs = tuple(Shard(1) if a is logp else REPLICATE for a in call.leaves)
        strategies.append(Strategy(inputs, (Shard(1),), lower=_nll_backward_of_blocks(call)))
    return strategies


def _nll_backward_of_blocks(call: OpCall):
    classes = call.node.args[1].meta["val"].shape[1]
    reduction, ignore_index = call.node.args[4], call.node.args[5]

    def lower(low, args: tuple) -> fx.Node:
        grad, local_logp, target, total = args[0], args[1], args[2], args[6]
        _inside, local = vocabulary_block(low, target, classes, outside=ignore_index)
        return low.call(aten.nll_loss_backward.default, grad, local_logp, local, None, reduction, ignore_index, total)
    return lower


LOSS_RULES = {
    aten._log_softmax.default: log_softmax_strategies,
    aten._log_softmax_backward_data.default: log_softmax_strategies,
    aten.nll_loss_forward.default: nll_forward_strategies,
    aten.nll_loss_backward.default: nll_backward_strategies,
}
