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

import attrs

from shardlang.errors import SpecError
from shardlang.spec.patterns import PatternRule, TableKind, pattern_field, rule_from_table, to_table
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


STRATEGIES = TableKind(
    name="strategies", verb="are", rule="a strategy rule", value_word="strategy", pair="(unit pattern, strategy)",
    over="unit names", patterns="'blocks.*', '*' or '<root>'", example="('blocks.*', sl.ZeRO3)",
    list_example="('blocks.*', sl.ZeRO3), ('*', sl.DDP)",
    table_example="{pattern = 'blocks.*', strategy = 'zero3'}",
    to_value=to_strategy, value_from_table=lambda d, where: to_strategy(d["strategy"], where),
    keys=("pattern", "strategy"), everywhere=Strategy, everywhere_example="sl.ZeRO2")


@attrs.frozen(repr=False)
class StrategyRule(PatternRule):
    """Units whose name matches ``pattern`` use ``strategy``. Unpacks like the pair it is written as.

    Example::

        >>> rule = StrategyRule("blocks.*", ZeRO2)
        >>> rule
        StrategyRule('blocks.*', ZeRO2)
        >>> rule.matches("blocks.3"), rule.matches("<root>")
        (True, False)
    """

    table = STRATEGIES  # to_dict: ``{'pattern': 'blocks.*', 'strategy': 'zero2'}``
    pattern: str = pattern_field()
    strategy: Strategy = attrs.field(converter=lambda s: to_strategy(s, "StrategyRule"))

    def __repr__(self) -> str:
        return f"StrategyRule({self.pattern!r}, {strategy_repr(self.strategy)})"


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
    return to_table(value, STRATEGIES, StrategyRule)


def strategy_rule_from_dict(d: object, where: str) -> StrategyRule:
    """A strategy rule from its plain-dict (TOML) form; ``where`` names it in errors.

    Example::

        >>> strategy_rule_from_dict({"pattern": "blocks.*", "strategy": "zero2"}, "strategies[0]")
        StrategyRule('blocks.*', ZeRO2)
    """
    return rule_from_table(d, where, STRATEGIES, StrategyRule)
