"""Strategies: what each unit shards (parameters, gradients, optimizer state) and so what it communicates.

Four strategies, the ZeRO stages and DDP (docs/strategies.md has the formulas):

- ``ZeRO3`` (full sharding, FSDP's FULL_SHARD): parameters, gradients and
  optimizer state sharded; a unit is gathered for forward, freed, gathered
  again for backward, and its gradient reduce-scattered.
- ``ZeRO2`` (FSDP's SHARD_GRAD_OP): the same, but the parameters gathered for
  forward are kept for backward (one gather per step).
- ``ZeRO1``: every rank holds the whole parameters; gradients are
  reduce-scattered, each rank updates its slice with sharded optimizer state,
  and the updated slices are all-gathered back into the whole.
- ``DDP`` (FSDP's NO_SHARD): nothing sharded; gradients are all-reduced.

Strategies are chosen per unit with ordered ``(pattern, strategy)`` pairs,
first match wins, in `Spec(strategies=...)`. Patterns are globs over unit
names (``blocks.0``; the root unit is ``<root>``), matched like rules::

    strategies=[("blocks.*", sl.ZeRO3), ("*", sl.DDP)]   # blocks fully sharded, the rest replicated

A unit no pattern matches gets the default: ZeRO3, or ZeRO2 with
``Options(reshard_after_forward=False)``. The layouts from the rules still say
how a sharded parameter is split (flat or along a dim, over which axis); a
``replicate()`` parameter is DDP whatever its unit's strategy.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from fnmatch import fnmatchcase

import attrs

from shardlang.errors import SpecError
from shardlang.spec.vocabulary import Strategy

__all__ = ["DDP", "Strategy", "StrategyRule", "ZeRO1", "ZeRO2", "ZeRO3", "strategy_rule_from_dict", "to_strategies",
           "to_strategy"]

ZeRO3 = Strategy.ZERO3
"""Full sharding: parameters, gradients and optimizer state; parameters re-gathered for backward."""
ZeRO2 = Strategy.ZERO2
"""Gradient and optimizer sharding; parameters gathered once, kept from forward to backward."""
ZeRO1 = Strategy.ZERO1
"""Optimizer-state sharding: whole parameters, reduce-scattered gradients, updated slices all-gathered."""
DDP = Strategy.DDP
"""No sharding: whole parameters and optimizer state on every rank, gradients all-reduced."""

_NAMES = {
    "zero3": ZeRO3, "zero-3": ZeRO3, "full_shard": ZeRO3,
    "zero2": ZeRO2, "zero-2": ZeRO2, "shard_grad_op": ZeRO2,
    "zero1": ZeRO1, "zero-1": ZeRO1,
    "ddp": DDP, "no_shard": DDP,
}
_EXAMPLE = "('blocks.*', sl.ZeRO3)"
_STRATEGY_KEYS = ("pattern", "strategy")


def to_strategy(value: object, where: str) -> Strategy:
    """A `Strategy` from itself or its name (``"zero3"``, ``"ZeRO-2"``, ``"ddp"``; FSDP's ``"full_shard"``,
    ``"shard_grad_op"``, ``"no_shard"``; any case). ``where`` names it in errors.

    Example: ``to_strategy("ZeRO2", "strategies[0]") is ZeRO2``.
    """
    if isinstance(value, Strategy):
        return value
    if isinstance(value, str) and value.lower() in _NAMES:
        return _NAMES[value.lower()]
    raise SpecError(
        f"{where}: strategy is {value!r}; valid strategies are sl.ZeRO3, sl.ZeRO2, sl.ZeRO1 and sl.DDP "
        f"(as strings {[s.value for s in Strategy]})"
    )


def _check_pattern(_instance: object, _attribute: object, pattern: object) -> None:
    if not isinstance(pattern, str) or not pattern:
        raise SpecError(
            f"StrategyRule: pattern is {pattern!r}; a pattern is a non-empty glob over unit names such as "
            "'blocks.*', '*' or '<root>'"
        )


@attrs.frozen(repr=False)
class StrategyRule:
    """Units whose name matches ``pattern`` use ``strategy``. Unpacks like the pair it is written as.

    Example::

        >>> rule = StrategyRule("blocks.*", ZeRO2)
        >>> rule
        StrategyRule('blocks.*', ZeRO2)
        >>> rule.matches("blocks.3"), rule.matches("<root>")
        (True, False)
    """

    pattern: str = attrs.field(validator=_check_pattern)
    strategy: Strategy = attrs.field(converter=lambda s: to_strategy(s, "StrategyRule"))

    def __repr__(self) -> str:
        return f"StrategyRule({self.pattern!r}, {strategy_repr(self.strategy)})"

    def _repr_pretty_(self, printer: object, cycle: bool) -> None:
        printer.text(repr(self))  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator[object]:
        return iter((self.pattern, self.strategy))

    def matches(self, unit_label: str) -> bool:
        """Whether ``pattern`` matches all of a unit's label (``<root>`` for the root unit)."""
        return fnmatchcase(unit_label, self.pattern)

    def to_dict(self) -> dict[str, object]:
        """The plain-dict (TOML) form. Example: ``{'pattern': 'blocks.*', 'strategy': 'zero2'}``."""
        return {"pattern": self.pattern, "strategy": self.strategy.value}


def strategy_repr(strategy: Strategy) -> str:
    """The public name of a strategy: ``ZeRO3``, ``ZeRO2``, ``ZeRO1`` or ``DDP``."""
    return {ZeRO3: "ZeRO3", ZeRO2: "ZeRO2", ZeRO1: "ZeRO1", DDP: "DDP"}[strategy]


def to_strategies(value: object) -> tuple[StrategyRule, ...] | None:
    """Check ``strategies`` and return them as a tuple of `StrategyRule`; None stays None.

    Accepts a list of `StrategyRule` or ``(pattern, strategy)`` pairs, or one
    strategy alone, meaning every unit (``[("*", strategy)]``). Example::

        >>> to_strategies([("blocks.*", ZeRO3), ("*", "ddp")])
        (StrategyRule('blocks.*', ZeRO3), StrategyRule('*', DDP))
        >>> to_strategies(ZeRO1)
        (StrategyRule('*', ZeRO1),)
    """
    if value is None:
        return None
    if isinstance(value, Strategy):
        return (StrategyRule("*", value),)
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise SpecError(
            f"strategies is {value!r}; strategies are a list of (unit pattern, strategy) pairs, first match "
            f"wins, e.g. [{_EXAMPLE}, ('*', sl.DDP)], or one strategy for every unit, e.g. sl.ZeRO2"
        )
    rules = []
    for i, item in enumerate(value):
        where = f"strategies[{i}]"
        if isinstance(item, StrategyRule):
            rules.append(item)
            continue
        if isinstance(item, (str, bytes)) or not isinstance(item, Sequence) or len(item) != 2:
            raise SpecError(f"{where} is {item!r}; a strategy rule is a (unit pattern, strategy) pair such as "
                            f"{_EXAMPLE}")
        pattern, strategy = item
        if not isinstance(pattern, str) or not pattern:
            raise SpecError(f"{where}: pattern is {pattern!r}; a pattern is a non-empty glob over unit names such "
                            "as 'blocks.*', '*' or '<root>'")
        rules.append(StrategyRule(pattern, to_strategy(strategy, where)))
    return tuple(rules)


def strategy_rule_from_dict(d: object, where: str) -> StrategyRule:
    """A strategy rule from its plain-dict (TOML) form; ``where`` names it in errors.

    Example::

        >>> strategy_rule_from_dict({"pattern": "blocks.*", "strategy": "zero2"}, "strategies[0]")
        StrategyRule('blocks.*', ZeRO2)
    """
    if not isinstance(d, Mapping):
        raise SpecError(f"{where} is {d!r}; a strategy rule is a table such as "
                        "{pattern = 'blocks.*', strategy = 'zero3'}")
    for key in d:
        if key not in _STRATEGY_KEYS:
            raise SpecError(f"{where}: unknown key {key!r}; valid keys are {list(_STRATEGY_KEYS)}")
    for key in _STRATEGY_KEYS:
        if key not in d:
            raise SpecError(f"{where}: missing key {key!r}; a strategy rule is a table such as "
                            "{pattern = 'blocks.*', strategy = 'zero3'}")
    (rule,) = to_strategies([(d["pattern"], to_strategy(d["strategy"], where))])
    return rule
