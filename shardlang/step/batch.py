"""Batches: splitting a global batch across ranks and checking a per-rank batch.

A batch is a tensor or any pytree (tuple, list, dict) of tensors; every leaf is
split along dim 0. The batch a compiled step takes is the *per-rank* batch:
``global_batch_size / world_size`` rows.
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from ..errors import ShardlangRuntimeError, SpecError


def split_batch(global_batch, world_size: int, rank: int):
    """Rank ``rank``'s rows of ``global_batch`` (dim 0 of every leaf, in rank order).

    Example: a ``(16, 8)`` batch over 4 ranks gives rank 1 rows ``4:8``.
    Raises `ShardlangRuntimeError` when a leaf's batch size does not divide by ``world_size``.
    """
    leaves, spec = pytree.tree_flatten(global_batch)
    parts = []
    for index, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
            raise ShardlangRuntimeError(
                f"batch leaf {index} is {type(leaf).__name__}{'' if not isinstance(leaf, torch.Tensor) else ' 0-d'}; "
                "every leaf of a batch must be a tensor with a batch dim 0"
            )
        size = leaf.shape[0]
        if size == 0:
            raise ShardlangRuntimeError(
                f"global batch leaf {index} has 0 rows (shape {tuple(leaf.shape)}); a batch needs at least one row "
                f"per rank, so a multiple of world size {world_size} rows")
        if size % world_size:
            raise ShardlangRuntimeError(
                f"global batch size {size} (batch leaf {index}, shape {tuple(leaf.shape)}) does not divide by "
                f"world size {world_size}; use a multiple of {world_size}, e.g. {size - size % world_size or world_size}"
            )
        per_rank = size // world_size
        parts.append(leaf[rank * per_rank : (rank + 1) * per_rank])
    return pytree.tree_unflatten(parts, spec)


def check_example_batch(batch) -> None:
    """Every leaf of a compile's ``example_batch`` is a tensor: shapes and dtypes are compiled from it.

    Example: ``check_example_batch((x, 3))`` raises, naming leaf 1 and its value.
    """
    leaves, _ = pytree.tree_flatten(batch)
    if not leaves:
        raise SpecError(f"example_batch {batch!r} has no tensors; give a per-rank batch: a tensor, or a tuple, "
                        "list or dict of tensors")
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            if leaf.dim() >= 1 and leaf.shape[0] == 0:
                raise SpecError(f"example_batch leaf {index} has 0 rows (shape {tuple(leaf.shape)}); the step is "
                                "compiled for a per-rank batch of at least one row")
            continue
        hint = "; convert it with torch.from_numpy" if type(leaf).__module__ == "numpy" else ""
        text = repr(leaf)
        raise SpecError(f"example_batch leaf {index} is {type(leaf).__name__} "
                        f"{text if len(text) <= 40 else text[:37] + '...'}, not a torch.Tensor{hint}; every leaf "
                        "of a batch must be a tensor (a tuple, list or dict of tensors is a batch)")


def batch_leaves(batch, expected: tuple[tuple[tuple[int, ...], torch.dtype], ...], device: torch.device) -> list:
    """The leaves of a per-rank ``batch``, checked against the shapes the step was compiled for."""
    leaves, _ = pytree.tree_flatten(batch)
    if len(leaves) != len(expected):
        raise ShardlangRuntimeError(
            f"the batch has {len(leaves)} tensors; the step was compiled for {len(expected)} "
            "(same structure as the example batch given to compile)"
        )
    out = []
    for index, (leaf, (shape, dtype)) in enumerate(zip(leaves, expected)):
        if not isinstance(leaf, torch.Tensor) or tuple(leaf.shape) != shape or leaf.dtype != dtype:
            got = f"shape {tuple(leaf.shape)}, {leaf.dtype}" if isinstance(leaf, torch.Tensor) else type(leaf).__name__
            raise ShardlangRuntimeError(
                f"batch leaf {index} has {got}; the step was compiled for shape {shape}, {dtype} per rank "
                "(the per-rank batch is the global batch divided by the world size)"
            )
        out.append(leaf.to(device, non_blocking=True))
    return out
