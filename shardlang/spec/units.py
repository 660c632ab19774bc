"""Units: groups of parameters that are gathered, freed and reduced together.

A unit is a module of the model, named as in ``model.named_modules()``. Unit
patterns are globs over module names, matched like rules (`fnmatch.fnmatchcase`,
whole name, ``*`` crosses dots). The semantics:

- Each pattern picks the OUTERMOST modules it matches: a matched module inside
  another module matched by the same pattern is skipped. So ``blocks.*`` gives
  ``blocks.0``, ``blocks.1``, ... and not ``blocks.0.attn`` too.
- Different patterns may give nested units (``["blocks.*", "blocks.*.mlp"]``),
  but never the same module twice (``["blocks.*", "blocks.0"]`` is a `SpecError`
  naming both patterns).
  A parameter belongs to the DEEPEST unit module that contains it.
- The model itself is the root unit, named ``""`` (shown as ``<root>``): it
  holds every parameter in no other unit. Patterns never match the root.
- With no patterns (``units=None``), the default units are the children of every
  ``nn.ModuleList`` / ``nn.Sequential`` whose class at least one sibling shares
  (two or more children of that class): the repeated blocks of a model.
- ``units=[]`` means the root unit only: every parameter is gathered at once.

Example::

    find_units(model, ("blocks.*", "head"))   # ('blocks.0', 'blocks.1', 'head')
    unit_of("blocks.1.attn.qkv.weight", {"blocks.0", "blocks.1"})   # 'blocks.1'
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from fnmatch import fnmatchcase

from torch import nn

from shardlang.errors import SpecError

__all__ = ["ROOT_UNIT", "assign_units", "default_units", "find_units", "to_units", "unit_label", "unit_of"]

ROOT_UNIT = ""
"""The name of the root unit: the model itself."""

_SHOWN_NAMES = 12


def unit_label(unit: str) -> str:
    """How a unit is shown to people: its name, or ``<root>`` for the root unit.

    Example: ``unit_label("") == "<root>"``, ``unit_label("blocks.0") == "blocks.0"``.
    """
    return unit if unit else "<root>"


def to_units(value: object) -> tuple[str, ...] | None:
    """Check unit patterns and return them as a tuple; None (the default units) stays None.

    Errors name the pattern's index and value. Example: ``to_units(["blocks.*"]) == ("blocks.*",)``.
    """
    if value is None:
        return None
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise SpecError(
            f"units is {value!r}; units are a list of glob patterns over module names, "
            "e.g. ['blocks.*'], or None for the default units"
        )
    for i, pattern in enumerate(value):
        if not isinstance(pattern, str) or not pattern:
            raise SpecError(
                f"units[{i}] is {pattern!r}; a unit pattern is a non-empty glob over module names "
                "such as 'blocks.*' (the root unit, the model itself, is always there)"
            )
    return tuple(value)


def default_units(model: nn.Module) -> tuple[str, ...]:
    """The default units: children of ModuleList / Sequential that share their class with a sibling.

    Only the outermost such children count: the layers inside a repeated block
    belong to the block's unit rather than forming tiny units of their own.

    Example: for ``nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))``
    the units are ``('0', '2')``; the ReLU (alone of its class) stays in the root.
    """
    units = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = [(child_name, child) for child_name, child in module.named_children()]
        counts = Counter(type(child) for _, child in children)
        prefix = f"{name}." if name else ""
        units.extend(prefix + child_name for child_name, child in children if counts[type(child)] >= 2)
    return _in_module_order(model, set(_outermost(units)))


def _outermost(names: Sequence[str]) -> list[str]:
    """The names that have no proper ancestor (a dotted prefix) among ``names``, in order."""
    chosen = set(names)
    return [n for n in names if not any(a in chosen for a in _ancestors(n))]


def _ancestors(name: str) -> list[str]:
    """The proper dotted prefixes of ``name``: ``a.b.c`` -> ``['a', 'a.b']``."""
    parts = name.split(".")
    return [".".join(parts[:k]) for k in range(1, len(parts))]


def _in_module_order(model: nn.Module, units: Collection[str]) -> tuple[str, ...]:
    return tuple(name for name, _ in model.named_modules() if name in units)


def some_names(names: Sequence[str]) -> str:
    """The first names, quoted, and how many there are in all when there are more: for error messages."""
    shown = ", ".join(repr(n) for n in names[:_SHOWN_NAMES])
    more = f", ... ({len(names)} in all)" if len(names) > _SHOWN_NAMES else ""
    return shown + more


def find_units(model: nn.Module, patterns: Sequence[str] | None, source: str = "units") -> tuple[str, ...]:
    """The unit module names (without the root), in module order, for ``patterns``.

    None gives `default_units`. A pattern that matches no module raises
    `SpecError` naming it, ``source`` and some module names. Example::

        find_units(gpt, ("blocks.*",)) == ("blocks.0", "blocks.1")
    """
    if patterns is None:
        return default_units(model)
    names = [name for name, _ in model.named_modules() if name != ROOT_UNIT]
    picked_by: dict[str, int] = {}  # unit -> the index of the pattern that picked it
    for i, pattern in enumerate(patterns):
        matched = [name for name in names if fnmatchcase(name, pattern)]
        if not matched:
            raise SpecError(
                f"{source}[{i}] = {pattern!r} matches no module of the model ({type(model).__name__}); "
                f"patterns match whole module names, such as {some_names(names) or '(it has no submodules)'}"
            )
        for name in _outermost(matched):
            if name in picked_by:  # nested units are fine; the same module twice is a spec that says two things
                j = picked_by[name]
                raise SpecError(
                    f"{source}[{j}] = {patterns[j]!r} and {source}[{i}] = {pattern!r} both make module {name!r} a "
                    "unit; each module may be one unit only: drop one pattern, or narrow it so that they pick "
                    "different modules (a unit nested in another, such as 'blocks.*' and 'blocks.*.mlp', is fine)")
            picked_by[name] = i
    return _in_module_order(model, picked_by)


def unit_of(param_name: str, units: Collection[str]) -> str:
    """The deepest unit in ``units`` that contains parameter ``param_name``; `ROOT_UNIT` if none.

    Example: ``unit_of("blocks.1.mlp.fc.weight", {"blocks.1", "blocks.1.mlp"}) == "blocks.1.mlp"``.
    """
    for ancestor in reversed(_ancestors(param_name)):
        if ancestor in units:
            return ancestor
    return ROOT_UNIT


def assign_units(model: nn.Module, patterns: Sequence[str] | None, source: str = "units") -> dict[str, str]:
    """Each parameter's unit, by its first name in ``model.named_parameters()``.

    Example: ``assign_units(gpt, ("blocks.*",))["blocks.0.ln1.weight"] == "blocks.0"``.
    """
    units = frozenset(find_units(model, patterns, source))
    return {name: unit_of(name, units) for name, _ in model.named_parameters()}
