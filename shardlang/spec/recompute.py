"""Activation recompute: which units keep their activations for backward, and which compute them again.

Three policies (`Recompute`; docs/spec.md, "Recompute"):

- ``"none"``: keep every activation backward reads (the default).
- ``"full"``: keep only the unit's inputs; run its forward again just before
  its backward (torchtitan's ``activation_checkpoint.mode = "full"``).
- ``"selective"``: keep the outputs of matmuls and attention, recompute the
  cheap ops between them (torchtitan's op-level selective policy).

Policies are chosen per unit with ordered ``(pattern, policy)`` pairs, first
match wins, in `Spec(recompute=...)`, written like ``strategies``. Patterns are
globs over unit names (``blocks.0``; the root unit is ``<root>``)::

    recompute=[("blocks.*", "full")]                  # every block recomputed, the rest kept
    recompute=[("blocks.0", sl.Recompute.NONE), ("blocks.*", "selective")]

A unit no pattern matches keeps its activations. The compiler pass is
`shardlang.compiler.passes.recompute_activations`; the recompute reuses the
unit's backward gather, so it adds compute, never a collective.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from fnmatch import fnmatchcase

import attrs

from shardlang.errors import SpecError
from shardlang.spec.vocabulary import Recompute

__all__ = ["Recompute", "RecomputeRule", "recompute_rule_from_dict", "to_policy", "to_recompute"]

_EXAMPLE = "('blocks.*', 'full')"
_KEYS = ("pattern", "policy")


def to_policy(value: object, where: str) -> Recompute:
    """A `Recompute` from itself or its name (``"none"``, ``"full"``, ``"selective"``, any case).

    ``where`` names it in errors. Example: ``to_policy("Full", "recompute[0]") is Recompute.FULL``.
    """
    if isinstance(value, Recompute):
        return value
    if isinstance(value, str) and value.lower() in {p.value for p in Recompute}:
        return Recompute(value.lower())
    raise SpecError(
        f"{where}: recompute policy is {value!r}; valid policies are {[p.value for p in Recompute]} "
        "(or sl.Recompute.NONE, sl.Recompute.FULL, sl.Recompute.SELECTIVE)"
    )


def _check_pattern(_instance: object, _attribute: object, pattern: object) -> None:
    if not isinstance(pattern, str) or not pattern:
        raise SpecError(f"RecomputeRule: pattern is {pattern!r}; a pattern is a non-empty glob over unit names such "
                        "as 'blocks.*', '*' or '<root>'")


@attrs.frozen(repr=False)
class RecomputeRule:
    """Units whose name matches ``pattern`` use recompute ``policy``. Unpacks like the pair it is written as.

    Example::

        >>> rule = RecomputeRule("blocks.*", "full")
        >>> rule
        RecomputeRule('blocks.*', 'full')
        >>> rule.matches("blocks.3"), rule.matches("<root>")
        (True, False)
    """

    pattern: str = attrs.field(validator=_check_pattern)
    policy: Recompute = attrs.field(converter=lambda p: to_policy(p, "RecomputeRule"))

    def __repr__(self) -> str:
        return f"RecomputeRule({self.pattern!r}, {self.policy.value!r})"

    def _repr_pretty_(self, printer: object, cycle: bool) -> None:
        printer.text(repr(self))  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator[object]:
        return iter((self.pattern, self.policy))

    def matches(self, unit_label: str) -> bool:
        """Whether ``pattern`` matches all of a unit's label (``<root>`` for the root unit)."""
        return fnmatchcase(unit_label, self.pattern)

    def to_dict(self) -> dict[str, object]:
        """The plain-dict (TOML) form. Example: ``{'pattern': 'blocks.*', 'policy': 'full'}``."""
        return {"pattern": self.pattern, "policy": self.policy.value}


def to_recompute(value: object) -> tuple[RecomputeRule, ...] | None:
    """Check ``recompute`` and return it as a tuple of `RecomputeRule`; None stays None.

    Accepts a list of `RecomputeRule` or ``(pattern, policy)`` pairs, or one
    policy alone, meaning every unit. Example::

        >>> to_recompute([("blocks.*", "full")])
        (RecomputeRule('blocks.*', 'full'),)
        >>> to_recompute(Recompute.SELECTIVE)
        (RecomputeRule('*', 'selective'),)
    """
    if value is None:
        return None
    if isinstance(value, Recompute):
        return (RecomputeRule("*", value),)
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise SpecError(
            f"recompute is {value!r}; recompute is a list of (unit pattern, policy) pairs, first match wins, "
            f"e.g. [{_EXAMPLE}], or one policy for every unit, e.g. sl.Recompute.FULL"
        )
    rules = []
    for i, item in enumerate(value):
        where = f"recompute[{i}]"
        if isinstance(item, RecomputeRule):
            rules.append(item)
            continue
        if isinstance(item, (str, bytes)) or not isinstance(item, Sequence) or len(item) != 2:
            raise SpecError(f"{where} is {item!r}; a recompute rule is a (unit pattern, policy) pair such as "
                            f"{_EXAMPLE}")
        pattern, policy = item
        if not isinstance(pattern, str) or not pattern:
            raise SpecError(f"{where}: pattern is {pattern!r}; a pattern is a non-empty glob over unit names such "
                            "as 'blocks.*', '*' or '<root>'")
        rules.append(RecomputeRule(pattern, to_policy(policy, where)))
    return tuple(rules)


def recompute_rule_from_dict(d: object, where: str) -> RecomputeRule:
    """A recompute rule from its plain-dict (TOML) form; ``where`` names it in errors.

    Example::

        >>> recompute_rule_from_dict({"pattern": "blocks.*", "policy": "selective"}, "recompute[0]")
        RecomputeRule('blocks.*', 'selective')
    """
    example = "{pattern = 'blocks.*', policy = 'full'}"
    if not isinstance(d, Mapping):
        raise SpecError(f"{where} is {d!r}; a recompute rule is a table such as {example}")
    for key in d:
        if key not in _KEYS:
            raise SpecError(f"{where}: unknown key {key!r}; valid keys are {list(_KEYS)}")
    for key in _KEYS:
        if key not in d:
            raise SpecError(f"{where}: missing key {key!r}; a recompute rule is a table such as {example}")
    (rule,) = to_recompute([(d["pattern"], to_policy(d["policy"], where))])
    return rule
