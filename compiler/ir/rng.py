"""Random numbers in the step: which generator each rank draws from, and exact global dropout masks.

The traced step draws random numbers (dropout's ``bernoulli_``) with aten ops
that read the default generator of their device when the graph runs. The
runtime (`shardlang.step.step`) therefore swaps in a generator state of its own
around every call of the graph, seeded from the spec (`RandomScheme`):

- ``PER_RANK``: rank r's state starts from ``per_rank_seed(seed, r)``; each rank
  draws its own masks for its own rows, as under DDP.
- ``GLOBAL``: every rank's state starts from ``seed``, and every
  ``F.dropout`` is traced by `GlobalDropout` as: the noise of the *global*
  batch, drawn by ``F.dropout`` itself on a tensor of ones of the global shape
  (dim 0 times the data-parallel size), of which this rank keeps its own block
  of rows (`data_rank` picks it when the graph runs). One process that calls
  ``torch.manual_seed(seed)`` and trains on the global batch draws the very
  same noise, so the masks are bitwise equal. It assumes dim 0 of a dropout's
  input is batch-major (rank r's rows are block r of dim 0, as `split_batch`
  cuts them); it costs each rank the random numbers and the mask memory of the
  global batch. Any other random op would draw the same numbers on every
  rank, so `check_random_ops` refuses it.

Either way the user's own generator is untouched by a step, and a step's
masks do not depend on what else the program draws.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode

from shardlang.errors import TraceError
from .provenance import site_of_node


@torch.library.custom_op("shardlang::data_rank", mutates_args=())
def data_rank(like: torch.Tensor, world: int) -> torch.Tensor:
    """This rank's index along the data-parallel dimension, as a ``(1,)`` int64 tensor on ``like``'s device.

    A graph node (not a constant), so one graph serves every rank: it reads the
    rank when the step runs (0 without a process group).
    """
    rank = dist.get_rank() if world > 1 and dist.is_available() and dist.is_initialized() else 0
    return torch.full((1,), rank, dtype=torch.int64, device=like.device)


@data_rank.register_fake
def _(like, world):
    return torch.empty((1,), dtype=torch.int64, device=like.device)


#: ``meta["custom"]`` key on the nodes `GlobalDropout` emits.
GLOBAL_DROPOUT = "global_dropout"


class GlobalDropout(TorchFunctionMode):
    """While active, ``F.dropout`` in training draws the global batch's noise and keeps this rank's rows."""

    def __init__(self, world: int):
        super().__init__()
        self.world = world

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            x, p, training, inplace = _bind_dropout_args(*args, **kwargs)
            if training and p > 0 and x.dim() > 0:
                with fx_traceback.annotate({GLOBAL_DROPOUT: True}):
                    return self._dropout(x, p, inplace)
        return func(*args, **kwargs)

    def _dropout(self, x: torch.Tensor, p: float, inplace: bool) -> torch.Tensor:
        rows = x.shape[0]
        ones = torch.ones((rows * self.world, *x.shape[1:]), dtype=x.dtype, device=x.device)
        noise = F.dropout(ones, p, True)  # exactly the draw one process makes on the global batch
        mine = noise.view(self.world, rows, *x.shape[1:]).index_select(0, data_rank(x, self.world)).view(x.shape)
        return x.mul_(mine) if inplace else x * mine


def _bind_dropout_args(input, p=0.5, training=True, inplace=False):
    return input, p, training, inplace


def is_random(node: fx.Node) -> bool:
    """Whether ``node`` draws from a generator when the graph runs."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if any(a.name == "dropout_p" for a in target._schema.arguments):  # attention draws only with dropout_p > 0
        return _dropout_p(node) > 0
    return torch.Tag.nondeterministic_seeded in target.tags


def _dropout_p(node: fx.Node) -> float:
    for i, a in enumerate(node.target._schema.arguments):
        if a.name == "dropout_p":
            value = node.kwargs.get("dropout_p", node.args[i] if i < len(node.args) else a.default_value)
            return float(value or 0.0)
    return 0.0


def check_random_ops(gm: fx.GraphModule) -> None:
    """Under `RandomScheme.GLOBAL`, every random op must come from `GlobalDropout` (else all ranks draw alike)."""
    for node in gm.graph.nodes:
        if is_random(node) and not node.meta.get("custom", {}).get(GLOBAL_DROPOUT):
            site = site_of_node(node)
            where = f" at {site}\n" if site else "; "
            raise TraceError(
                f"Options(random='global') draws exact global masks for F.dropout (nn.Dropout) only, but the step "
                f"also draws random numbers with {node.target} (node {node.name}){where}under 'global' every rank "
                "would draw the same numbers for different rows. Use Options(random='per_rank'), where each rank "
                "draws its own, or F.dropout", site=site,
            )


def has_random_ops(gm: fx.GraphModule) -> bool:
    return any(is_random(n) for n in gm.graph.nodes)


# Note [replayed draws]: a recomputed random op must draw exactly what the
# forward drew. The forward op is preceded by `save_rng_state` (a copy of its
# device's generator state, a few KiB on the CPU, 16 bytes on CUDA), and its
# recompute runs through `with_rng_state`, which swaps that state in, draws, and
# puts the current state back: the masks are bitwise the forward's, and the
# generator ends the step where it would have without recompute.

_CPU_STATE_BYTES = 5056  # torch.get_rng_state().numel() for the CPU's Mersenne Twister
_CUDA_STATE_BYTES = 16  # seed and offset of the Philox generator


def save_rng_state(like: torch.Tensor) -> torch.Tensor:
    """A copy of the state of the generator that a random op on ``like``'s device draws from.

    Example: ``state = save_rng_state(x); a = torch.rand(2); with_rng_state(state, torch.ops.aten.rand.default,
    [2])`` gives ``a`` again.
    """
    if isinstance(like, FakeTensor) or like.device.type == "meta":
        size = _CUDA_STATE_BYTES if like.device.type == "cuda" else _CPU_STATE_BYTES
        return torch.empty((size,), dtype=torch.uint8, device="cpu")
    if like.device.type == "cuda":
        return torch.cuda.get_rng_state(like.device)
    return torch.get_rng_state()


def with_rng_state(state: torch.Tensor, op, *args, **kwargs):
    """``op(*args, **kwargs)`` drawn from the generator state ``state`` (`save_rng_state`); the current state is kept.

    The generator is that of the device of the op's first tensor argument (or
    its ``device`` keyword). On fake tensors (planning) it only runs ``op``.
    """
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if any(isinstance(t, FakeTensor) or t.device.type == "meta" for t in tensors):
        return op(*args, **kwargs)
    device = tensors[0].device if tensors else torch.device(kwargs.get("device") or "cpu")
    if device.type == "cuda":
        current = torch.cuda.get_rng_state(device)
        torch.cuda.set_rng_state(state, device)
        try:
            return op(*args, **kwargs)
        finally:
            torch.cuda.set_rng_state(current, device)
    current = torch.get_rng_state()
    torch.set_rng_state(state)
    try:
        return op(*args, **kwargs)
    finally:
        torch.set_rng_state(current)
