"""Layouts: how one parameter lies over the mesh. `shard` splits it, `replicate` copies it.

- ``shard('fsdp')``: flatten the parameter, pad it to a multiple of the ``fsdp``
  axis size N, and give each rank one of N equal chunks (FSDP2's flat sharding;
  any shape works, a 0-d scalar included).
- ``shard('fsdp', dim=0)``: split along tensor dim 0, padding that dim to a
  multiple of N (FSDP2's ``Shard(0)``). ``dim`` may be negative: ``dim=-1`` is
  the last dim.
- ``replicate()``: every rank holds the whole parameter (DDP-style; gradients are
  all-reduced, the update is computed on every rank).

On a 2-D mesh such as ``Mesh(replicate=2, fsdp=4)``, ``shard('fsdp')`` shards over
``fsdp`` and replicates over every other axis (hybrid sharding).

A layout is a value; `Shard.to_placement` turns it into the compiler's
`compiler.layout.placement.Placement` once the parameter's shape is known.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from shardlang.errors import SpecError
from ..compiler import LayoutKind, Placement

__all__ = ["Layout", "Replicate", "Shard", "layout_from_dict", "replicate", "shard"]

_LAYOUT_KEYS = ("layout", "axis", "dim")


def _check_axis(_instance: object, _attribute: object, axis: object) -> None:
    if not isinstance(axis, str) or not axis:
        raise SpecError(f"shard axis is {axis!r}; it must be the name of a mesh axis, e.g. shard('fsdp')")


def _check_dim(_instance: object, _attribute: object, dim: object) -> None:
    if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int)):
        raise SpecError(
            f"shard dim is {dim!r}; it must be an int (negative counts from the end) "
            "or None to shard the flattened parameter"
        )


def _shape_text(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


@attrs.frozen(repr=False)
class Shard:
    """Shard a parameter over mesh axis ``axis``: flat when ``dim`` is None, else along ``dim``.

    Build it with `shard`. Example::

        >>> shard("fsdp", dim=0)
        shard('fsdp', dim=0)
        >>> shard("fsdp").to_placement((3, 5), "w")
        Placement(kind=<LayoutKind.SHARD_FLAT: 'shard_flat'>, axis='fsdp', dim=None)
    """

    axis: str = attrs.field(validator=_check_axis)
    dim: int | None = attrs.field(default=None, validator=_check_dim)

    def __repr__(self) -> str:
        if self.dim is None:
            return f"shard({self.axis!r})"
        return f"shard({self.axis!r}, dim={self.dim})"

    def _repr_pretty_(self, printer: object, cycle: bool) -> None:
        """Show the constructor-call repr in IPython and in Hypothesis's reports too."""
        printer.text(repr(self))  # type: ignore[attr-defined]

    def to_placement(self, param_shape: Sequence[int], param_name: str = "the parameter") -> Placement:
        """The compiler's placement for a parameter of ``param_shape``, with ``dim`` made non-negative.

        Raises `SpecError` naming the parameter, its shape and the valid dims when
        ``dim`` does not exist. Example::

            >>> shard("fsdp", dim=-1).to_placement((4, 6), "w").dim
            1
        """
        if self.dim is None:
            return Placement(LayoutKind.SHARD_FLAT, axis=self.axis)
        ndim = len(param_shape)
        if not -ndim <= self.dim < ndim:
            if ndim == 0:
                valid = "it is a 0-d scalar and has no dims"
            else:
                valid = f"valid dims for a {ndim}-d tensor are {-ndim}..{ndim - 1}"
            raise SpecError(
                f"{self!r} asks for dim {self.dim} of parameter {param_name!r} of shape "
                f"{_shape_text(param_shape)}, which does not exist; {valid} "
                f"(or use shard({self.axis!r}) to shard it flat)"
            )
        return Placement(LayoutKind.SHARD_DIM, axis=self.axis, dim=self.dim % ndim)

    def to_dict(self) -> dict[str, object]:
        """The plain-dict (TOML) form; ``dim`` is left out when None.

        Example: ``shard('fsdp', dim=0).to_dict() == {'layout': 'shard', 'axis': 'fsdp', 'dim': 0}``.
        """
        d: dict[str, object] = {"layout": "shard", "axis": self.axis}
        if self.dim is not None:
            d["dim"] = self.dim
        return d


@attrs.frozen(repr=False)
class Replicate:
    """Every rank holds the whole parameter. Build it with `replicate`.

    Example::

        >>> replicate()
        replicate()
        >>> replicate().to_placement((3,), "ln.bias").kind
        <LayoutKind.REPLICATE: 'replicate'>
    """

    def __repr__(self) -> str:
        return "replicate()"

    def _repr_pretty_(self, printer: object, cycle: bool) -> None:
        """Show the constructor-call repr in IPython and in Hypothesis's reports too."""
        printer.text(repr(self))  # type: ignore[attr-defined]

    def to_placement(self, param_shape: Sequence[int], param_name: str = "the parameter") -> Placement:
        """The compiler's placement: `LayoutKind.REPLICATE`, for any shape. Example: see the class."""
        return Placement(LayoutKind.REPLICATE)

    def to_dict(self) -> dict[str, object]:
        """The plain-dict (TOML) form. Example: ``replicate().to_dict() == {'layout': 'replicate'}``."""
        return {"layout": "replicate"}


Layout = Shard | Replicate
"""A parameter's layout: a `Shard` or a `Replicate`."""


def shard(axis: str, dim: int | None = None) -> Shard:
    """Shard over mesh axis ``axis``: flat when ``dim`` is None, else along tensor dim ``dim``.

    Example: ``shard("fsdp")``, ``shard("fsdp", dim=0)``, ``shard("fsdp", dim=-1)``.
    """
    return Shard(axis, dim)


def replicate() -> Replicate:
    """Keep a whole copy of the parameter on every rank. Example: ``("*.bias", replicate())``."""
    return Replicate()


def layout_from_dict(d: Mapping[str, object], where: str, extra_keys: Sequence[str] = ()) -> Layout:
    """A layout from its plain-dict form; ``where`` names it in errors; ``extra_keys`` are ignored.

    Forms: ``{"layout": "shard", "axis": "fsdp"}``, ``{"layout": "shard", "axis":
    "fsdp", "dim": 0}``, ``{"layout": "replicate"}``. Example::

        >>> layout_from_dict({"layout": "shard", "axis": "fsdp", "dim": 0}, "rules[0]")
        shard('fsdp', dim=0)
    """
    valid = [*extra_keys, *_LAYOUT_KEYS]
    if isinstance(d.get("layout"), list):  # per-axis layouts: layout = [{layout = "shard", axis = "tp", dim = 0}, ...]
        extra = [k for k in d if k not in (*extra_keys, "layout")]
        if extra:
            raise SpecError(f"{where}: key {extra[0]!r} beside a list of layouts; put it in one of the list's tables")
        if not d["layout"] or not all(isinstance(one, Mapping) for one in d["layout"]):
            raise SpecError(f"{where}: layout is {d['layout']!r}; a list of layouts holds tables such as "
                            "{layout = 'shard', axis = 'tp', dim = 0}")
        return tuple(layout_from_dict(one, f"{where}.layout[{i}]") for i, one in enumerate(d["layout"]))
    for key in d:
        if key not in valid:
            raise SpecError(f"{where}: unknown key {key!r}; valid keys are {valid}")
    kind = d.get("layout")
    if kind == "replicate":
        for key in ("axis", "dim"):
            if key in d:
                raise SpecError(
                    f"{where}: {key!r} = {d[key]!r} does not apply to layout 'replicate'; "
                    "remove it, or use layout 'shard'"
                )
        return replicate()
    if kind == "shard":
        if "axis" not in d:
            raise SpecError(f"{where}: layout 'shard' needs an 'axis', the name of a mesh axis such as 'fsdp'")
        try:
            return shard(d["axis"], d.get("dim"))  # type: ignore[arg-type]
        except SpecError as e:
            raise SpecError(f"{where}: {e}") from None
    if kind is None:
        raise SpecError(f"{where}: missing key 'layout'; set it to 'shard' or 'replicate'")
    raise SpecError(f"{where}: layout is {kind!r}; valid layouts are 'shard' and 'replicate'")
