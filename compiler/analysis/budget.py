"""The memory budget's search: per unit a recompute policy, and a prefetch depth, that fit at the least time.

`fit_budget` is given a function that compiles the step (one trace, many
option sets: `compile_step(traced=...)`) and the units it may choose for. A
configuration is a recompute policy per unit and a prefetch depth; its planned
peak is the memory plan's (`compiler.analysis.memory`, with the collective scratch of
the cost model's link: gloo's copies, none for NCCL) and its predicted step time the
cost model's (`compiler.analysis.cost`). The search, with four to ten compiles whatever
the number of units:

1. No recompute at the base depth. If it fits, only prefetch is left to choose.
2. For "selective" and then "full": the first k units (in forward order: the
   earliest units keep their activations the longest, so recomputing them helps
   the peak most) take the policy, the others none. The peak falls with k, so
   the least k that fits is guessed from k = 0 and k = all (the activation
   bytes the policy saves each unit, read off both memory plans): a guess that
   fits is the least (Note [the least k]), one that misses steps up to the
   boundary.
3. The fastest fitting configuration then tries deeper prefetch (more overlap,
   more gathered memory) while it fits and predicts faster.

Note [policy floor]: before searching "full", the search bounds from below
what any fitting "full" configuration could predict, and skips the policy when
the bound is no faster than a fitting configuration already found (a "full"
search costs two to four compiles). The bound is the larger of two:
  - the first configuration's predicted step (no recompute, the same depth):
    the cost model plays the ops in a fixed order, each starting when its
    inputs and its lane are free, so the compute that recompute adds can
    delay ops but never advance one. This is the bound that holds when the
    step is communication-bound (the 70B plan: "selective" there is predicted
    as fast as keeping everything, so nothing can beat it);
  - its compute plus the compute of what recompute would copy: recomputing
    unit u lowers the peak by at most the bytes u keeps (the memory plan's
    per-unit rows), so no k below the least one whose kept bytes cover the
    excess fits, and a step is predicted at least its compute (waits only
    add), which the cost model sums over nodes. The copies of the first k
    units (`recomputed_nodes`, the pass's own selection) cost what their
    originals do, its kernels, that is: an alias the pass need not copy (a
    getitem nobody reads) is not counted. This bound grows with k, so it
    holds at the least k that fits.
The choice is the same as without the skip (a tie goes to the policy found
first either way). With the fused cost model (fusion is not a sum over nodes,
and recompute can change what fuses) nothing is skipped.

Note [no recompute fits]: recomputing a unit lowers the peak by at most the
bytes it keeps (as above), so when the first configuration's peak less every
unit's kept bytes is over the budget, no policy on any k fits at that depth,
and a search for a caller comparing many layouts (``give_up`` given:
`shardlang tune`) searches neither policy: each would compile k = n to learn
it, and at 70B a layout over the budget by hundreds of GiB (the whole model
as one unit) costs four compiles more. It goes on to no prefetch, as when the
policies' searches find nothing, so its `BudgetError` names the leanest of
fewer configurations. A plan of the user's own compiles k = n, so that its
error says how far even recomputing every unit is from the budget.

Note [search floor]: the same compute terms bound from below what the whole
search can return, once its first configuration is compiled: when that
configuration fits, every later one keeps its recompute (only prefetch is
left to choose), so each is predicted at least the first one's compute; when
it does not, the search may yet fall back to no prefetch and no recompute
(when no configuration at its depth fits), so the bound is the compute alone
until one at that depth fits; from then on, the search returns one at that
depth or deeper, recomputing some policy on the first k units, k at least
the least one whose kept bytes cover the excess (as above), so each is
predicted at least the lesser of the two policies' compute terms. A
policy's saving per unit is what the unit keeps, or, once a configuration
compiled with the unit under that policy, its kept bytes less what it keeps
then (that configuration's own rows: "selective" saves far less than the
unit keeps, and counting it so would make its term the lesser by far); a
policy whose savings cannot cover the excess has no term. The
compute here is the sum of the ops' node times without contention (Note
[contention] slows compute only while a collective is in flight, and another
configuration overlaps differently), so the bound holds whatever the
overlap. The bound is worked out again before each compile. A caller searching many layouts (`shardlang tune`)
is told it (``give_up``) and stops a layout whose bound cannot lead.

The chosen configuration is the fitting one of least predicted time; the
runner-up is the next best.

Note [the least k]: the first guess is the least k whose savings cover the
excess of the k = 0 peak over the budget, a unit's saving being what it stops
keeping under the policy (its memory plan rows at k = 0 and k = n). At the
moment of the k = 0 peak, recomputing unit u lowers the bytes live by at most
its saving: its kept activations give way to what the policy keeps of them,
and the copies recompute makes live only add. So the peak of the first k - 1
units recomputed is at least the k = 0 peak less their savings, which by the
guess's definition is over the budget: when the guess fits, k - 1 is not
compiled to confirm it. The bound needs the rows to be the step's own, so the
guess's plan must show the same rows for those units (rows from another layout
are checked so, Note [warm start]); where they differ, or the guess was
interpolated, the search steps down as before. A guess that misses steps up.

Note [warm start]: the k = n configuration of step 2 is compiled for its
memory plan's rows, what each unit keeps under the policy. Those rows are the
activations of the units alone: another layout of the same units (another
mesh split, strategy or grouping, which change parameters, not activations)
has the same. ``kept_under`` hands them from one search to the next
(`BudgetChoice.kept_under`), and the first guess is read from them: where
they say the policy's savings cover the excess, k = n is not compiled (a
compile of each policy at 70B). They serve as a guess only, so a wrong row
costs compiles, never the choice: the guess's own plan must show the same rows
before Note [the least k] takes it, else the search steps to the boundary
(peaks fall with k); and k = n is compiled where the rows say it may not fit.

Note [pool after the search]: the search compiles each configuration without
the step's buffer pool, and ``finish`` (`compile_step`'s `with_buffer_pool`)
pools the chosen one alone, against the memory plan the search used (its
link's collective scratch). The pool holds a slot only where that plan's peak
does not rise (`analysis.pool_choice`), and the cost model counts a slot as no
kernel, so every configuration is planned and predicted the same with the
pool or without it. Pooling each configuration cost a quarter of each compile
on the 70B plan (a memory plan, a graph copy and a shape propagation more)
for a choice it does not change. The chosen configuration is reported as
pooled: its peak and predicted time are read from the finished step, so they
are the plan's (a pooled step over the budget would stay unpooled).

When nothing fits, `BudgetError` says by how much the leanest configuration
misses and what would fit (more ranks, a smaller batch, ZeRO-3 for units that
do not use it).

Example::

    step, choice = fit_budget(80 * 2**30, compile_at, units=("layers.0", ...), base_prefetch=1)
    print(choice.summary_text())
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import attrs

from shardlang.errors import SpecError
from shardlang.spec.vocabulary import Recompute
from ..ir.graph_utils import is_alias_op
from ..schedule.schedule import OpKind
from ..schedule.schedule_format import human_bytes


class BudgetError(SpecError):
    """No configuration fits ``Options.memory_budget``; the message says by how much and what would fit.

    ``leanest_peak`` is the planned peak of the leanest configuration the search compiled.
    """

    def __init__(self, message: str, *, leanest_peak: int | None = None):
        super().__init__(message)
        self.leanest_peak = leanest_peak


class SearchAbandoned(Exception):
    """The budget search stopped before a compile, as ``give_up`` asked: ``reason`` says why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@attrs.frozen
class BudgetHints:
    """What a caller that searches many layouts (`shardlang tune`) hands each layout's budget search.

    ``kept_under``: a `BudgetChoice.kept_under` of a search over the same units, where
    this one starts (Note [warm start]). ``give_up(step, floor_s)``: called with the
    first configuration compiled and a lower bound of the predicted step of any
    configuration the search can return (Note [search floor]), before each further
    compile; a reason (a string) ends the search with `SearchAbandoned`, when the
    caller can tell that no configuration of it is of use to it (any longer).
    """

    kept_under: Mapping[str, Mapping[str, int]] = attrs.field(factory=dict)
    give_up: Callable[[object, float], str | None] | None = None


@attrs.frozen
class Candidate:
    """One configuration the search compiled: recompute per unit (only those not NONE), depth, peak, time."""

    recompute: tuple[tuple[str, str], ...]
    prefetch: int
    peak: int
    step_time_s: float
    policy: str = attrs.field(default="none", repr=False)  # the searched policy, on the first ``k`` units
    k: int = attrs.field(default=0, repr=False)
    kept: dict = attrs.field(factory=dict, repr=False, eq=False)  # unit -> activation bytes kept (memory plan)
    exposed_comm_s: float = attrs.field(default=0.0, repr=False)  # of step_time_s, communication not hidden

    def describe(self) -> str:
        """``"recompute full on layers.0..layers.79 (80 units), prefetch 1"``."""
        by_policy: dict[str, list[str]] = {}
        for unit, policy in self.recompute:
            by_policy.setdefault(policy, []).append(unit or "<root>")
        parts = [f"{policy} on {_span(units)}" for policy, units in by_policy.items()]
        return f"recompute {'; '.join(parts) if parts else 'none'}, prefetch {self.prefetch}"

    def to_dict(self) -> dict:
        return {"recompute": dict(self.recompute), "prefetch": self.prefetch, "peak": self.peak,
                "step_time_s": self.step_time_s}


@attrs.frozen
class BudgetChoice:
    """What the search chose within ``budget`` bytes per rank, the runner-up, and every configuration tried."""

    budget: int
    chosen: Candidate
    runner_up: Candidate | None
    tried: tuple[Candidate, ...]
    # policy -> unit -> activation bytes the unit keeps when every unit takes the policy (Note [warm start])
    kept_under: dict = attrs.field(factory=dict, repr=False, eq=False)

    def summary_text(self) -> str:
        c = self.chosen
        lines = [f"memory budget {human_bytes(self.budget)} per rank: chose {c.describe()}",
                 f"  planned peak {human_bytes(c.peak)} ({100 * c.peak / self.budget:.1f}% of the budget), "
                 f"predicted step {_s(c.step_time_s)}: the fastest of {self._fitting()} configurations that fit "
                 f"({len(self.tried)} compiled)"]
        r = self.runner_up
        if r is not None:
            why = (f"{100 * (r.step_time_s / c.step_time_s - 1):.1f}% slower" if r.peak <= self.budget
                   else f"over the budget by {human_bytes(r.peak - self.budget)}")
            lines.append(f"  runner-up: {r.describe()}: peak {human_bytes(r.peak)}, predicted step "
                         f"{_s(r.step_time_s)} ({why})")
        return "\n".join(lines)

    def _fitting(self) -> int:
        return sum(1 for t in self.tried if t.peak <= self.budget)

    def to_dict(self) -> dict:
        return {"budget": self.budget, "chosen": self.chosen.to_dict(),
                "runner_up": None if self.runner_up is None else self.runner_up.to_dict(),
                "tried": [t.to_dict() for t in self.tried]}


def fit_budget(budget: int, compile_at: Callable[[dict, int], object], units: Sequence[str], *,
               base_prefetch: int = 1, max_prefetch: int | None = None, cost_model=None,
               fixed: dict | None = None, hints: Callable[[object], list[str]] | None = None,
               finish: Callable[[object], object] | None = None,
               kept_under: Mapping[str, Mapping[str, int]] | None = None,
               give_up: Callable[[object, float], str | None] | None = None):
    """The compiled step of the fastest configuration whose planned peak fits ``budget``, and the `BudgetChoice`.

    ``compile_at(recompute, prefetch)`` compiles with ``recompute`` (unit ->
    `Recompute`) and a prefetch depth; ``units`` are those the search may
    choose a policy for, in forward order; ``fixed`` the policies the spec set
    itself (kept in every configuration). ``hints(leanest compiled step)`` gives
    the "what would fit" lines of a `BudgetError`. ``finish(step)`` completes the
    chosen configuration's step (Note [pool after the search]). ``kept_under``: a
    `BudgetChoice.kept_under` of another search over the same units (Note [warm start]);
    ``give_up``: `BudgetHints.give_up`.
    """
    from .cost import CostModel

    cost_model = cost_model or CostModel()
    fixed = dict(fixed or {})
    max_prefetch = len(units) + 1 if max_prefetch is None else max_prefetch
    compiled: dict[tuple, tuple[object, Candidate]] = {}
    base: dict[str, object] = {}  # the first configuration's memory plan and timeline (Note [policy floor])
    backend = cost_model.link.backend  # the plans count this link's collective scratch

    def evaluate(policy: Recompute, k: int, depth: int) -> Candidate:
        chosen = {u: policy for u in units[:k]} if policy is not Recompute.NONE else {}
        recompute = {**chosen, **fixed}
        key = (tuple(sorted((u, p.value) for u, p in recompute.items())), depth)
        if key not in compiled:
            if give_up is not None and base:
                tried = [c for _, c in compiled.values()]
                fitted = any(c.prefetch == base_prefetch and fits(c) for c in tried)
                floor = search_floor(*base["step"], units, budget, cost_model, fitted, tried,
                                     base.setdefault("floors", {}))
                if (reason := give_up(base["step"][0], floor)) is not None:
                    raise SearchAbandoned(reason)
            step = compile_at(recompute, depth)
            shown = tuple((u, p.value) for u, p in recompute.items() if p is not Recompute.NONE)
            memory, timeline = step.memory_on(backend), cost_model.predict(step.schedule, step.graph_module)
            base.setdefault("step", (step, memory, timeline))
            kept = {u.unit: u.kept for u in memory.units}
            compiled[key] = (step, Candidate(shown, depth, memory.peak, timeline.step_time_s, policy.value, k, kept,
                                             timeline.exposed_comm_s))
        return compiled[key][1]

    fits = lambda c: c.peak <= budget  # noqa: E731
    found = [evaluate(Recompute.NONE, 0, base_prefetch)]
    if not fits(found[0]) and not (give_up is not None and _beyond_recompute(base["step"][1], units, budget)):
        for policy in (Recompute.SELECTIVE, Recompute.FULL):
            fastest = min((c.step_time_s for c in found if fits(c)), default=math.inf)
            if _policy_floor(*base["step"], policy, units, budget, cost_model) >= fastest:
                continue  # Note [policy floor]: its least fitting k cannot be faster
            k = _least_k(lambda k, p=policy: evaluate(p, k, base_prefetch), units, budget,
                         (kept_under or {}).get(policy.value))
            if k is not None:
                found.append(evaluate(policy, k, base_prefetch))
    feasible = [c for c in found if fits(c)]
    if not feasible and base_prefetch > 0:  # less prefetch, less gathered memory
        feasible = [c for c in (_with_depth(evaluate, c, 0) for c in found) if fits(c)]
    if not feasible:
        leanest, candidate = min(compiled.values(), key=lambda entry: entry[1].peak)
        raise BudgetError(_no_fit(budget, candidate, hints(leanest) if hints else []), leanest_peak=candidate.peak)
    best = min(feasible, key=lambda c: c.step_time_s)
    depth = best.prefetch
    while depth < max_prefetch:  # deeper prefetch while it fits and is faster
        deeper = _with_depth(evaluate, best, depth + 1)
        depth += 1
        if not fits(deeper) or deeper.step_time_s >= best.step_time_s:
            break
        best = deeper
    step = next(s for s, c in compiled.values() if c == best)
    others = [c for _, c in compiled.values() if c != best]
    if finish is not None:  # Note [pool after the search]: the chosen step as it will run, and its own figures
        finished = finish(step)
        if finished is not step and (peak := finished.memory_on(backend).peak) <= budget:
            timeline = cost_model.predict(finished.schedule, finished.graph_module)
            step, best = finished, attrs.evolve(best, peak=peak, step_time_s=timeline.step_time_s,
                                                exposed_comm_s=timeline.exposed_comm_s)
    tried = (best, *others)
    ranked = sorted((c for c in others if fits(c)), key=lambda c: c.step_time_s) or sorted(others, key=lambda c: c.peak)
    learnt = {c.policy: c.kept for _, c in compiled.values() if c.k == len(units) and c.policy != "none"}
    return step, BudgetChoice(budget, best, ranked[0] if ranked else None, tried, {**(kept_under or {}), **learnt})


def _policy_floor(step, memory, timeline, policy: Recompute, units: Sequence[str], budget: int,
                  cost_model) -> float:
    """Note [policy floor]: a lower bound on the predicted step of ``policy`` on the first k units, k that could fit.

    ``step`` is the search's first configuration (no recompute on ``units``),
    with its memory plan and timeline.
    """
    if cost_model.fused:
        return -math.inf  # fused costs are not a sum over nodes: no bound
    copies, _ = _recompute_time(step, memory, policy, units, budget, cost_model, _kept(memory))
    return max(timeline.step_time_s, timeline.compute_s + copies)


def search_floor(step, memory, timeline, units: Sequence[str], budget: int, cost_model,
                 fitted: bool = True, tried: Sequence[Candidate] = (), memo: dict | None = None) -> float:
    """Note [search floor]: no configuration the search returns is predicted faster than this.

    ``step`` is the search's first configuration (no recompute on ``units``),
    with its memory plan and timeline; ``fitted``: whether a configuration at
    its depth fits already; ``tried``: the configurations compiled so far,
    whose rows say what a recomputed unit keeps; ``memo``: kept between the
    calls of one search (the compute, the copies' time per policy and k). 0
    under the fused cost model (no bound).
    """
    if cost_model.fused:
        return 0.0
    memo = {} if memo is None else memo
    if "compute" not in memo:
        node_time = cost_model.compute.node_time
        nodes = {n.name: n for n in step.graph_module.graph.nodes}
        memo["compute"] = sum(node_time(nodes[name]) for op in step.schedule.ops
                              if op.kind in (OpKind.COMPUTE, OpKind.OPTIMIZER)
                              for name in op.node_names if name in nodes)
    compute = memo["compute"]
    if memory.peak <= budget or not fitted or _beyond_recompute(memory, units, budget):
        return compute  # Note [search floor]: until one fits at this depth, it may fall back to depth 0 and none
    terms = [copies for policy in (Recompute.SELECTIVE, Recompute.FULL)
             for copies, reaches in [_recompute_time(step, memory, policy, units, budget, cost_model,
                                                     _savings(memory, policy, units, tried), memo)] if reaches]
    return compute + min(terms, default=0.0)


def _beyond_recompute(memory, units: Sequence[str], budget: int) -> bool:
    """Note [no recompute fits]: whether the peak less every unit's kept bytes is still over the budget."""
    chosen = set(units)
    return memory.peak - sum(u.kept for u in memory.units if u.unit in chosen) > budget


def _kept(memory) -> dict[str, int]:
    return {u.unit: u.kept for u in memory.units}


def _savings(memory, policy: Recompute, units: Sequence[str], tried: Sequence[Candidate]) -> dict[str, int]:
    """The most recomputing each unit under ``policy`` lowers the peak by (Note [search floor]): what it keeps,
    less what it still keeps under the policy where a configuration compiled with it recomputed shows that."""
    kept = _kept(memory)
    saving = dict(kept)
    for c in tried:
        if c.policy == policy.value:
            for u in units[:c.k]:
                saving[u] = min(saving.get(u, 0), kept.get(u, 0) - c.kept.get(u, 0))
    return saving


def _recompute_time(step, memory, policy: Recompute, units: Sequence[str], budget: int, cost_model,
                    saving: Mapping[str, int], memo: dict | None = None) -> tuple[float, bool]:
    """Seconds of the copies ``policy`` makes on the least k first units whose ``saving`` covers the excess,
    and whether it does (else k is every unit)."""
    from ..passes.recompute_activations import recomputed_nodes

    k, peak = 0, memory.peak
    while k < len(units) and peak > budget:  # the least k whose recompute could bring the peak under the budget
        peak -= saving.get(units[k], 0)
        k += 1
    memo = {} if memo is None else memo
    if (policy, k) not in memo:
        copies = recomputed_nodes(step.graph_module, {u: policy for u in units[:k]})
        node_time = cost_model.compute.node_time
        # an alias (a getitem of an output nobody reads, a detach) need not be copied: only kernels are counted
        memo[policy, k] = sum(node_time(n) for nodes in copies.values() for n in nodes if not is_alias_op(n))
    return memo[policy, k], peak <= budget


def _with_depth(evaluate, candidate: Candidate, depth: int) -> Candidate:
    """``candidate`` at another prefetch depth."""
    return evaluate(Recompute(candidate.policy), candidate.k, depth)


def _least_k(peak_at: Callable[[int], Candidate], units: Sequence[str], budget: int,
             known: Mapping[str, int] | None = None) -> int | None:
    """The least k in [0, n] with ``peak_at(k).peak <= budget`` (peaks fall with k), or None when even n misses.

    The first guess reads what the policy saves each unit (`_first_guess`);
    a guess that fits is the least (Note [the least k]); one that misses
    steps up a unit at a time. ``known``: what each unit keeps under the
    policy, learnt from another layout (Note [warm start]); when those
    savings cover the excess, k = n is not compiled.
    """
    n = len(units)
    if n == 0:
        return None
    low = peak_at(0)
    if low.peak <= budget:
        return 0
    rows = known
    k = _first_guess(low, rows, units, budget) if rows is not None else None
    if k is None:  # no rows learnt, or they say even k = n may miss: compile it
        high = peak_at(n)
        if high.peak > budget:
            return None
        rows = high.kept
        k = _first_guess(low, rows, units, budget)
        if k is None:
            rows, k = None, _interpolated(low, high, n, budget)
    guessed = peak_at(k)
    if guessed.peak <= budget:
        if rows is not None and all(guessed.kept.get(u, 0) == rows.get(u, 0) for u in units[:k - 1]):
            return k  # Note [the least k]: k - 1 misses
        while k > 1 and peak_at(k - 1).peak <= budget:  # step down to the boundary
            k -= 1
        return k
    while k < n and peak_at(k).peak > budget:  # step up to it
        k += 1
    return k if peak_at(k).peak <= budget else None


def _first_guess(low: Candidate, kept: Mapping[str, int], units: Sequence[str], budget: int) -> int | None:
    """The least k whose savings, unit by unit, would bring ``low``'s peak under ``budget``; None when they cannot.

    A unit's saving is the activation bytes the policy stops keeping (its
    memory plan rows at k = 0, ``low``'s, and ``kept``, at k = n). While the
    peak stays where it was (the start of backward, when every kept activation
    is live) it falls by exactly that; once it moves elsewhere it falls by
    less, and the search steps up from the guess.
    """
    needed = low.peak - budget
    done = 0
    for k, unit in enumerate(units, start=1):
        done += max(0, low.kept.get(unit, 0) - kept.get(unit, 0))
        if done >= needed:
            return k
    return None


def _interpolated(low: Candidate, high: Candidate, n: int, budget: int) -> int:
    """When the savings cannot cover the excess: k in proportion to where ``budget`` lies between the two peaks."""
    return min(n, max(1, math.ceil(n * (low.peak - budget) / max(1, low.peak - high.peak))))


def _no_fit(budget: int, leanest: Candidate, hints: list[str]) -> str:
    lines = [f"Options.memory_budget={human_bytes(budget)} per rank: no configuration fits. The leanest, "
             f"{leanest.describe()}, has a planned peak of {human_bytes(leanest.peak)}: "
             f"{human_bytes(leanest.peak - budget)} over"]
    if hints:
        lines.append("what would fit: " + "; ".join(hints))
    return "\n".join(lines)


def _span(units: list[str]) -> str:
    if len(units) <= 3:
        return ", ".join(units)
    return f"{units[0]}..{units[-1]} ({len(units)} units)"


def _s(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"
