"""What a value of the traced step is on one mesh axis: its placement.

Every value of the logical (unsharded) step has, on each tensor axis of the
mesh, one placement that says what a rank at coordinate ``c`` of ``n`` holds of
the logical value ``x``:

    Replicate()        all of ``x``
    Shard(d)           the ``c``-th of ``n`` equal blocks of ``x`` along dim ``d``
    Partial()          a summand: the ``n`` ranks' values add up to ``x``
    Flattened(s, p)    ``local.reshape(-1)``, where ``local`` is what ``p`` gives of a tensor of shape ``s``
                       (a member parameter or gradient flattened into its flat)
    Packed(flat)       the concatenation of the flat's members, each ``Flattened`` by its own placement
                       (a flat parameter, its optimizer state, its gradient)

These are DTensor's ``Replicate``/``Shard``/``Partial`` plus the two the flat
parameters need: a flat concatenates members of different placements, so its
local value is no block of the logical one. Placements are frozen values; their
repr reads as the constructor call.

Example::

    >>> Shard(0)
    Shard(0)
    >>> local_shape((64, 32), Shard(0), 2)
    (32, 32)
"""

from __future__ import annotations

import math

import attrs

from shardlang.errors import CompileError

__all__ = ["Flattened", "Packed", "Partial", "Placement", "Replicate", "Shard", "local_shape", "REPLICATE",
           "PARTIAL"]


@attrs.frozen(repr=False)
class Replicate:
    """Every rank holds the whole value."""

    def __repr__(self) -> str:
        return "Replicate()"


@attrs.frozen(repr=False)
class Shard:
    """Rank ``c`` holds block ``c`` of ``n`` along ``dim`` (non-negative: placements are canonical)."""

    dim: int = attrs.field()

    @dim.validator
    def _check(self, attribute, value) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CompileError(f"Shard(dim={value!r}): dim must be a non-negative int")

    def __repr__(self) -> str:
        return f"Shard({self.dim})"


@attrs.frozen(repr=False)
class Partial:
    """Each rank holds a summand; the sum over the axis is the value."""

    def __repr__(self) -> str:
        return "Partial()"


@attrs.frozen(repr=False)
class Flattened:
    """``local.reshape(-1)`` of a tensor of ``shape`` placed by ``inner`` (a member's slice of its flat)."""

    shape: tuple[int, ...] = attrs.field(converter=tuple)
    inner: Replicate | Shard | Partial

    def __repr__(self) -> str:
        return f"Flattened({self.shape}, {self.inner!r})"


@attrs.frozen(repr=False)
class Packed:
    """A flat's members, each flattened by its own placement, concatenated in member order."""

    flat: str

    def __repr__(self) -> str:
        return f"Packed({self.flat!r})"


Placement = Replicate | Shard | Partial | Flattened | Packed
REPLICATE = Replicate()
PARTIAL = Partial()


def is_blockwise(p: Placement) -> bool:
    """Whether ``p`` relates the local value to the logical one by shape alone (Replicate, Shard, Partial)."""
    return isinstance(p, (Replicate, Shard, Partial))


def local_shape(shape: tuple[int, ...], placement: Placement, n: int, what: str = "a value") -> tuple[int, ...]:
    """The shape a rank holds of a logical ``shape`` under ``placement`` on an axis of ``n`` ranks.

    A `Shard` needs its dim divisible by ``n``: the error names ``what`` and the sizes.
    Example: ``local_shape((8, 6), Shard(1), 3) == (8, 2)``.
    """
    shape = tuple(shape)
    if isinstance(placement, Shard):
        d = placement.dim
        if d >= len(shape):
            raise CompileError(f"{what}: {placement!r} is out of range for a tensor of shape {list(shape)}")
        if shape[d] % n:
            raise CompileError(f"{what}: dim {d} has size {shape[d]}, which {n} ranks do not divide; "
                               f"{placement!r} over {n} ranks needs a multiple of {n}")
        return shape[:d] + (shape[d] // n,) + shape[d + 1:]
    if isinstance(placement, Flattened):
        return (math.prod(local_shape(placement.shape, placement.inner, n, what)),)
    if isinstance(placement, Packed):
        raise CompileError(f"{what}: the local size of {placement!r} is its members' (`FlatLayouts.local_numel`)")
    return shape
