"""``shardlang tune``: the compiler chooses the spec under a memory budget (docs/tune.md).

`search.tune` searches layouts (unit granularity, strategy, mesh split, blocks grouped) and, in
each, the budget search's recompute and prefetch (Note [the tune search]);
`measure.measure` runs the leading specs for real (``--measure K``).
"""

from .search import Evaluated, Layout, TuneResult, Unfit, held_lower_bound, layouts, tune

__all__ = ["Evaluated", "Layout", "TuneResult", "Unfit", "held_lower_bound", "layouts", "tune"]
