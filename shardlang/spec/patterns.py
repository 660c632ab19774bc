"""Pattern tables: the ordered ``(pattern, value)`` lists of a spec, first match wins, read one way.

A spec says three things by pattern: each parameter's layout (``rules``), each
unit's strategy (``strategies``) and each unit's recompute policy
(``recompute``). All three are written the same way, as ordered pairs or as
TOML tables, and matched the same way: `fnmatch.fnmatchcase` over the whole
name, the first pattern that matches wins. `TableKind` says what differs (the
value, how it is read, how errors name it); `to_table` and `rule_from_table`
read any of them, and `PatternRule` is what their rules share.

Example::

    to_table([("blocks.*", "zero2")], STRATEGIES, StrategyRule)   # (StrategyRule('blocks.*', ZeRO2),)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from fnmatch import fnmatchcase

import attrs

from shardlang.errors import SpecError


@attrs.frozen
class TableKind:
    """One kind of pattern table: its name, how its values are read, and the words its errors use.

    ``to_value(value, where)`` checks and converts a value; ``value_from_table(d, where)`` reads it
    from a TOML table (which may hold more keys than ``value_key``, as a layout's ``axis``, and
    checks them: ``keys`` is None then). A value of type ``everywhere`` written alone means
    ``[("*", value)]``; a ``required`` table may not be empty.
    """

    name: str  # the Spec field: "rules", "strategies", "recompute"
    verb: str  # "are" or "is", after the name
    rule: str  # "a rule", "a strategy rule"
    value_word: str  # "layout", "strategy", "policy"
    pair: str  # "(pattern, layout)"
    over: str  # what the patterns match: "parameter names", "unit names"
    patterns: str  # example patterns, for errors
    example: str  # one pair, as Python
    list_example: str  # a whole list, as Python
    table_example: str  # one pair, as TOML
    to_value: Callable[[object, str], object]
    value_from_table: Callable[[Mapping, str], object]
    keys: tuple[str, ...] | None
    everywhere: type | None = None
    everywhere_example: str = ""
    required: bool = False


class PatternRule:
    """What every rule of a pattern table does: match whole names, unpack as the pair it is written as.

    A subclass is an attrs class whose first field is ``pattern`` (declared with `pattern_field`) and whose
    second is its value; its class attribute ``table`` is its `TableKind`.
    """

    __slots__ = ()
    table: TableKind

    def to_dict(self) -> dict[str, object]:
        """The plain-dict (TOML) form of a rule whose value is an enum: ``{'pattern': ..., <value key>: ...}``."""
        pattern, value = self
        return {"pattern": pattern, self.table.keys[1]: value.value}

    def matches(self, name: str) -> bool:
        """Whether the pattern matches all of ``name`` (``*`` crosses dots)."""
        return fnmatchcase(name, self.pattern)

    def __iter__(self) -> Iterator[object]:
        return iter(attrs.astuple(self, recurse=False))

    def _repr_pretty_(self, printer: object, cycle: bool) -> None:
        """Show the constructor-call repr in IPython and in Hypothesis's reports too."""
        printer.text(repr(self))  # type: ignore[attr-defined]


def pattern_field():
    """The ``pattern`` field of a `PatternRule`: a non-empty glob, checked with the rule's class named in errors."""
    return attrs.field(validator=lambda rule, _a, p: checked_pattern(p, type(rule).__name__, rule.table))


def checked_pattern(pattern: object, where: str, kind: TableKind) -> str:
    """``pattern`` if it is a non-empty str; else a `SpecError` naming ``where``."""
    if not isinstance(pattern, str) or not pattern:
        raise SpecError(f"{where}: pattern is {pattern!r}; a pattern is a non-empty glob over {kind.over} such as "
                        f"{kind.patterns}")
    return pattern


def to_table(value: object, kind: TableKind, rule_type: type[PatternRule]):
    """Check a table written as rules or ``(pattern, value)`` pairs (or one value alone) and return its rules.

    ``rule_type(pattern, value)`` is one rule. None stays None unless the table is ``required``.
    Errors name the entry's index and value.
    """
    if value is None and not kind.required:
        return None
    if kind.everywhere is not None and isinstance(value, kind.everywhere):
        return (rule_type("*", value),)
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        alone = (f", or one {kind.value_word} for every unit, e.g. {kind.everywhere_example}"
                 if kind.everywhere is not None else "")
        raise SpecError(f"{kind.name} is {value!r}; {kind.name} {kind.verb} a list of {kind.pair} pairs, first match "
                        f"wins, e.g. [{kind.list_example}]{alone}")
    if kind.required and not value:
        raise SpecError(f"{kind.name} is empty; every parameter must match a rule, so give at least one, "
                        f"e.g. [{kind.list_example}]")
    rules = []
    for i, item in enumerate(value):
        where = f"{kind.name}[{i}]"
        if isinstance(item, rule_type):
            rules.append(item)
            continue
        if isinstance(item, (str, bytes)) or not isinstance(item, Sequence) or len(item) != 2:
            raise SpecError(f"{where} is {item!r}; {kind.rule} is a {kind.pair} pair such as {kind.example}")
        pattern, v = item
        rules.append(rule_type(checked_pattern(pattern, where, kind), kind.to_value(v, where)))
    return tuple(rules)


def rule_from_table(d: object, where: str, kind: TableKind, rule_type: type[PatternRule]):
    """One rule from its plain-dict (TOML) form; ``where`` names it in errors."""
    if not isinstance(d, Mapping):
        raise SpecError(f"{where} is {d!r}; {kind.rule} is a table such as {kind.table_example}")
    if kind.keys is not None:
        for key in d:
            if key not in kind.keys:
                raise SpecError(f"{where}: unknown key {key!r}; valid keys are {list(kind.keys)}")
    for key in kind.keys or ("pattern",):
        if key not in d:
            raise SpecError(f"{where}: missing key {key!r}; {kind.rule} is a table such as {kind.table_example}")
    pattern = checked_pattern(d["pattern"], where, kind)
    return rule_type(pattern, kind.value_from_table(d, where))


def first_match(rules: Sequence[PatternRule], name: str) -> int | None:
    """The index of the first rule whose pattern matches ``name``, or None.

    Example: ``first_match(to_rules([("*.bias", replicate()), ("*", shard("fsdp"))]), "fc.bias") == 0``.
    """
    for i, rule in enumerate(rules):
        if rule.matches(name):
            return i
    return None
