"""The spec search of ``shardlang tune``: layouts over the mesh, each scheduled under the memory budget.

Note [the tune search]: the search has two levels.

- The outer level is the *layout*: the unit granularity (the job's units, the
  default repeated blocks, or the whole model as one unit), one strategy for
  every unit (ZeRO-3, ZeRO-2, ZeRO-1, DDP) and the mesh split (``replicate x
  shard`` for every divisor of N when the job's mesh has one axis or is
  ``replicate x shard``).
- The inner level is the existing budget search (`compiler.analysis.budget`):
  under ``Options(memory_budget)`` it chooses recompute per unit and the
  prefetch depth at the least predicted step time, compiling one trace under
  many schedules.

Before anything compiles, every layout gets a lower bound of the bytes a rank
holds whatever the schedule (its parameters and optimizer state, and the units
it must hold gathered at once, from the model's shapes alone:
`held_lower_bound`); a layout whose bound is over the budget is pruned, and its
bound is reported. Each survivor is planned with the cost model (predicted
step, exposed communication, peak), and the fitting ones are ordered by
predicted step time.

Note [step floor]: the layouts are compiled best-first, by a lower bound of
their predicted step that needs no compile: the time their collectives take
on the link. The cost model queues collectives on one link
(``serialize_collectives``; else one lane per kind, and the bound is the
busiest lane) and a step ends after its last wait, so no schedule of the
layout, whatever its recompute and prefetch, is predicted faster than the sum
of its collectives' times. The collectives are the strategies' formulas
(`compiler.analysis.formulas.flat_collectives`) over the layout's flat
parameters, which need the spec resolved, not the step traced. Which ZeRO-3
units are gathered again for backward is the compiler's choice (Note [keep
the last unit]): it is learnt from the first compiled layout of the same
units and strategy (a mesh split does not change it), and counted as none
before. Once ``keep`` layouts fit, a layout whose floor is no faster than the
``keep``-th fastest cannot enter the leading ``keep``: it and every layout
after it are pruned uncompiled. A layout already compiling learns its own
re-gathers from the first configuration its budget search compiles: when its
floor with them is no faster than the ``keep``-th fastest known then (a value
the search lowers as layouts lead, read by every worker), its budget search
gives up there and the layout is reported as bounded. A communication-bound
step (70B on 1024 ranks) compiles only the layouts that could win.

Note [larger shards]: two layouts that differ only in their mesh split hold
the same activations (each rank takes the same rows) and gather the same
whole units; the one that shards over fewer ranks holds larger shards of
parameters, gradients and optimizer state, so each of its configurations
plans a peak at least the other's. Once a layout is found over the budget
with every configuration its budget search tries, every layout like it whose
shards are no smaller (``replicate x fsdp`` with no more fsdp ranks) is over
it too (its budget search takes the same path, each peak no lower), and is
reported so uncompiled, beside the leanest peak the other's search planned. At 70B with a tensor axis, the whole model as one unit misses 80 GiB by
more than 100 GiB at every split: one compile per strategy and degree shows it.

Note [grouped blocks]: between a unit per block and the whole model as one
unit lie blocks gathered a few at a time (FSDP2's ``fully_shard`` on a list of
layers): fewer, larger collectives, each paying its latency once, against more
bytes gathered at once. ``Options.bucket_bytes`` does the grouping
(`compiler.layout.bucket` merges consecutive, alike flat parameters smaller
than the bucket until it reaches it), so a layout grouped by ``g`` is the
layout with ``bucket_bytes`` of ``g`` blocks, the block being its most common
flat parameter size. As soon as a layout is among the leading ``keep``, its
groupings by 2 and by 4 (where there are at least two groups) join the queue
with their own memory bound and step floor; their floor is below their
parent's (fewer latencies), so they are compiled next, and one that wins
prunes the rest early. A grouping that leads is not grouped again. A search around the winners rather
than over every layout: at 70B, grouping every mesh split would double the
compiles for latencies that are a few milliseconds of a 14 s step.

Note [tensor degrees]: where the job's mesh has a tensor axis, its rules say
how tp splits each parameter, and the search tries every tp degree ``t`` that
divides both the world and the node size (tp stays inside a node, on its
fastest link; ``--node-size``, 8 by default), each over every split of the data
axes at ``world / t`` ranks, with the job's sequence and loss parallelism; the
ranks of a tp group share their rows, so each degree compiles for the global
batch cut in ``world / t`` parts. Degree 1 is the job without the tensor axis:
its rules keep their data-axis layouts, so FSDP alone is a candidate beside
the 2-D layouts. As soon as a tp layout is among the leading ``keep``, its
sequence and loss parallelism set the other three ways join the queue, as its
groupings do (Note [grouped blocks]). A degree the model cannot take (a dim
tp does not divide, a sequence sequence parallelism cannot split, logits that
reach the loss whole under loss parallelism) is left out with the reason, when
its spec resolves or its step compiles; the search goes on. A tp layout's
step floor adds, to its flat parameters' collectives over the data axes, the
time of its forward's tp collectives, learnt from the first compiled layout of
the same degree and options: recompute copies collectives into backward, never
out of the forward, so every schedule of the layout runs at least those.

The search never changes what is computed: dtypes, mixed precision, optimizer, loss
and every other option of the job's spec are kept; only units, strategies,
mesh (its tp degree too), bucketing, sequence and loss parallelism, recompute
and prefetch change.

Note [the job's own choices]: what the job's spec already sets is where the
search starts, never a constraint that stops it. Its units are the first
granularity, its mesh the first split, its ``prefetch`` the depth the budget
search starts from, its ``bucket_bytes`` the grouping of its ungrouped
layouts. When it sets ``strategies`` (one per unit, mixed or not), the job's
own layout (its units, its strategies, its mesh) is a candidate beside the
one-strategy layouts. Its recompute rules go with every layout without a
budget (under one, the budget search chooses recompute per unit itself), each
adapted to the layout's units: a rule that decides none of them (the job's
``blocks.*`` on the whole model as one unit) is left out of that layout, with
the reason on its line of the table (`Layout.left_out`); the rules that stay
decide the same units as in the job.

Example::

    result = tune(job, world=4, budget=2 * GIB, cost_model=CostModel())
    print(result.table()); Path("spec.toml").write_text(result.best.spec.to_toml())
"""

from __future__ import annotations

import collections
import contextlib
import functools
import heapq
import itertools
import math
import multiprocessing
import time
from collections.abc import Callable, Sequence
from concurrent import futures

import attrs
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from .. import api
from ..compiler import Adam, AdamW, CostModel, SGD, human_bytes, make_plan
from ..compiler.analysis.budget import BudgetError, BudgetHints, SearchAbandoned
from ..compiler.analysis.formulas import REGATHER_DETAIL, flat_collectives
from ..compiler.analysis.cost import group_axes
from ..compiler.ir.trace import Phase
from ..compiler.schedule.schedule import COLLECTIVE_KINDS, FlatSummary, OpKind, flat_summary
from ..compiler.trace_cache import TraceCache
from ..errors import CompileError, SpecError
from ..spec.mesh import Mesh
from ..spec.recompute import RecomputeRule
from ..spec.spec import Spec
from ..spec.patterns import first_match
from ..spec.rules import Rule
from ..spec.tensor_axes import is_tensor_axis, split_layout
from ..spec.strategy import Strategy
from ..spec.units import ROOT_UNIT, default_units, find_units, unit_label, unit_of
from .patterns import unit_patterns

STRATEGIES = (Strategy.ZERO3, Strategy.ZERO2, Strategy.ZERO1, Strategy.DDP)
GROUPS = (2, 4)  # repeated blocks per collective tried on the leading layouts (Note [grouped blocks])
REPLICATE_AXIS = "replicate"


@attrs.frozen
class Layout:
    """One point of the outer search: how units are cut, their strategy, and the mesh split."""

    granularity: str  # "job", "blocks" or "whole"
    units: tuple[str, ...] | None  # the spec's unit patterns
    strategy: Strategy | None  # None: the job's own strategies (Note [the job's own choices])
    mesh: Mesh
    group: int = 1  # repeated blocks per collective (Note [grouped blocks]); 1: the job's bucketing
    bucket_bytes: int = 0  # the Options.bucket_bytes that groups them (with group > 1)
    recompute: tuple[RecomputeRule, ...] | None = None  # the job's rules that fit these units, without a budget
    left_out: tuple[str, ...] = ()  # why each of the job's other recompute rules does not go with this layout
    tensor: int = 1  # the tp degree (Note [tensor degrees]): 1 is no tensor axis, the job's rules on the data axes
    sequence_parallel: bool = False
    loss_parallel: bool = False

    def describe(self) -> str:
        axes = " x ".join(f"{name}={size}" for name, size in self.mesh.axes)
        units = "the whole model" if self.units == () else ", ".join(self.units or ("default blocks",))
        grouped = f" {self.group} per collective" if self.group > 1 else ""
        strategy = "the job's strategies" if self.strategy is None else self.strategy.value
        options = [name for name, on in (("sequence parallel", self.sequence_parallel),
                                         ("loss parallel", self.loss_parallel)) if on]
        return f"{strategy} units [{units}]{grouped} mesh {axes}" + "".join(f", {o}" for o in options)

    @property
    def data_axes(self) -> dict[str, int]:
        """The mesh's axes that split the batch (and shard flat parameters): all but the tensor axis."""
        return {name: size for name, size in self.mesh.axes if not is_tensor_axis(name)}


@attrs.frozen
class Evaluated:
    """A layout compiled and planned: the spec that runs it, its predicted step and peak."""

    layout: Layout
    spec: Spec
    step_time_s: float
    exposed_comm_s: float
    peak: int
    schedule_choice: str  # recompute and prefetch, as the budget search chose them
    largest_collective: int = 0  # payload bytes (`calibrate.beyond_probes` says when the link was not probed so far)

    def one_line(self) -> str:
        return f"{self.layout.describe()}, {self.schedule_choice}"


@attrs.frozen
class Unfit:
    """A layout that cannot fit the budget: pruned by its lower bound, or compiled and found over it."""

    layout: Layout
    least_bytes: int  # the lower bound (pruned) or the leanest planned peak (compiled, or ``like``'s)
    compiled: bool
    like: Layout | None = None  # Note [larger shards]: the layout over the budget whose shards are no larger

    def why(self) -> str:
        if self.like is not None:
            return (f"its shards are no smaller than those of {self.like.describe()}, which does not fit "
                    f"(leanest {human_bytes(self.least_bytes)})")
        if self.compiled:
            return f"leanest {human_bytes(self.least_bytes)}"
        return f"holds at least {human_bytes(self.least_bytes)}"


@attrs.frozen
class Bounded:
    """A layout left uncompiled: its collectives alone take longer than the leading layouts' steps (Note [step floor]),
    or, once a configuration compiled, its compute with the recompute it needs to fit (Note [search floor])."""

    layout: Layout
    floor_s: float
    compiled: bool = False  # given up by its budget search (Note [step floor]), not pruned before compiling
    by_compute: bool = False  # its floor is Note [search floor]'s compute, not its collectives

    def why(self) -> str:
        if self.by_compute:
            return f"its compute, with the recompute it needs to fit, takes at least {_time(self.floor_s)}"
        return f"its collectives alone take {_time(self.floor_s)}"


@attrs.frozen
class TuneResult:
    """What the search found: the layouts that fit, ordered by predicted step time, and those that do not."""

    world: int
    budget: int | None
    fitting: tuple[Evaluated, ...]
    unfit: tuple[Unfit, ...]
    seconds: float
    compiles: int
    bounded: tuple[Bounded, ...] = ()
    skipped: tuple[tuple[Layout, str], ...] = ()  # layouts this model cannot take, each with the reason

    @property
    def layouts_seen(self) -> int:
        return len(self.fitting) + len(self.unfit) + len(self.bounded) + len(self.skipped)

    @property
    def best(self) -> Evaluated | None:
        return self.fitting[0] if self.fitting else None

    def table(self, rows: int = 8) -> str:
        header = ("#", "predicted step", "exposed comm", "peak", "spec")
        lines = [header]
        for i, e in enumerate(self.fitting[:rows], start=1):
            lines.append((str(i), _time(e.step_time_s), _time(e.exposed_comm_s),
                          human_bytes(e.peak), e.one_line()))
        widths = [max(len(r[i]) for r in lines) for i in range(len(header) - 1)]
        return "\n".join("  ".join(c.rjust(w) if 0 < j < 4 else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths)))
                         + "  " + r[-1] for r in lines)

    def explanation(self) -> str:
        """Why the best won, against the runner-up and the fastest layout that did not fit."""
        best = self.best
        if best is None:
            return self.shortfall()
        lines = [f"chose {best.one_line()}: predicted {_time(best.step_time_s)} a step, peak "
                 f"{human_bytes(best.peak)}" + (f" of the {human_bytes(self.budget)} budget" if self.budget else "")]
        if len(self.fitting) > 1:
            second = self.fitting[1]
            lines.append(f"  the runner-up, {second.one_line()}, is predicted {_time(second.step_time_s)} "
                         f"({100 * (second.step_time_s / best.step_time_s - 1):+.1f}%)")
        compute = best.step_time_s - best.exposed_comm_s
        lines.append(f"  of its step, {_time(best.exposed_comm_s)} is communication not hidden behind "
                     f"{_time(compute)} of compute")
        return "\n".join(lines)

    def shortfall(self) -> str:
        """When nothing fits: by how much the leanest layout misses, and what would fit."""
        if not self.unfit:
            return "no layout was evaluated"
        # a layout ruled out by larger shards (Note [larger shards]) is never leaner than the one that ruled it out
        leanest = min((u for u in self.unfit if u.like is None), key=lambda u: u.least_bytes)
        over = leanest.least_bytes - (self.budget or 0)
        how = "planned" if leanest.compiled else "holds at least (parameters and optimizer state)"
        return (f"nothing fits {human_bytes(self.budget or 0)} per rank: the leanest layout, "
                f"{leanest.layout.describe()}, {how} {human_bytes(leanest.least_bytes)}, "
                f"{human_bytes(over)} over. More ranks shrink what is sharded; a smaller per-rank batch shrinks "
                "activations; a budget of at least "
                f"{human_bytes(leanest.least_bytes)} fits")


def layouts(model: torch.nn.Module, spec: Spec, world: int, node_size: int = 8) -> list[Layout]:
    """Every layout of the search for ``model`` at ``world`` ranks (Note [the tune search]), without duplicates;
    on a job's mesh with a tensor axis, at every tp degree up to ``node_size`` (Note [tensor degrees])."""
    grains: list[tuple[str, tuple[str, ...] | None]] = [("job", spec.units)]
    if spec.units is not None:
        grains.append(("blocks", None))
    grains.append(("whole", ()))
    seen, distinct, fitted = set(), [], {}
    for name, units in grains:
        found = frozenset(find_units(model, units) if units is not None else default_units(model))
        if found not in seen:
            seen.add(found)
            distinct.append((name, units))
            fitted[name] = fitting_recompute(spec.recompute, found)
    out = []
    for tensor, meshes, options in _tensor_choices(spec, world, node_size):
        # Note [the job's own choices]: the job's own strategies, on its units and mesh, are a candidate too
        if spec.strategies is not None:
            out += [Layout("job", spec.units, None, meshes[0], recompute=fitted["job"][0], left_out=fitted["job"][1],
                           tensor=tensor, sequence_parallel=sp, loss_parallel=lp) for sp, lp in options]
        # DDP shards nothing: every split of its mesh is the same step, so only the job's mesh is tried.
        out += [Layout(name, units, strategy, mesh, recompute=fitted[name][0], left_out=fitted[name][1],
                       tensor=tensor, sequence_parallel=sp, loss_parallel=lp)
                for name, units in distinct for strategy in STRATEGIES
                for mesh in (meshes[:1] if strategy is Strategy.DDP else meshes) for sp, lp in options]
    return out


def _tensor_choices(spec: Spec, world: int, node_size: int) -> list[tuple[int, list[Mesh], list[tuple[bool, bool]]]]:
    """``(tp degree, the meshes at it, its (sequence_parallel, loss_parallel) pairs)``, the job's own degree
    first (Note [tensor degrees])."""
    names = spec.mesh.axis_names
    tensor_axes = [a for a in names if is_tensor_axis(a)]
    if not tensor_axes:
        return [(1, _mesh_splits(spec.mesh, world), [(False, False)])]
    axis = tensor_axes[0]
    own_degree = dict(spec.mesh.axes)[axis]
    try:
        own = spec.mesh.bind(world)  # the job's own mesh, tried first where it fits the world
    except SpecError:  # written for another world (llama_70b_tp.toml: fsdp = 32 at 256 ranks)
        own = None
    data_axes = [(a, size) for a, size in spec.mesh.axes if a != axis]
    data = Mesh(**{a: -1 if i == len(data_axes) - 1 else size for i, (a, size) in enumerate(data_axes)})
    degrees = list(dict.fromkeys([own_degree] * (own_degree > 0 and world % own_degree == 0) + [
        t for t in range(1, node_size + 1) if node_size % t == 0 and world % t == 0]))
    o = spec.options
    choices = []
    for t in degrees:
        if t == 1:
            choices.append((1, _mesh_splits(data, world), [(False, False)]))
            continue
        meshes = [Mesh(**dict(m.axes), **{axis: t}) for m in _mesh_splits(data, world // t)]
        if t == own_degree and own is not None:
            meshes = [own] + [m for m in meshes if m != own]
        choices.append((t, meshes, [(o.sequence_parallel, o.loss_parallel)]))
    return choices


def tensor_variants(layout: Layout) -> list[Layout]:
    """``layout`` with sequence and loss parallelism set the other three ways (Note [tensor degrees])."""
    if layout.tensor == 1:
        return []
    own = (layout.sequence_parallel, layout.loss_parallel)
    return [attrs.evolve(layout, sequence_parallel=sp, loss_parallel=lp)
            for sp in (True, False) for lp in (True, False) if (sp, lp) != own]


def fitting_recompute(rules: tuple[RecomputeRule, ...] | None,
                      units: frozenset[str]) -> tuple[tuple[RecomputeRule, ...] | None, tuple[str, ...]]:
    """The job's recompute ``rules`` a layout of ``units`` takes, and why each of the others is left out.

    Note [the job's own choices]. A rule goes with the layout where it decides one of its units (the
    first match wins, as in the spec); one that matches none of them, or only units an earlier rule
    took, is left out. Leaving out a rule that decides nothing changes no other unit's policy.
    Example: ``fitting_recompute((RecomputeRule("blocks.*", "full"),), frozenset())`` is ``(None,
    ("recompute[0] = RecomputeRule('blocks.*', 'full') matches no unit here",))``.
    """
    if not rules:
        return rules, ()
    labels = [unit_label(u) for u in (ROOT_UNIT, *sorted(units))]
    deciding = {next((i for i, rule in enumerate(rules) if rule.matches(label)), None) for label in labels}
    kept = tuple(rule for i, rule in enumerate(rules) if i in deciding)
    left_out = tuple(f"recompute[{i}] = {rule!r} "
                     f"{'decides' if any(rule.matches(label) for label in labels) else 'matches'} no unit here"
                     for i, rule in enumerate(rules) if i not in deciding)
    return kept or None, left_out


def grouped_layouts(layout: Layout, flats: Sequence[FlatSummary]) -> list[Layout]:
    """``layout`` with its repeated blocks gathered 2 and 4 at a time (Note [grouped blocks]), where it has 4 or 8.

    The block is the most common flat parameter size; ``bucket_bytes`` is ``group`` of them, so
    `compiler.layout.bucket` merges consecutive blocks into one collective of about that size.
    """
    if layout.units == () or not flats:
        return []
    sizes = collections.Counter(_bucket_bytes(f) for f in flats)
    block, count = sizes.most_common(1)[0]
    return [attrs.evolve(layout, group=group, bucket_bytes=group * block) for group in GROUPS
            if count >= 2 * group]


def held_lower_bound(layout: Layout, param_bytes: int, state_per_param: int, world: int,
                     gathered_units: tuple[int, ...] = ()) -> int:
    """Bytes a rank holds at once under ``layout`` whatever the schedule.

    ``state_per_param``: optimizer state tensors per parameter (AdamW 2, SGD with momentum 1).
    ZeRO-3 / ZeRO-2 hold a shard of both; ZeRO-1 the whole parameters and a shard of the state;
    DDP both whole; the job's own strategies (``strategy`` None), a mix of these, at least a shard of both. A shard is over the shard axis (N / replicas ranks). ``gathered_units``, each
    unit's bytes gathered (in the dtype it is computed in): ZeRO-3 holds at least the largest one
    gathered at some moment, ZeRO-2 every one at the end of the forward (it does not reshard).
    """
    shard = world // dict(layout.mesh.axes).get(REPLICATE_AXIS, 1)
    state = param_bytes * state_per_param
    if layout.strategy is None:  # the job's strategies, whatever they are, shard at most everything
        return (param_bytes + state) // shard
    if layout.strategy is Strategy.ZERO3:
        return (param_bytes + state) // shard + max(gathered_units, default=0)
    if layout.strategy is Strategy.ZERO2:
        return (param_bytes + state) // shard + sum(gathered_units)
    if layout.strategy is Strategy.ZERO1:
        return param_bytes + state // shard
    return param_bytes + state


@attrs.frozen
class Job:
    """What compiling any layout needs: the model, loss, spec, optimizer, per-rank batch, world, budget, costs."""

    build_model: Callable[[], torch.nn.Module]
    loss_fn: Callable
    spec: Spec
    optimizer: object
    example_batch: object
    world: int
    budget: int | None
    cost_model: CostModel
    batch_for: Callable[[int], object] | None = None  # the per-rank batch of the global one cut in N parts

    def batch_of(self, layout: Layout):
        """The per-rank batch ``layout`` compiles for: a tp group's ranks share one (Note [tensor degrees])."""
        if layout.tensor == 1:
            return self.example_batch
        if self.batch_for is None:
            raise ValueError(f"a layout at tp degree {layout.tensor} needs the job's batch_for: the per-rank batch "
                             f"of {self.world} data-parallel ranks is not the one of {self.world // layout.tensor}")
        return self.batch_for(self.world // layout.tensor)


@attrs.frozen
class Outcome:
    """One layout compiled: fitting (``evaluated``), over the budget (``unfit``) or not for this model (``skipped``)."""

    layout: Layout
    compiles: int
    evaluated: Evaluated | None = None
    unfit: Unfit | None = None
    skipped: str | None = None
    bounded: Bounded | None = None  # its first configuration showed its floor (Note [step floor]) out of the lead
    floor: Bounded | None = None  # its floor once a configuration compiled: its collectives with its own
    # re-gathers, or Note [search floor]'s compute where that is higher; as it is reported if given up
    tensor_s: float = 0.0  # its forward's tp collectives' time on the link (Note [tensor degrees])
    regathered: frozenset[str] = frozenset()  # Note [step floor]: the units ZeRO-3 gathers again for backward
    kept_under: dict = attrs.field(factory=dict, eq=False)  # the budget search's rows (Note [warm start])


def tune(build_model: Callable[[], torch.nn.Module], loss_fn, spec: Spec, optimizer, example_batch, world: int,
         budget: int | None, cost_model: CostModel, say: Callable[[str], None] = lambda _line: None,
         keep: int = 1, workers: int = 1, batch_for: Callable[[int], object] | None = None,
         node_size: int = 8) -> TuneResult:
    """Search the layouts of ``spec``'s model at ``world`` ranks under ``budget`` (Note [the tune search]).

    ``example_batch`` is the per-rank batch of ``world`` data-parallel ranks; ``say`` reports progress,
    one line per layout. ``keep``: how many of the fastest layouts must be exact (Note [step floor]):
    ``tune --measure K`` runs K. ``workers``: layouts compiled at once, each in a process of its own
    (Note [layouts in parallel]). On a mesh with a tensor axis the tp degree is searched too, up to
    ``node_size`` (Note [tensor degrees]), and ``batch_for(N)`` gives the per-rank batch of the global
    batch cut in N parts (the ranks of a tp group share theirs).
    """
    started = time.perf_counter()
    if batch_for is None and any(is_tensor_axis(a) for a in spec.mesh.axis_names):
        raise SpecError("tune on a mesh with a tensor axis needs batch_for, the per-rank batch of the global "
                        "batch cut in N parts: each tp degree t compiles for world / t data-parallel ranks")
    job = Job(build_model, loss_fn, spec, optimizer, example_batch, world, budget, cost_model, batch_for)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = build_model()
    state_per_param = _state_per_param(optimizer)
    regathered: dict[tuple, frozenset[str]] = {}  # Note [step floor]: learnt per units, strategy and grouping
    kept_under: dict[str, dict] = {}  # Note [warm start]: the budget search's rows, learnt per unit granularity
    tensor_s: dict[tuple, float] = {}  # Note [tensor degrees]: the forward's tp collectives, per degree and options
    flats_of: dict[Layout, tuple[FlatSummary, ...]] = {}  # each queued layout's, from its spec
    param_bytes = functools.lru_cache(functools.partial(_param_bytes, model, spec))  # by tp degree

    def floor_of(layout: Layout) -> float:
        known = regathered.get(_learnt_key(layout), frozenset())
        return (communication_floor(flats_of[layout], layout.data_axes, world // layout.tensor, cost_model, known)
                + tensor_s.get(_tensor_key(layout), 0.0))

    queue, fitting, unfit, bounded, skipped, compiles = [], [], [], [], [], 0
    refused: dict[int, str] = {}  # tp degrees whose spec this model's dims do not take, and why
    grouped: set[Layout] = set()  # the layouts whose blocks were grouped (Note [grouped blocks])
    varied: set[Layout] = set()  # the layouts whose sequence and loss parallelism were varied (Note [tensor degrees])

    def enqueue(layout: Layout, index: int, gathered: tuple[int, ...], resolved=None) -> None:
        """Queue ``layout`` by its step floor, or prune it when what it must hold is over the budget."""
        bound = held_lower_bound(layout, param_bytes(layout.tensor), state_per_param, world // layout.tensor,
                                 gathered)
        if budget is not None and bound > budget:
            unfit.append(Unfit(layout, bound, compiled=False))
            say(f"pruned   {layout.describe()}: {unfit[-1].why()}")
            return
        if layout.tensor in refused:
            skipped.append((layout, refused[layout.tensor]))
            return
        try:
            resolved = resolved or _spec_of(spec, layout, None).resolve(model, world)  # the floor's flats, units
            flats_of[layout] = _summaries(resolved)
        except (SpecError, CompileError) as exc:  # a tp degree this model's dims do not take (Note [tensor degrees])
            if layout.tensor == 1:
                raise
            refused[layout.tensor] = str(exc)
            skipped.append((layout, str(exc)))
            say(f"skipped  every layout at tp={layout.tensor}: {exc}")
            return
        heapq.heappush(queue, (floor_of(layout), bound, index, layout, resolved.units))

    searched = layouts(model, spec, world, node_size)
    for i, layout in enumerate(searched):
        enqueue(layout, i, _gathered_units(model, spec, layout))
    order = itertools.count(len(searched))  # ties in the queue go to the earlier layout, never to a comparison

    def group_leading() -> None:
        """Queue the groupings of the leading ``keep`` layouts not grouped yet (Note [grouped blocks]), and
        their sequence and loss parallelism set the other ways (Note [tensor degrees])."""
        for e in sorted(fitting, key=lambda e: (e.step_time_s, e.peak))[:keep]:
            if e.layout not in varied:
                varied.add(e.layout)
                for variant in tensor_variants(e.layout):
                    varied.add(variant)  # a variant that leads is not varied again
                    enqueue(variant, next(order), _gathered_units(model, spec, variant))
            if e.layout.group == 1 and e.layout not in grouped:
                grouped.add(e.layout)
                for variant in grouped_layouts(e.layout, flats_of[e.layout]):
                    resolved = _spec_of(spec, variant, None).resolve(model, world)
                    enqueue(variant, next(order), _gathered_flats(_summaries(resolved)), resolved)

    too_large: dict[Layout, Unfit] = {}  # Note [larger shards]: per layout less its split, the widest over the budget

    def over_like(layout: Layout) -> Unfit | None:
        """The layout over the budget that ``layout``'s shards are no smaller than, if any (Note [larger shards])."""
        known = too_large.get(_split_free(layout))
        return known if known is not None and _shard_ranks(layout) <= _shard_ranks(known.layout) else None

    def next_layout():
        """The queue's most promising layout, or None when the rest cannot enter the leading ``keep``."""
        while queue:
            floor, bound, i, layout, units = heapq.heappop(queue)
            if (refined := floor_of(layout)) > floor:  # learnt re-gathers raise it: back in line
                heapq.heappush(queue, (refined, bound, i, layout, units))
                continue
            if (like := over_like(layout)) is not None:
                unfit.append(found := Unfit(layout, like.least_bytes, compiled=False, like=like.layout))
                say(f"no fit   {layout.describe()}: {found.why()}")
                continue
            if floor < leading_cutoff():
                return layout, units, bound
            for floor, _, _, layout, _ in sorted([(floor, bound, i, layout, units), *queue]):
                bounded.append(Bounded(layout, floor))
                say(f"bounded  {layout.describe()}: {bounded[-1].why()}")
            queue.clear()
        return None

    def commit(outcome: Outcome) -> None:
        """Take a layout's outcome into the search, as the one-at-a-time search would at this point."""
        nonlocal compiles
        compiles += outcome.compiles
        if (outcome.bounded is None and outcome.compiles > 1 and outcome.floor is not None
                and outcome.floor.floor_s >= leading_cutoff()):
            # compiled ahead of its turn, past where its budget search would now give up (Note [step floor]:
            # it asks before each compile after the first)
            outcome = attrs.evolve(outcome, evaluated=None, unfit=None, bounded=outcome.floor)
        if outcome.evaluated is not None or outcome.bounded is not None:
            regathered[_learnt_key(outcome.layout)] = outcome.regathered
        if outcome.kept_under:
            kept_under.setdefault(outcome.layout.granularity, {}).update(outcome.kept_under)
        if outcome.tensor_s:
            tensor_s[_tensor_key(outcome.layout)] = outcome.tensor_s
        if outcome.skipped is not None:
            skipped.append((outcome.layout, outcome.skipped))
            say(f"skipped  {outcome.layout.describe()}: {outcome.skipped}")
        elif outcome.bounded is not None:
            bounded.append(outcome.bounded)
            say(f"bounded  {outcome.layout.describe()}: {outcome.bounded.why()} (given up after "
                f"{outcome.compiles} compile{'s' if outcome.compiles != 1 else ''})")
        elif outcome.unfit is not None:
            unfit.append(outcome.unfit)
            say(f"no fit   {outcome.layout.describe()}: {outcome.unfit.why()}")
            known = too_large.get(key := _split_free(outcome.layout))
            if known is None or _shard_ranks(outcome.layout) > _shard_ranks(known.layout):
                too_large[key] = outcome.unfit
        else:
            fitting.append(e := outcome.evaluated)
            say(f"planned  {e.one_line()}: {_time(e.step_time_s)}, {human_bytes(e.peak)}")

    def leading_cutoff() -> float:
        """The step time a layout must beat to enter the leading ``keep``; infinite until ``keep`` fit."""
        leading = sorted(e.step_time_s for e in fitting)[:keep]
        return leading[-1] if len(leading) == keep else math.inf

    def upcoming(count: int) -> list[tuple]:
        """The ``count`` layouts the queue holds next, with what the search sends each, should nothing change."""
        ahead = [entry for entry in heapq.nsmallest(count + len(sent), queue) if entry[3] not in sent]
        cutoff = leading_cutoff()
        return [(layout, units, bound) for _, bound, _, layout, units in ahead[:count]
                if floor_of(layout) < cutoff and over_like(layout) is None]

    sent: dict[Layout, futures.Future] = {}  # Note [layouts in parallel]: each layout's compile, once started
    with _compiler(job, workers) as (submit, cutoff):
        def send(layout: Layout, units, bound: int) -> None:
            if layout not in sent:
                sent[layout] = submit(layout, units, bound, kept_under.get(layout.granularity))

        while True:
            group_leading()  # Note [grouped blocks]: as soon as a layout leads, so a grouping that wins prunes early
            if (chosen := next_layout()) is None:
                break
            send(*chosen)
            turn = sent.pop(chosen[0])
            while workers > 1:  # idle processes compile the layouts next in line (Note [layouts in parallel])
                busy = sum(not f.done() for f in (turn, *sent.values()))
                for ahead in upcoming(workers - busy):
                    send(*ahead)
                if turn.done():
                    break
                futures.wait([turn, *(f for f in sent.values() if not f.done())],
                             return_when=futures.FIRST_COMPLETED)
            commit(turn.result())
            cutoff.value = leading_cutoff()  # Note [step floor]: what a running layout must beat
        for future in sent.values():  # compiled ahead, and then pruned before its turn
            future.cancel()
    compiles += sum(f.result().compiles for f in sent.values() if not f.cancelled())
    fitting.sort(key=lambda e: (e.step_time_s, e.peak))
    return TuneResult(world, budget, tuple(fitting), tuple(unfit), time.perf_counter() - started, compiles,
                      tuple(bounded), tuple(skipped))


def compile_layout(job: Job, layout: Layout, units: Sequence[str], bound: int = 0,
                   kept_under: dict | None = None, cutoff: Callable[[], float] = lambda: math.inf,
                   shared: Shared | None = None) -> Outcome:
    """Compile ``layout`` under the budget (the budget search chooses recompute and prefetch) and plan it.

    ``units``: the layout's units, which the chosen recompute is written over; ``bound``: its
    `held_lower_bound`, reported when the budget search names no leanest peak; ``kept_under``: the rows
    an earlier budget search over the same units learnt, where this one starts (Note [warm start]);
    ``cutoff()``: the step time a layout must beat to lead, now. The budget search gives up, after its
    first compile or any later one, when that step's collectives alone take as long (Note [step floor]),
    or its compute with the recompute it needs to fit (Note [search floor]). ``shared``: the fake model
    and the traces the layouts compiled in this process share (Note [shared traces]).
    """
    candidate = _spec_of(job.spec, layout, job.budget)
    # Note [pool after the search]: the pool changes neither peak nor prediction, so it is left to the run
    unpooled = attrs.evolve(candidate, options=attrs.evolve(candidate.options, buffer_pool=False))
    first: dict = {"checks": 0}  # the first configuration's re-gathers and floor; compiles after it

    def learn(step) -> None:
        if "floor" not in first:  # the re-gathers are the layout's, whatever its recompute and prefetch
            first["regathered"] = _regathered(step.schedule)
            first["tensor"] = _forward_tensor_time(step.schedule, job.cost_model)
            links = communication_floor(tuple(flat_summary(f) for f in step.flats), layout.data_axes,
                                        job.world // layout.tensor, job.cost_model, first["regathered"])
            first["floor"] = Bounded(layout, links + first["tensor"], compiled=True)

    def give_up(step, search_floor_s: float) -> str | None:  # called before each compile after the first
        learn(step)
        first["checks"] += 1
        if search_floor_s > first["floor"].floor_s:  # Note [search floor]: its compute, over its links' time
            first["floor"] = Bounded(layout, search_floor_s, compiled=True, by_compute=True)
        return first["floor"].why() if first["floor"].floor_s >= cutoff() else None

    try:
        compiled = api.plan(shared.model if shared else job.build_model, job.loss_fn, unpooled,
                            optimizer=job.optimizer, example_batch=job.batch_of(layout), world_size=job.world,
                            cost_model=job.cost_model, budget_hints=BudgetHints(kept_under or {}, give_up),
                            traces=shared.traces if shared else None)
    except SearchAbandoned:
        return Outcome(layout, first["checks"], bounded=first["floor"], regathered=first["regathered"],
                       floor=first["floor"], tensor_s=first["tensor"])
    except BudgetError as exc:
        return Outcome(layout, first["checks"] + 1, unfit=Unfit(layout, exc.leanest_peak or bound, compiled=True),
                       regathered=first.get("regathered", frozenset()), floor=first.get("floor"),
                       tensor_s=first.get("tensor", 0.0))
    except SpecError as exc:  # a layout this model cannot take (a DDP unit of no parameters, say)
        return Outcome(layout, 0, skipped=str(exc))
    except CompileError as exc:
        if layout.tensor == 1:
            raise
        # Note [tensor degrees]: what propagation refuses at this degree (heads tp does not divide, a
        # sequence sequence parallelism cannot split, logits that reach the loss whole) leaves it out
        return Outcome(layout, 0, skipped=str(exc).splitlines()[0])
    choice = getattr(compiled, "budget", None)
    learn(compiled)
    if choice is not None:  # the budget search planned the chosen step already
        figures = choice.chosen.step_time_s, choice.chosen.exposed_comm_s, choice.chosen.peak
    else:
        plan = make_plan(compiled, cost_model=job.cost_model)
        figures = plan.timeline.step_time_s, plan.timeline.exposed_comm_s, plan.memory.peak
    evaluated = Evaluated(layout, _chosen(candidate, choice, units), *figures,
                          choice.chosen.describe() if choice is not None else _as_the_job(layout, job.spec),
                          compiled.schedule.largest_collective)
    return Outcome(layout, len(choice.tried) if choice is not None else 1, evaluated=evaluated,
                   regathered=first["regathered"], floor=first["floor"], tensor_s=first["tensor"],
                   kept_under=choice.kept_under if choice is not None else {})


@contextlib.contextmanager
def _compiler(job: Job, workers: int):
    """``submit(layout, units, bound, kept_under)`` -> a future of its `Outcome`, here or in ``workers`` forked
    processes; and the cutoff (``.value``) they read, which the search lowers as layouts lead.

    Note [layouts in parallel]: a layout's compile is pure Python on one core (tracing, passes, planning), so
    on a machine of several cores layouts are compiled side by side, each in a process of its own. The
    processes are forked: they inherit the job (its model builder and loss, which need not pickle), and a
    layout and its outcome are all that cross. The search is the one-at-a-time search, run ahead: while a
    layout compiles, idle processes compile the layouts next in the queue, and each outcome is taken into
    the search in the order the one-at-a-time search would take it, when the queue reaches its layout. So
    every decision (what is pruned, grouped, given up, chosen) is the serial search's; what parallel
    compiles cost is the layouts compiled ahead and then pruned before their turn. A layout compiled ahead
    of its turn gives up by the cutoff it sees then; one that went further than the search, at its turn,
    would have let it is taken as given up (`Outcome.floor`).
    """
    if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():  # Windows: one at a time
        cutoff, shared = _Cutoff(), Shared.of(job)

        def submit(layout, units, bound, kept_under):
            future = futures.Future()
            future.set_result(compile_layout(job, layout, units, bound, kept_under, lambda: cutoff.value, shared))
            return future

        yield submit, cutoff
        return
    context = multiprocessing.get_context("fork")
    cutoff = context.Value("d", math.inf, lock=False)  # shared memory: a worker reads the latest
    with futures.ProcessPoolExecutor(workers, mp_context=context, initializer=_adopt,
                                     initargs=(job, cutoff)) as pool:
        yield (lambda layout, units, bound, kept_under: pool.submit(
            _compile_in_worker, layout, tuple(units), bound, kept_under)), cutoff


@attrs.frozen
class Shared:
    """What the layouts compiled in one process share: one fake model, and its traces (Note [shared traces])."""

    model: torch.nn.Module
    traces: TraceCache

    @classmethod
    def of(cls, job: Job) -> Shared:
        with FakeTensorMode(allow_non_fake_inputs=True):
            return cls(job.build_model(), TraceCache())


@attrs.define
class _Cutoff:
    """The step time a layout must beat to lead, in one process (`multiprocessing.Value`'s ``.value``)."""

    value: float = math.inf


_WORKER_JOB: Job | None = None  # the job a forked worker compiles layouts of (Note [layouts in parallel])
_WORKER_CUTOFF = _Cutoff()  # shared with the search, which lowers it
_WORKER_SHARED: Shared | None = None  # the worker's model and traces, for the pool's lifetime


def _adopt(job: Job, cutoff) -> None:
    global _WORKER_JOB, _WORKER_CUTOFF, _WORKER_SHARED
    # libgomp is not fork-safe: a child of a parent whose OpenMP threads ran (cutting the global batch into
    # per-rank ones does) hangs in its first parallel region; one thread runs none, and a compile is one
    # core's work anyway
    torch.set_num_threads(1)
    _WORKER_JOB, _WORKER_CUTOFF, _WORKER_SHARED = job, cutoff, Shared.of(job)


def _compile_in_worker(layout: Layout, units: tuple[str, ...], bound: int, kept_under: dict | None) -> Outcome:
    return compile_layout(_WORKER_JOB, layout, units, bound, kept_under, lambda: _WORKER_CUTOFF.value,
                          _WORKER_SHARED)


def communication_floor(flats: Sequence[FlatSummary], mesh: dict[str, int], world: int, cost_model: CostModel,
                        regathered: frozenset[str] = frozenset()) -> float:
    """Seconds the link is busy with these flat parameters' collectives: no schedule of them is faster.

    Note [step floor]. ``regathered``: the flat parameters ZeRO-3 gathers again for backward.
    """
    # Each collective is timed on the fastest of the mesh's links (Note [links per axis]), so the floor stays a
    # floor whichever axes it spans: pruning by it never drops a layout the schedule would time faster.
    axes = [(a,) for a in mesh] or [()]
    lanes: dict[str, float] = {}
    for f in flats:
        for kind, group, payload in flat_collectives(f, mesh, world, regathered=f.name in regathered):
            lane = "link" if cost_model.serialize_collectives else kind
            fastest = min(cost_model.collective_time(kind, group, payload, a) for a in axes)
            lanes[lane] = lanes.get(lane, 0.0) + fastest
    return max(lanes.values(), default=0.0)


def _flat_summaries(model: torch.nn.Module, spec: Spec, world: int) -> tuple[FlatSummary, ...]:
    """The flat parameters ``spec`` lays ``model`` out in at ``world`` ranks, from the spec alone (no trace)."""
    return _summaries(spec.resolve(model, world))


def _summaries(resolved) -> tuple[FlatSummary, ...]:
    return tuple(flat_summary(f) for f in resolved.config.flats())


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _regathered(schedule) -> frozenset[str]:
    """The flat parameters ``schedule`` gathers again for backward (Note [keep the last unit])."""
    return frozenset(op.flat for op in schedule.ops if op.kind is OpKind.ALL_GATHER and op.detail == REGATHER_DETAIL)


def _split_free(layout: Layout) -> Layout:
    """``layout`` but its mesh split: the layouts that differ only in how many ranks shard (Note [larger shards])."""
    return attrs.evolve(layout, mesh=Mesh(fsdp=1))


def _shard_ranks(layout: Layout) -> int:
    """The ranks ``layout`` shards a flat parameter over: its data ranks less the replicas."""
    data = layout.data_axes
    return math.prod(data.values()) // data.get(REPLICATE_AXIS, 1)


def _learnt_key(layout: Layout) -> tuple:
    """What the re-gathers of a compiled layout tell about others: the same units, strategy, grouping and tp
    degree (a mesh split does not change them)."""
    return layout.granularity, layout.strategy, layout.group, layout.tensor


def _tensor_key(layout: Layout) -> tuple:
    """What a layout's forward tp collectives depend on (Note [tensor degrees]): the degree, the per-rank
    batch it gives, and the options that change them; not the units, strategies or data mesh."""
    return layout.tensor, layout.sequence_parallel, layout.loss_parallel


def _forward_tensor_time(schedule, cost_model: CostModel) -> float:
    """Seconds the link is busy with the forward's tp collectives (Note [tensor degrees]).

    Every schedule of the same degree and options runs them: recompute copies collectives into backward,
    never out of the forward, so they are a floor of every such layout's tp collectives.
    """
    return sum(cost_model.collective_time(op.kind.value, op.group_size, op.bytes, group_axes(schedule, op.group))
               for op in schedule.ops
               if op.kind in COLLECTIVE_KINDS and op.flat is None and op.group is not None
               and is_tensor_axis(op.group) and op.phase is Phase.FORWARD)


def _bucket_bytes(flat: FlatSummary) -> int:
    """A flat parameter's size as `compiler.layout.bucket` compares it with ``bucket_bytes``."""
    return (flat.padded_numel if flat.sharded else flat.numel) * flat.element_size


def _gathered_flats(flats: Sequence[FlatSummary]) -> tuple[int, ...]:
    """Each flat parameter's bytes as gathered (in ``param_dtype`` under mixed precision)."""
    return tuple(f.numel * (f.gather_element_size or f.element_size) for f in flats)


def _gathered_units(model: torch.nn.Module, spec: Spec, layout: Layout) -> tuple[int, ...]:
    """Each unit's parameter bytes as gathered: in ``param_dtype`` under mixed precision, else their own."""
    units = set(find_units(model, layout.units) if layout.units is not None else default_units(model))
    precision = spec.options.mixed_precision
    sizes: dict[str, int] = {}
    for name, p in model.named_parameters():
        size = precision.param_dtype.itemsize if precision is not None and p.is_floating_point() else p.element_size()
        sizes[unit_of(name, units)] = sizes.get(unit_of(name, units), 0) + _tp_local(spec, layout.tensor, name, p) * size
    return tuple(sizes.values())


def _tp_local(spec: Spec, tensor: int, name: str, p: torch.Tensor) -> int:
    """The elements of parameter ``name`` a rank holds at tp degree ``tensor`` (all of them at degree 1)."""
    return p.numel() // tensor if tensor > 1 and _tensor_split(spec, name) else p.numel()


def _param_bytes(model: torch.nn.Module, spec: Spec, tensor: int) -> int:
    """The trainable parameter bytes a rank holds at tp degree ``tensor``, before the data axes shard them."""
    return sum(_tp_local(spec, tensor, n, p) * p.element_size() for n, p in model.named_parameters()
               if p.requires_grad)


def _mesh_splits(mesh: Mesh, world: int) -> list[Mesh]:
    """The job's mesh first, then, when it has one axis or is ``replicate x shard`` (what the search writes),
    the shard axis alone and ``replicate x shard`` for every other divisor of ``world``."""
    bound = mesh.bind(world)
    names = bound.axis_names
    if len(names) == 1:
        axis = names[0]
    elif len(names) == 2 and names[0] == REPLICATE_AXIS:
        axis = names[1]
    else:
        return [bound]
    splits = [bound, Mesh(**{axis: world})]
    for replicas in range(2, world):
        if world % replicas == 0:
            splits.append(Mesh(**{REPLICATE_AXIS: replicas, axis: world // replicas}))
    return list(dict.fromkeys(splits))


def _spec_of(spec: Spec, layout: Layout, budget: int | None) -> Spec:
    """The job's spec with ``layout``'s choices (Note [the job's own choices]); under ``budget``, the budget
    search's recompute rather than the job's."""
    options = spec.options if budget is None else attrs.evolve(spec.options, memory_budget=budget)
    if layout.group > 1:
        options = attrs.evolve(options, bucket_bytes=layout.bucket_bytes)
    options = attrs.evolve(options, sequence_parallel=layout.sequence_parallel, loss_parallel=layout.loss_parallel)
    strategies = spec.strategies if layout.strategy is None else [("*", layout.strategy.value)]
    rules = spec.rules if layout.tensor > 1 else _data_rules(spec)
    return attrs.evolve(spec, mesh=layout.mesh, rules=rules, units=layout.units, strategies=strategies,
                        options=options, recompute=layout.recompute if budget is None else None)


def _data_rules(spec: Spec) -> tuple[Rule, ...]:
    """``spec``'s rules without their tensor-axis layouts (Note [tensor degrees]: degree 1)."""
    names = spec.mesh.axis_names
    return tuple(Rule(rule.pattern, split_layout(rule.layout, names, f"rules[{i}]")[0])
                 for i, rule in enumerate(spec.rules))


def _tensor_split(spec: Spec, name: str) -> bool:
    """Whether ``spec``'s rule for parameter ``name`` splits it over a tensor axis."""
    i = first_match(spec.rules, name)
    return i is not None and _rules_split_tensor(spec.rules, spec.mesh.axis_names)[i]


@functools.cache
def _rules_split_tensor(rules: tuple[Rule, ...], axis_names: tuple[str, ...]) -> tuple[bool, ...]:
    """Per rule, whether its layout splits over a tensor axis: asked per parameter per layout, split once."""
    return tuple(bool(split_layout(rule.layout, axis_names, f"rules[{i}]")[1]) for i, rule in enumerate(rules))


def _as_the_job(layout: Layout, spec: Spec) -> str:
    """A layout's schedule without a budget: the job's recompute (what of it fits) and prefetch."""
    left_out = f" (left out: {'; '.join(layout.left_out)})" if layout.left_out else ""
    return f"recompute as the job's{left_out}, prefetch {spec.options.prefetch}"


def _chosen(spec: Spec, choice, units: Sequence[str]) -> Spec:
    """The spec that runs the budget search's choice with no search: its recompute per unit (as few patterns
    over ``units``, the layout's, as say it exactly: `unit_patterns`) and its prefetch depth."""
    if choice is None:
        return spec
    c = choice.chosen
    if any(unit == "" for unit, _ in c.recompute):  # no pattern names the root unit: the budget chooses it again
        return spec
    recompute = unit_patterns(dict(c.recompute), units) or None
    options = attrs.evolve(spec.options, memory_budget=None, prefetch=c.prefetch)
    return attrs.evolve(spec, recompute=recompute, options=options)


def _state_per_param(optimizer) -> int:
    if isinstance(optimizer, (Adam, AdamW)):
        return 2
    if isinstance(optimizer, SGD):
        return 1 if optimizer.momentum else 0
    return 0
