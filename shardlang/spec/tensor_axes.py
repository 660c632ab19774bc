"""Tensor axes: the mesh axes that split parameters and activations instead of the batch.

A mesh axis named ``tp`` is a tensor axis (tensor parallelism); every other axis
is a data axis, which splits the batch and over which FSDP shards. A rule's
layout is one layout or a tuple of per-axis layouts, applied in order::

    (shard("tp", dim=0), shard("fsdp"))     # tp splits dim 0; fsdp shards each tp rank's block, flat
    shard("tp", dim=1)                       # split on tp, replicated over the data axes
    shard("fsdp")                            # sharded over fsdp, replicated over tp

A tensor axis splits a dim (``dim=`` is required) and comes first in a tuple:
the data axes shard what each tensor rank holds. An axis appears once.

Example::

    >>> from shardlang.spec.layout import shard
    >>> split_layout((shard("tp", dim=0), shard("fsdp")), ("fsdp", "tp"), "rules[0]")
    (shard('fsdp'), {'tp': shard('tp', dim=0)})
"""

from __future__ import annotations

from collections.abc import Sequence

from shardlang.errors import SpecError
from shardlang.spec.layout import Layout, Replicate, Shard, replicate

__all__ = ["TENSOR_AXES", "default_data_axis", "is_tensor_axis", "split_layout"]

TENSOR_AXES = frozenset({"tp"})
"""The axis names that are tensor axes."""


def is_tensor_axis(name: str) -> bool:
    """Whether mesh axis ``name`` splits tensors rather than the batch. Example: ``is_tensor_axis("tp")``."""
    return name in TENSOR_AXES


def split_layout(layout: Layout | tuple[Layout, ...], axes: Sequence[str],
                 where: str) -> tuple[Layout, dict[str, Shard]]:
    """A rule's layout as (its layout over the data axes, {tensor axis: its shard there}).

    ``axes`` are the mesh's axis names; ``where`` names the rule in errors. A
    tensor axis left out replicates; so does a data layout left out.
    """
    layouts = layout if isinstance(layout, tuple) else (layout,)
    data: list[Layout] = []
    tensor: dict[str, Shard] = {}
    seen: set[str] = set()
    for i, one in enumerate(layouts):
        if isinstance(one, Replicate):
            if len(layouts) > 1:
                raise SpecError(f"{where}: layout {layout!r} has replicate() at position {i}; in a tuple of "
                                "per-axis layouts every entry shards over an axis, and an axis left out replicates")
            data.append(one)
            continue
        if one.axis not in axes:
            raise SpecError(f"{where}: layout {one!r} shards over axis {one.axis!r}, which is not an axis of the "
                            f"mesh; valid axes are {list(axes)}")
        if one.axis in seen:
            raise SpecError(f"{where}: layout {layout!r} names axis {one.axis!r} twice; give each axis once")
        seen.add(one.axis)
        if is_tensor_axis(one.axis):
            if one.dim is None:
                raise SpecError(f"{where}: {one!r} needs a dim: a tensor axis splits one dim of the parameter, "
                                f"e.g. shard({one.axis!r}, dim=0) for a column-parallel linear's weight")
            if data:
                raise SpecError(f"{where}: layout {layout!r} puts tensor axis {one.axis!r} after {data[-1]!r}; "
                                f"write it first, e.g. ({one!r}, {data[-1]!r}): the data axes shard what each "
                                f"{one.axis!r} rank holds")
            tensor[one.axis] = one
        else:
            if data:
                raise SpecError(f"{where}: layout {layout!r} shards over two data axes ({data[-1]!r} and {one!r}); "
                                "a parameter is sharded over one data axis and replicated over the others")
            data.append(one)
    return (data[0] if data else replicate()), tensor


def default_data_axis(axes: Sequence[str]) -> str:
    """The axis the default rule shards over: the last data axis. Example: ``("fsdp", "tp") -> "fsdp"``."""
    data = [a for a in axes if not is_tensor_axis(a)]
    if not data:
        raise SpecError(f"the mesh's axes {list(axes)} are all tensor axes; add a data axis, "
                        "e.g. Mesh(fsdp=-1, tp=2) (a mesh of one rank per data axis is fine: fsdp=1)")
    return data[-1]

