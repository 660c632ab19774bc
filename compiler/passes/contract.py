"""What each pass needs of the graph before it runs, and what it makes true for the passes after it.

A pass is a plain function ``(GraphModule, CompileContext) -> GraphModule``;
`graph_pass` attaches its contract: the `GraphProperty` values it *requires*
(made true by earlier passes), those it *establishes*, and those it
*invalidates* (it would break them, so it must run before any pass that
establishes them). The pipeline (`passes.pipeline.run_passes`) checks the
order before it runs anything: a pass whose requirement no earlier pass
established, or that would break what an earlier pass established, is an
error that names the pass, the property and the passes before it. A function
without a contract (a test's own pass) requires, establishes and breaks nothing.

The properties are the invariants the pass modules' docstrings state; the
tests of each pass check them on graphs.

Example::

    @graph_pass(requires={GraphProperty.PARAMETERS_GATHERED}, establishes={GraphProperty.GATHERS_FREED})
    def reshard_after_forward(gm, ctx): ...

    order_error(DEFAULT_PASSES)   # None: every requirement is met in order
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable

import attrs


class GraphProperty(enum.Enum):
    BATCH_STATS_ISSUED = "batch statistics are reduced by issued all-reduces and their waits"
    PARAMETERS_GATHERED = "every sharded flat parameter is gathered before its first forward use"
    ACTIVATIONS_RECOMPUTED = "the units that recompute make their activations again before backward"
    GATHERS_FREED = "every gathered buffer is freed after its last use (re-gathered for backward where resharded)"
    GATHERS_PREFETCHED = "gathers are issued their prefetch depth early"
    GRADIENTS_REDUCED = "every trainable flat parameter's gradient is packed, reduced, waited for and averaged"
    MICROBATCHES_ACCUMULATED = "every micro-batch has its own gathers and reductions, summed before the update"
    GRADIENTS_CLIPPED = "the updates read gradients clipped by their global norm, when clipping is asked"
    NONFINITE_SKIPPED = "a step with a non-finite gradient norm skips its update, when asked"
    REDUCTIONS_LIMITED = "at most one gradient reduction is in flight"
    UPDATED_SHARDS_GATHERED = "ZERO1 updates its slice and gathers the updated slices"
    OPTIMIZER_SHARDED = "the optimizer updates shards in place, every node with its final shape"
    GRADIENT_SUMS_IN_PLACE = "gradient sums write into a buffer nothing reads afterwards"
    LOCAL_REDUCTIONS_ELIDED = "reductions over one rank are gone; the updates read member gradients"
    REDUCTION_BUFFERS_KEPT = "the packs the bound step keeps between steps are marked"
    REDUCTIONS_IN_PLACE = "buffers made for their reduction alone are reduced in place, and averaged in place"
    SHAPES_PROPAGATED = "every node's meta['val'] holds its final shape"
    BUFFERS_ASSIGNED = "gathers and packs that may share the step's pool write into its slots"


@attrs.frozen
class Contract:
    requires: frozenset[GraphProperty] = frozenset()
    establishes: frozenset[GraphProperty] = frozenset()
    invalidates: frozenset[GraphProperty] = frozenset()


_NONE = Contract()


def graph_pass(*, requires: Iterable[GraphProperty] = (), establishes: Iterable[GraphProperty] = (),
               invalidates: Iterable[GraphProperty] = ()):
    """Attach a `Contract` to a pass function (the function itself is returned, unchanged otherwise)."""
    def mark(fn: Callable) -> Callable:
        fn.contract = Contract(frozenset(requires), frozenset(establishes), frozenset(invalidates))
        return fn
    return mark


def contract_of(fn: Callable) -> Contract:
    return getattr(fn, "contract", _NONE)


def order_error(passes) -> str | None:
    """Why ``passes`` cannot run in this order (naming the pass, the property, the passes before it); None if they can."""
    established: dict[GraphProperty, str] = {}
    before: list[str] = []
    for p in passes:
        name, contract = p.__name__, contract_of(p)
        missing = sorted(contract.requires - established.keys(), key=lambda prop: prop.name)
        if missing:
            return (f"pass {name} requires that {missing[0].value}, which no pass before it establishes "
                    f"(passes before: {before})")
        broken = sorted(contract.invalidates & established.keys(), key=lambda prop: prop.name)
        if broken:
            return (f"pass {name} must run before {established[broken[0]]}: it would break that "
                    f"{broken[0].value} (passes before: {before})")
        for prop in contract.establishes:
            established.setdefault(prop, name)
        before.append(name)
    return None
