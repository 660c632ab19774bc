"""Plain data the compiler consumes: where each parameter lives and what unit it belongs to.

The front end (`shardlang.spec`) turns a user's spec and model into a tuple of
`ParamInfo`; the compiler never sees the spec syntax itself. This keeps the
dependency one-way (shardlang -> compiler) and lets the compiler be tested with
hand-built placements.
"""

from __future__ import annotations

import enum

import attrs
import torch


class LayoutKind(enum.Enum):
    """How a parameter is laid out over one mesh axis."""

    SHARD_FLAT = "shard_flat"  # flattened, padded to a multiple of N, split into N equal chunks
    SHARD_DIM = "shard_dim"  # split along one tensor dim, padded so the dim divides by N
    REPLICATE = "replicate"  # every rank holds the whole tensor


@attrs.frozen
class Placement:
    """A parameter's layout: its kind, the mesh axis it is sharded over, and the dim.

    Example: ``Placement(LayoutKind.SHARD_DIM, axis="fsdp", dim=0)``.
    """

    kind: LayoutKind
    axis: str | None = None
    dim: int | None = None

    @property
    def is_sharded(self) -> bool:
        return self.kind is not LayoutKind.REPLICATE


@attrs.frozen
class ParamInfo:
    """One parameter as the compiler sees it (tied parameters appear once, by first name).

    ``dim`` in a SHARD_DIM placement is already normalised to be non-negative.
    """

    name: str
    shape: tuple[int, ...] = attrs.field(converter=tuple)
    dtype: torch.dtype
    trainable: bool
    unit: str
    placement: Placement

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@attrs.frozen
class MeshShape:
    """An abstract mesh: axis names and sizes, in order, with no process groups bound.

    Example: ``MeshShape((("fsdp", 4),))``.
    """

    axes: tuple[tuple[str, int], ...] = attrs.field(converter=lambda a: tuple((str(n), int(s)) for n, s in a))

    @property
    def size(self) -> int:
        n = 1
        for _, s in self.axes:
            n *= s
        return n

    def axis_size(self, name: str) -> int:
        return dict(self.axes)[name]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.axes)
