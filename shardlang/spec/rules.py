"""Rules: ordered ``(pattern, layout)`` pairs that give every parameter its layout.

A pattern is a glob matched against the WHOLE parameter name (the name in
``model.named_parameters()``, e.g. ``blocks.0.attn.qkv.weight``) with
`fnmatch.fnmatchcase`: case-sensitive; ``*`` matches any run of characters,
dots included; ``?`` matches one character; ``[abc]`` / ``[!abc]`` match one
character from / not from a set. The first rule whose pattern matches wins::

    rules = [
        ("*.ln*.*", replicate()),          # LayerNorms inside modules: blocks.0.ln1.weight
        ("*.bias", replicate()),
        ("*", shard("fsdp")),              # everything else, flat
    ]

`to_rules` is the converter `Spec` uses: it accepts `Rule` values or plain pairs,
checks them, and returns a tuple of `Rule`.
"""

from __future__ import annotations

import attrs

from shardlang.errors import SpecError
from shardlang.spec.layout import Layout, Replicate, Shard, layout_from_dict, replicate, shard
from shardlang.spec.patterns import PatternRule, TableKind, first_match, pattern_field, rule_from_table, to_table

__all__ = ["Rule", "first_match", "rule_from_dict", "to_rules"]


def _checked_layout(layout: object, where: str) -> Layout | tuple[Layout, ...]:
    """Return ``layout`` if it is a `Shard`, a `Replicate` or a tuple of them (one per axis), else raise
    `SpecError` naming ``where``. A list is taken as the tuple it stands for."""
    if isinstance(layout, (tuple, list)) and layout:
        return tuple(_checked_layout(one, f"{where}[{i}]") for i, one in enumerate(layout))
    if not isinstance(layout, (Shard, Replicate)):
        hint = ""
        if layout is replicate:
            hint = " (the function, not called: write replicate())"
        elif layout is shard:
            hint = " (the function, not called: write shard('fsdp'))"
        raise SpecError(
            f"{where}: layout is {layout!r}{hint}; a layout is shard(axis), shard(axis, dim=d), replicate(), "
            "or a tuple of per-axis layouts such as (shard('tp', dim=0), shard('fsdp'))"
        )
    return layout


RULES = TableKind(
    name="rules", verb="are", rule="a rule", value_word="layout", pair="(pattern, layout)",
    over="parameter names", patterns="'*', 'blocks.*.weight' or 'ln_f.*'", example="('*', shard('fsdp'))",
    list_example="('*', shard('fsdp'))", table_example="{pattern = '*', layout = 'shard', axis = 'fsdp'}",
    to_value=_checked_layout, value_from_table=lambda d, where: layout_from_dict(d, where, extra_keys=("pattern",)),
    keys=None, required=True)


@attrs.frozen(repr=False)
class Rule(PatternRule):
    """One rule: parameters whose name matches ``pattern`` get ``layout``.

    It unpacks like the pair it is written as. Example::

        >>> rule = Rule("blocks.*.bias", replicate())
        >>> rule
        Rule('blocks.*.bias', replicate())
        >>> rule.matches("blocks.3.mlp.fc.bias")
        True
        >>> pattern, layout = rule
    """

    table = RULES
    pattern: str = pattern_field()
    layout: Layout | tuple[Layout, ...] = attrs.field(converter=lambda layout: _checked_layout(layout, "Rule"))

    def __repr__(self) -> str:
        return f"Rule({self.pattern!r}, {self.layout!r})"

    def to_dict(self) -> dict[str, object]:
        """The plain-dict (TOML) form. Example: ``{'pattern': '*', 'layout': 'shard', 'axis': 'fsdp'}``."""
        if isinstance(self.layout, tuple):
            return {"pattern": self.pattern, "layout": [one.to_dict() for one in self.layout]}
        return {"pattern": self.pattern, **self.layout.to_dict()}


def to_rules(value: object) -> tuple[Rule, ...]:
    """Check a sequence of `Rule` or ``(pattern, layout)`` pairs and return it as a tuple of `Rule`.

    Errors name the rule's index and value. Example::

        >>> to_rules([("*", shard("fsdp"))])
        (Rule('*', shard('fsdp')),)
    """
    return to_table(value, RULES, Rule)


def rule_from_dict(d: object, where: str) -> Rule:
    """A rule from its plain-dict (TOML) form; ``where`` names it in errors.

    Example::

        >>> rule_from_dict({"pattern": "ln*", "layout": "replicate"}, "rules[1]")
        Rule('ln*', replicate())
    """
    return rule_from_table(d, where, RULES, Rule)
