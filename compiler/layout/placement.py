"""Plain data the compiler consumes: where each parameter lives and what unit it belongs to.

The front end (`shardlang.spec.spec`) turns a user's spec and model into a tuple of
`ParamInfo`; the compiler never sees the spec syntax itself. This keeps the
dependency one-way (shardlang -> compiler) and lets the compiler be tested with
hand-built placements.
"""

from __future__ import annotations

import enum

import attrs
import torch

from shardlang.spec.vocabulary import Strategy




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
    ``strategy`` is its unit's strategy; None leaves it to `compile_step`'s
    default (ZERO3, or ZERO2 without ``reshard_after_forward``).
    """

    name: str
    shape: tuple[int, ...] = attrs.field(converter=tuple)
    dtype: torch.dtype
    trainable: bool
    unit: str
    placement: Placement
    strategy: Strategy | None = None
    tensor_sharded: bool = False  # split over a tensor axis: ``shape`` is then this tensor rank's block

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

    def coordinate(self, rank: int) -> dict[str, int]:
        """Rank ``rank``'s coordinate on each axis, row-major (the last axis varies fastest).

        Example: on ``MeshShape((("replicate", 2), ("fsdp", 2)))`` rank 1 is ``{"replicate": 0, "fsdp": 1}``.
        """
        coords = {}
        for name, size in reversed(self.axes):
            coords[name] = rank % size
            rank //= size
        return {name: coords[name] for name in self.names}

    def group_key(self, axes) -> str:
        """The name of the group over ``axes`` (in mesh order): ``"fsdp"``, ``"a+b"``; ``"*"`` for every axis."""
        chosen = [n for n in self.names if n in set(axes)]
        return WORLD if len(chosen) == len(self.axes) else "+".join(chosen)

    def complement(self, axis: str) -> str:
        """The group key of every axis but ``axis``: the ranks that hold the same shard (hybrid sharding)."""
        return self.group_key([n for n in self.names if n != axis])

    def group_axes(self, key: str) -> tuple[str, ...]:
        """The axes a group key spans. Example: ``group_axes("*")`` is every axis."""
        return self.names if key == WORLD else tuple(key.split("+"))

    def group_size(self, key: str) -> int:
        n = 1
        for name in self.group_axes(key):
            n *= self.axis_size(name)
        return n

    def groups(self, key: str) -> list[list[int]]:
        """Every group of ranks over ``key``'s axes (the others fixed), each in rank order, in order of first rank.

        Example: for ``replicate=2 x fsdp=2``, ``groups("fsdp") == [[0, 1], [2, 3]]`` and
        ``groups("replicate") == [[0, 2], [1, 3]]``.
        """
        spans = set(self.group_axes(key))
        found: dict[tuple, list[int]] = {}
        for rank in range(self.size):
            coord = self.coordinate(rank)
            fixed = tuple(coord[n] for n in self.names if n not in spans)
            found.setdefault(fixed, []).append(rank)
        return list(found.values())


WORLD = "*"
"""The group key of every rank (replicated gradients, BatchNorm statistics)."""
