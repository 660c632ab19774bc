"""After `compile`, the step owns the state: the user's module keeps its structure and no storage.

Note [the step owns the state]: `shardlang.compile` hands a rank's trained
bytes to the step's `TrainState` (Note [one state, many graphs]) and then
`release`s the user's module: every parameter and buffer is replaced by a
meta tensor of the same shape, dtype and ``requires_grad`` (tied tensors stay
tied), so a reference to the module kept by the caller costs nothing, and a
forward pre-hook makes calling it on real tensors a `ShardlangRuntimeError`
that says where the weights are. Its weights would be stale anyway: the step
trains its own.

The module stays traceable: the hook lets a call through when its inputs are
fake or meta tensors, or a fake mode is active, which is how the compiler
traces it again (for another batch shape, say) and how ``plan`` runs. A module
built on meta can be compiled again: it is materialised again, to the same
values. One whose real values a step took cannot (`check_not_handed_over`):
those values are gone, and new ones would be a silent change.

`reclaim` undoes it for a small model: real CPU storage again (ties kept), the
hook removed; ``Step.load_into(model)`` calls it before copying the trained
values in.

Example::

    step = sl.compile(model, loss_fn, spec, example_batch=batch)
    model(x)              # ShardlangRuntimeError: the weights are in the step ...
    step.load_into(model)
    model(x)              # the trained model, whole, on this rank
"""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree

from ..errors import ShardlangRuntimeError

_GUARD = "_shardlang_released"  # the attribute that holds the forward pre-hook's handle


def release(model: nn.Module) -> None:
    """Move ``model``'s parameters and buffers to meta (ties kept) and guard its forward (Note [the step owns the state])."""
    had_values = any(not t.is_meta for t in (*model.parameters(), *model.buffers()))
    _replace(model, lambda t: torch.empty_like(t, device="meta"), lambda t: not t.is_meta)
    if getattr(model, _GUARD, None) is None:
        handle = model.register_forward_pre_hook(_refuse_real_inputs, with_kwargs=True)
        object.__setattr__(model, _GUARD, _Released(handle, had_values))


def check_not_handed_over(model: nn.Module) -> None:
    """A module whose values a step took cannot be compiled again: its values would silently be new ones.

    A module built on meta can (it is materialised again, to the same values).
    """
    released = getattr(model, _GUARD, None)
    if released is not None and released.had_values:
        raise ShardlangRuntimeError(
            f"this {type(model).__name__} was already compiled into a step, which took its weights (the module now "
            "holds meta tensors); compile a freshly built model, or first copy a step's weights back with "
            "step.load_into(model)")


def reclaim(model: nn.Module, device: torch.device | str = "cpu") -> None:
    """Give ``model``'s meta tensors real (uninitialised) storage on ``device``, ties kept, and remove the guard."""
    _replace(model, lambda t: torch.empty(t.shape, dtype=t.dtype, device=device), lambda t: t.is_meta)
    released = getattr(model, _GUARD, None)
    if released is not None:
        released.handle.remove()
        object.__setattr__(model, _GUARD, None)


def convert_floating(model: nn.Module, dtype: torch.dtype) -> None:
    """Convert ``model``'s floating parameters and buffers to ``dtype`` in place, ties kept.

    What ``model.to(dtype)`` does, without its tensor swap, which fails on a
    tied parameter made under a fake mode (``plan`` builds there) and on meta
    tensors made under one.
    """
    _replace(model, lambda t: t.to(dtype), lambda t: t.is_floating_point())


def is_released(model: nn.Module) -> bool:
    """Whether ``model`` was handed to a step and holds no storage."""
    return getattr(model, _GUARD, None) is not None


class _Released:
    """What `release` leaves on a module: the guard's hook handle, and whether the module had values."""

    def __init__(self, handle, had_values: bool):
        self.handle = handle
        self.had_values = had_values


def _replace(model: nn.Module, make, wanted) -> None:
    fresh: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for attr, t in table.items():
                if t is None or not wanted(t):
                    continue
                if id(t) not in fresh:
                    data = make(t.detach())
                    fresh[id(t)] = nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) \
                        else data
                table[attr] = fresh[id(t)]


def _refuse_real_inputs(module: nn.Module, args, kwargs):
    leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    if _tracing(leaves):
        return None
    raise ShardlangRuntimeError(
        f"this {type(module).__name__} was compiled into a shardlang step, which owns its weights now: each rank's "
        "shards are in step.state (the module holds meta tensors, and its initial values would be stale). Train "
        "with step(batch); to get the trained model whole on this rank (small models), call step.load_into(model) "
        "on every rank, or step.full_state_dict() for the tensors by name")


def _tracing(leaves: list[torch.Tensor]) -> bool:
    """A call under the compiler's fake tracing (or on meta inputs): the module is only being traced."""
    if any(isinstance(x, FakeTensor) or x.is_meta for x in leaves):
        return True
    from torch._guards import detect_fake_mode

    return detect_fake_mode() is not None
