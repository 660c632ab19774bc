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

import attrs

from shardlang.errors import SpecError
from shardlang.spec.patterns import PatternRule, TableKind, pattern_field, rule_from_table, to_table
from shardlang.spec.vocabulary import Recompute

__all__ = ["Recompute", "RecomputeRule", "recompute_rule_from_dict", "to_policy", "to_recompute"]


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


RECOMPUTE = TableKind(
    name="recompute", verb="is", rule="a recompute rule", value_word="policy", pair="(unit pattern, policy)",
    over="unit names", patterns="'blocks.*', '*' or '<root>'", example="('blocks.*', 'full')",
    list_example="('blocks.*', 'full')", table_example="{pattern = 'blocks.*', policy = 'full'}",
    to_value=to_policy, value_from_table=lambda d, where: to_policy(d["policy"], where),
    keys=("pattern", "policy"), everywhere=Recompute, everywhere_example="sl.Recompute.FULL")


@attrs.frozen(repr=False)
class RecomputeRule(PatternRule):
    """Units whose name matches ``pattern`` use recompute ``policy``. Unpacks like the pair it is written as.

    Example::

        >>> rule = RecomputeRule("blocks.*", "full")
        >>> rule
        RecomputeRule('blocks.*', 'full')
        >>> rule.matches("blocks.3"), rule.matches("<root>")
        (True, False)
    """

    table = RECOMPUTE  # to_dict: ``{'pattern': 'blocks.*', 'policy': 'full'}``
    pattern: str = pattern_field()
    policy: Recompute = attrs.field(converter=lambda p: to_policy(p, "RecomputeRule"))

    def __repr__(self) -> str:
        return f"RecomputeRule({self.pattern!r}, {self.policy.value!r})"


def to_recompute(value: object) -> tuple[RecomputeRule, ...] | None:
    """Check ``recompute`` and return it as a tuple of `RecomputeRule`; None stays None.

    Accepts a list of `RecomputeRule` or ``(pattern, policy)`` pairs, or one
    policy alone, meaning every unit. Example::

        >>> to_recompute([("blocks.*", "full")])
        (RecomputeRule('blocks.*', 'full'),)
        >>> to_recompute(Recompute.SELECTIVE)
        (RecomputeRule('*', 'selective'),)
    """
    return to_table(value, RECOMPUTE, RecomputeRule)


def recompute_rule_from_dict(d: object, where: str) -> RecomputeRule:
    """A recompute rule from its plain-dict (TOML) form; ``where`` names it in errors.

    Example::

        >>> recompute_rule_from_dict({"pattern": "blocks.*", "policy": "selective"}, "recompute[0]")
        RecomputeRule('blocks.*', 'selective')
    """
    return rule_from_table(d, where, RECOMPUTE, RecomputeRule)
