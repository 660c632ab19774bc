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

from collections.abc import Iterator, Mapping, Sequence
from fnmatch import fnmatchcase

import attrs

from shardlang.errors import SpecError
from shardlang.spec.layout import Layout, Replicate, Shard, layout_from_dict, replicate, shard

__all__ = ["Rule", "first_match", "rule_from_dict", "to_rules"]

_RULE_EXAMPLE = "('*', shard('fsdp'))"


def _checked_pattern(pattern: object, where: str) -> str:
    """Return ``pattern`` if it is a non-empty str, else raise `SpecError` naming ``where``."""
    if not isinstance(pattern, str) or not pattern:
        raise SpecError(
            f"{where}: pattern is {pattern!r}; a pattern is a non-empty glob string such as "
            "'*', 'blocks.*.weight' or 'ln_f.*'"
        )
    return pattern


def _checked_layout(layout: object, where: str) -> Layout:
    """Return ``layout`` if it is a `Shard` or `Replicate`, else raise `SpecError` naming ``where``."""
    if not isinstance(layout, (Shard, Replicate)):
        hint = ""
        if layout is replicate:
            hint = " (the function, not called: write replicate())"
        elif layout is shard:
            hint = " (the function, not called: write shard('fsdp'))"
        raise SpecError(
            f"{where}: layout is {layout!r}{hint}; a layout is shard(axis), shard(axis, dim=d) or replicate()"
        )
    return layout


def _check_rule_pattern(_instance: object, _attribute: object, pattern: object) -> None:
    _checked_pattern(pattern, "Rule")


def _check_rule_layout(_instance: object, _attribute: object, layout: object) -> None:
    _checked_layout(layout, "Rule")


@attrs.frozen(repr=False)
class Rule:
    """One rule: parameters whose name matches ``pattern`` get ``layout``.

    It unpacks like the pair it is written as. Example::

        >>> rule = Rule("blocks.*.bias", replicate())
        >>> rule
        Rule('blocks.*.bias', replicate())
        >>> rule.matches("blocks.3.mlp.fc.bias")
        True
        >>> pattern, layout = rule
    """

    pattern: str = attrs.field(validator=_check_rule_pattern)
    layout: Layout = attrs.field(validator=_check_rule_layout)

    def __repr__(self) -> str:
        return f"Rule({self.pattern!r}, {self.layout!r})"

    def _repr_pretty_(self, printer: object, cycle: bool) -> None:
        """Show the constructor-call repr in IPython and in Hypothesis's reports too."""
        printer.text(repr(self))  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator[object]:
        return iter((self.pattern, self.layout))

    def matches(self, name: str) -> bool:
        """Whether ``pattern`` matches all of ``name`` (``*`` crosses dots). Example: see the class."""
        return fnmatchcase(name, self.pattern)

    def to_dict(self) -> dict[str, object]:
        """The plain-dict (TOML) form. Example: ``{'pattern': '*', 'layout': 'shard', 'axis': 'fsdp'}``."""
        return {"pattern": self.pattern, **self.layout.to_dict()}


def to_rules(value: object) -> tuple[Rule, ...]:
    """Check a sequence of `Rule` or ``(pattern, layout)`` pairs and return it as a tuple of `Rule`.

    Errors name the rule's index and value. Example::

        >>> to_rules([("*", shard("fsdp"))])
        (Rule('*', shard('fsdp')),)
    """
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise SpecError(
            f"rules is {value!r}; rules are a list of (pattern, layout) pairs, first match wins, "
            f"e.g. [{_RULE_EXAMPLE}]"
        )
    if not value:
        raise SpecError(
            f"rules is empty; every parameter must match a rule, so give at least one, e.g. [{_RULE_EXAMPLE}]"
        )
    rules = []
    for i, item in enumerate(value):
        where = f"rules[{i}]"
        if isinstance(item, Rule):
            rules.append(item)
            continue
        if isinstance(item, (str, bytes)) or not isinstance(item, Sequence) or len(item) != 2:
            raise SpecError(f"{where} is {item!r}; a rule is a (pattern, layout) pair such as {_RULE_EXAMPLE}")
        pattern, layout = item
        rules.append(Rule(_checked_pattern(pattern, where), _checked_layout(layout, where)))
    return tuple(rules)


def first_match(rules: Sequence[Rule], name: str) -> int | None:
    """The index of the first rule whose pattern matches ``name``, or None.

    Example: ``first_match(to_rules([("*.bias", replicate()), ("*", shard("fsdp"))]), "fc.bias") == 0``.
    """
    for i, rule in enumerate(rules):
        if rule.matches(name):
            return i
    return None


def rule_from_dict(d: object, where: str) -> Rule:
    """A rule from its plain-dict (TOML) form; ``where`` names it in errors.

    Example::

        >>> rule_from_dict({"pattern": "ln*", "layout": "replicate"}, "rules[1]")
        Rule('ln*', replicate())
    """
    if not isinstance(d, Mapping):
        raise SpecError(
            f"{where} is {d!r}; a rule is a table such as "
            "{pattern = '*', layout = 'shard', axis = 'fsdp'}"
        )
    if "pattern" not in d:
        raise SpecError(f"{where}: missing key 'pattern', a glob over parameter names such as '*'")
    pattern = _checked_pattern(d["pattern"], where)
    return Rule(pattern, layout_from_dict(d, where, extra_keys=("pattern",)))
