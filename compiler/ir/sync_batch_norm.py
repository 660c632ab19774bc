"""Batch statistics over the global batch: BatchNorm that computes what one process would.

In training mode BatchNorm normalises with the statistics of the batch it sees.
On N ranks each sees 1/N of the global batch, so without help the sharded step
would compute a different function than one process on the global batch, and
each rank's running statistics would drift apart. shardlang therefore traces
every training-mode ``F.batch_norm`` as a synchronised one (what
``nn.SyncBatchNorm`` does, without swapping modules): the per-channel sums are
all-reduced, twice (mean, then the centred second moment, which avoids the
cancellation of ``E[x^2] - E[x]^2``), and autograd carries the matching
all-reduce of the gradients backward. Running statistics then update from the
global statistics, identically on every rank (replicated buffers).

The collective enters the trace as the custom op ``shardlang::all_reduce_sum``
(make_fx records custom ops, not Python functions); the pass
`passes/split_batch_stat_reductions` turns each into an issued all-reduce and
its wait.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from shardlang.errors import CompileError


@torch.library.custom_op("shardlang::all_reduce_sum", mutates_args=())
def all_reduce_sum(x: torch.Tensor, axis: str, group_size: int) -> torch.Tensor:
    """Sum ``x`` over the ranks of ``axis`` (unbound form; see the module docstring)."""
    if group_size != 1:
        raise CompileError(f"shardlang::all_reduce_sum over {group_size} ranks ran before it was bound to a group")
    return x.clone()


@all_reduce_sum.register_fake
def _(x, axis, group_size):
    return torch.empty_like(x)


def _backward(ctx, grad):
    return torch.ops.shardlang.all_reduce_sum(grad, ctx.axis, ctx.group_size), None, None


def _setup_context(ctx, inputs, output):
    _, ctx.axis, ctx.group_size = inputs


all_reduce_sum.register_autograd(_backward, setup_context=_setup_context)


class SyncBatchNorm(TorchFunctionMode):
    """While active, training-mode ``F.batch_norm`` uses statistics of the batch over all ``group_size`` ranks."""

    def __init__(self, axis: str, group_size: int):
        super().__init__()
        self.axis, self.group_size = axis, group_size

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.batch_norm:
            bound = _bind_batch_norm_args(*args, **kwargs)
            if bound["training"] or bound["running_mean"] is None:
                return self._batch_norm(**bound)
        return func(*args, **kwargs)

    def _batch_norm(self, input, running_mean, running_var, weight, bias, training, momentum, eps):
        channels = input.shape[1]
        dims = [0, *range(2, input.dim())]
        shape = [1, channels] + [1] * (input.dim() - 2)
        total, count = self._sum_and_count(input.sum(dims), input.numel() // channels)
        mean = total / count
        centred = input - mean.view(shape)
        second = torch.ops.shardlang.all_reduce_sum((centred * centred).sum(dims), self.axis, self.group_size)
        var = second / count
        out = centred * torch.rsqrt(var.view(shape) + eps)
        if weight is not None:
            out = out * weight.view(shape)
        if bias is not None:
            out = out + bias.view(shape)
        if running_mean is not None and training:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.detach() * momentum)
                unbiased = var.detach() * _bessel(count)
                running_var.mul_(1 - momentum).add_(unbiased * momentum)
        return out


    def _sum_and_count(self, local_sum: torch.Tensor, local_count: int):
        """The per-channel sum and the element count over every rank (Note [unequal batches]).

        Note [unequal batches]: ranks may hold batches of different sizes in the
        same step (a last partial batch, sequences of other lengths), so the
        count is reduced with the sums, as one extra element of the same
        all-reduce: its bytes depend on the channels alone, never on the batch
        shape, and no collective is added. Sums in a dtype narrower than float32
        (bf16 compute) travel as float32, where counts are exact up to 2**24
        elements per channel; in one process the count stays a Python int.
        """
        if self.group_size == 1:
            return local_sum, local_count
        wire = torch.float32 if local_sum.element_size() < 4 else local_sum.dtype
        packed = torch.cat([local_sum.to(wire), local_sum.new_full((1,), local_count, dtype=wire)])
        reduced = torch.ops.shardlang.all_reduce_sum(packed, self.axis, self.group_size)
        return reduced[:-1].to(local_sum.dtype), reduced[-1].detach()


def _bessel(count) -> torch.Tensor | float:
    """``count / (count - 1)``, the unbiased variance's factor (1 for a single element, as torch's guard)."""
    if isinstance(count, torch.Tensor):
        return count / (count - 1).clamp_min(1)
    return count / max(count - 1, 1)


def _bind_batch_norm_args(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1,
                          eps=1e-5):
    return dict(input=input, running_mean=running_mean, running_var=running_var, weight=weight, bias=bias,
                training=training, momentum=momentum, eps=eps)
