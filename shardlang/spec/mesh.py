"""`Mesh`: the named axes of devices that parameters are laid out over.

A mesh is an ordered list of named axes with a size each, written as keyword
arguments: ``Mesh(fsdp=4)`` is four devices in a line, ``Mesh(replicate=2,
fsdp=4)`` is eight devices in a 2 x 4 grid (hybrid sharding: shard over ``fsdp``,
replicate over ``replicate``). One axis may have size ``-1``, "the rest of the
world": ``Mesh(fsdp=-1)`` fits any world size, and ``Mesh(replicate=2,
fsdp=-1)`` any even one. ``bind(world_size)`` fills it in.

A mesh is abstract (JAX's ``AbstractMesh``): names and sizes only, no process
groups. The runtime binds process groups when a step runs; the compiler sees
only ``mesh.bind(world_size).shape``, a `compiler.layout.placement.MeshShape`.
"""

from __future__ import annotations

import math
import re

import attrs

from shardlang.errors import SpecError
from ..compiler import MeshShape
from .tensor_axes import is_tensor_axis

__all__ = ["REST", "Mesh", "check_world_size"]

REST = -1
"""The size that means "the rest of the world": ``Mesh(fsdp=REST)`` is ``Mesh(fsdp=-1)``."""

_AXIS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_world_size(world_size: object, where: str = "world_size") -> int:
    """Return ``world_size`` if it is a positive int, else raise `SpecError` naming ``where``.

    Example: ``check_world_size(4) == 4``; ``check_world_size(0)`` raises.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise SpecError(f"{where} is {world_size!r}; it must be a positive int such as 1, 2 or 4")
    return world_size


def _canonical_axes(axes: dict[str, object]) -> tuple[tuple[str, int], ...]:
    """Check the keyword arguments of `Mesh` and return them as ordered (name, size) pairs."""
    if not axes:
        raise SpecError("Mesh() has no axes; name at least one, e.g. Mesh(fsdp=4) or Mesh(fsdp=-1)")
    pairs = []
    for name, size in axes.items():
        if not isinstance(name, str) or not _AXIS_NAME.fullmatch(name):
            raise SpecError(
                f"Mesh axis name {name!r} is not a valid name; "
                "use letters, digits and underscores, starting with a letter, e.g. 'fsdp'"
            )
        if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != REST):
            raise SpecError(
                f"Mesh axis {name!r} has size {size!r}; "
                "a size is a positive int, or -1 for the rest of the world"
            )
        pairs.append((name, size))
    rest = [name for name, size in pairs if size == REST]
    if len(rest) > 1:
        raise SpecError(
            f"Mesh axes {rest} all have size -1; at most one axis may be -1 (the rest of the world)"
        )
    return tuple(pairs)


@attrs.frozen(init=False, repr=False)
class Mesh:
    """Ordered named axes with sizes; ``-1`` is the rest of the world.

    Example::

        >>> Mesh(fsdp=4)
        Mesh(fsdp=4)
        >>> Mesh(replicate=2, fsdp=-1).bind(8)
        Mesh(replicate=2, fsdp=4)
        >>> Mesh(fsdp=4).shape
        MeshShape(axes=(('fsdp', 4),))

    Axis names are identifiers; sizes are positive ints, or -1 on at most one axis.
    The order of the axes is part of the value: ``Mesh(a=2, b=2) != Mesh(b=2, a=2)``.
    """

    axes: tuple[tuple[str, int], ...]

    def __init__(self, **axes: int) -> None:
        self.__attrs_init__(_canonical_axes(axes))

    def __repr__(self) -> str:
        return "Mesh(" + ", ".join(f"{name}={size}" for name, size in self.axes) + ")"

    def _repr_pretty_(self, printer: object, cycle: bool) -> None:
        """Show the constructor-call repr in IPython and in Hypothesis's reports too."""
        printer.text(repr(self))  # type: ignore[attr-defined]

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The axis names, in order. Example: ``Mesh(replicate=2, fsdp=4).axis_names == ('replicate', 'fsdp')``."""
        return tuple(name for name, _ in self.axes)

    @property
    def is_bound(self) -> bool:
        """Whether every size is known (no ``-1``). Example: ``Mesh(fsdp=-1).is_bound is False``."""
        return all(size != REST for _, size in self.axes)

    def axis_size(self, name: str) -> int:
        """The size of axis ``name`` (``-1`` if unbound). Example: ``Mesh(fsdp=4).axis_size('fsdp') == 4``."""
        for axis, size in self.axes:
            if axis == name:
                return size
        raise SpecError(f"{name!r} is not an axis of {self!r}; its axes are {list(self.axis_names)}")

    @property
    def size(self) -> int:
        """The number of devices: the product of the sizes. Only for a bound mesh.

        Example: ``Mesh(replicate=2, fsdp=4).size == 8``.
        """
        self._require_bound("size")
        return math.prod(size for _, size in self.axes)

    @property
    def shape(self) -> MeshShape:
        """The abstract mesh the compiler consumes. Only for a bound mesh.

        Example: ``Mesh(fsdp=4).shape == MeshShape((("fsdp", 4),))``.
        """
        self._require_bound("shape")
        return MeshShape(self.axes)

    def bind(self, world_size: int) -> Mesh:
        """This mesh with ``-1`` filled in so that its size is ``world_size``.

        Raises `SpecError` when the sizes cannot multiply to ``world_size``. Example::

            >>> Mesh(fsdp=-1).bind(4)
            Mesh(fsdp=4)
            >>> Mesh(fsdp=4).bind(4)
            Mesh(fsdp=4)
        """
        world_size = check_world_size(world_size)
        known = math.prod(size for _, size in self.axes if size != REST)
        if self.is_bound:
            if known != world_size:
                raise SpecError(
                    f"{self!r} has {known} devices but the world size is {world_size}; "
                    f"make the sizes multiply to {world_size}, or set one axis to -1 to fill the rest"
                )
            return self
        if world_size % known != 0:
            rest = next(name for name, size in self.axes if size == REST)
            raise SpecError(
                f"{self!r} cannot fill {rest}=-1 for world size {world_size}: {world_size} is not a "
                f"multiple of {known}, the product of the other axes; valid world sizes are multiples of {known}"
            )
        filled = {name: (world_size // known if size == REST else size) for name, size in self.axes}
        return Mesh(**filled)

    def batch_split(self, world_size: int, rank: int) -> tuple[int, int]:
        """``(parts, index)``: the global batch splits into ``parts`` equal runs of rows and ``rank`` takes run ``index``.

        Every axis splits the batch except tensor axes (`shardlang.spec.tensor_axes`): ranks that
        differ only in their ``tp`` coordinate take the same rows. Example::

            >>> Mesh(fsdp=-1, tp=2).batch_split(4, 3)
            (2, 1)
            >>> Mesh(fsdp=-1).batch_split(4, 3)
            (4, 3)
        """
        bound = self.bind(world_size)
        coordinate = bound.shape.coordinate(rank)
        parts, index = 1, 0
        for name, size in bound.axes:
            if not is_tensor_axis(name):
                parts, index = parts * size, index * size + coordinate[name]
        return parts, index

    def _require_bound(self, what: str) -> None:
        if not self.is_bound:
            raise SpecError(
                f"{self!r} has an axis of size -1, so its {what} is not known yet; "
                f"call .bind(world_size) first, e.g. {self!r}.bind(4)"
            )
