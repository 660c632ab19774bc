"""The memory budget's search (compiler/analysis/budget.py) chooses what a linear search over every k chooses.

The reference below is the search without its shortcuts (the interpolated
start and Note [policy floor]'s skip): for "selective" and "full" it compiles
every k from 0 to n (the first k units take the policy) and keeps the least k
that fits, takes the fastest fitting configuration, then deepens prefetch while
it fits and is faster. On a tiny Llama of 4 layers at N = 1, 2 and 4, with
budgets between the plan that keeps everything and full recompute on every
layer (so the choice mixes a policy on some units with none on the others),
both must choose the same configuration with the same peak and predicted step.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import attrs

import pytest

import models
import shardlang as sl
import shardlang.api as api
from shardlang.step.batch import split_batch
from shardlang.compiler.analysis.budget import BudgetError, fit_budget
from shardlang.compiler import make_plan
from shardlang.compiler.analysis.cost import LINKS, ComputeModel, CostModel
from shardlang.spec.vocabulary import Recompute

LAYERS = 4
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


#: Compute-bound (no per-op overhead): "full" recompute costs more than "selective", as at 70B.
COMPUTE_BOUND = CostModel(compute=ComputeModel("compute-bound", flops_per_s=1e6, bytes_per_s=1e9))


def linear_choice(budget: int, compile_at, units, base_prefetch: int, max_prefetch: int, fixed: dict, model):
    """(recompute, prefetch, peak, step time) of the fastest fitting configuration, every k compiled."""

    def measure(policy, k, depth):
        step = compile_at({**{u: policy for u in units[:k]}, **fixed}, depth)
        return step.memory.peak, model.predict(step.schedule, step.graph_module).step_time_s

    found = [(Recompute.NONE, 0, base_prefetch, *measure(Recompute.NONE, 0, base_prefetch))]
    if found[0][3] > budget:
        for policy in (Recompute.SELECTIVE, Recompute.FULL):
            least = next((k for k in range(len(units) + 1) if measure(policy, k, base_prefetch)[0] <= budget), None)
            if least is not None:
                found.append((policy, least, base_prefetch, *measure(policy, least, base_prefetch)))
    fitting = [c for c in found if c[3] <= budget]
    assert fitting, "the test's budget must fit some configuration"
    best = min(fitting, key=lambda c: c[4])
    for depth in range(best[2] + 1, max_prefetch + 1):
        deeper = (best[0], best[1], depth, *measure(best[0], best[1], depth))
        if deeper[3] > budget or deeper[4] >= best[4]:
            break
        best = deeper
    shown = {u: best[0].value for u in units[:best[1]]} if best[0] is not Recompute.NONE else {}
    return {**shown, **{u: p.value for u, p in fixed.items()}}, best[2], best[3], best[4]


def plan(world: int, budget=None, recompute=None, cost_model=None):
    llama = models.load_llama_module()
    config = dataclasses.replace(llama.LlamaConfig(), n_layers=LAYERS)
    spec = sl.Spec(sl.Mesh(fsdp=world), units=["layers.*"], recompute=recompute,
                   options=sl.Options(memory_budget=budget))
    batch = split_batch(models.llama_batch(0), world, 0)
    return sl.plan(lambda: llama.Llama(config), llama.loss_fn, spec, example_batch=batch, world_size=world,
                   cost_model=cost_model)


def test_a_step_on_nccl_ranks_pools_every_shape_against_the_nccl_plan():
    """A step compiled on NCCL ranks searches its budget with the NCCL presets (`api.runtime_cost_model`), and
    every shape it compiles later (`Recipe`) keeps its pool within the NCCL plan's peak, as the first does.
    (examples/gpt.py at N=4 under 1.15 MiB: slots chosen against gloo's plan raise the NCCL peak by 21 KiB.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from shardlang.cli.common import rank_batch
    from shardlang.cli.job import build, load_job
    from shardlang.runtime.dist import Backend

    assert api.runtime_cost_model(Backend.GLOO) is None
    nccl = api.runtime_cost_model(Backend.NCCL)
    assert nccl.link.backend == "nccl"
    job, world = load_job(str(EXAMPLES / "gpt.py")), 4
    spec = attrs.evolve(job.spec, options=attrs.evolve(job.spec.options, memory_budget=int(1.15 * 2**20)))
    batch = rank_batch(job, 0, world, 0)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = build(job)
    first, recipe = api._compile_with_recipe(model, job.loss_fn, spec, job.optimizer, batch, world, False, None,
                                             nccl)
    assert first.budget.chosen.recompute, "the budget must choose a recompute for this test to compare like with like"
    again = recipe.compile(batch, first.context, 1)
    unpooled = recipe.compile_at(first.context.config, batch=batch, buffer_pool=False)
    peak = make_plan(unpooled, cost_model=nccl).memory.peak
    assert make_plan(first, cost_model=nccl).memory.peak == make_plan(again, cost_model=nccl).memory.peak == peak


@pytest.mark.parametrize("world, model", [(1, CostModel()), (4, CostModel()), (2, COMPUTE_BOUND)],
                         ids=["default-1", "default-4", "compute-bound-2"])
def test_budget_search_chooses_what_a_linear_search_chooses(monkeypatch, world, model):
    kept = plan(world).memory.peak
    full = plan(world, recompute=[("layers.*", "full")]).memory.peak
    runs = []

    def both(budget, compile_at, units, **kwargs):
        calls = []

        def counted(recompute, depth):
            calls.append((tuple(sorted((u, p.value) for u, p in recompute.items())), depth))
            return compile_at(recompute, depth)

        kwargs.pop("cost_model", None)  # the test's own model decides
        step, choice = fit_budget(budget, counted, units, cost_model=model, **kwargs)
        searched = set(calls)
        reference = linear_choice(budget, compile_at, units, kwargs["base_prefetch"], kwargs["max_prefetch"],
                                  kwargs["fixed"], model)
        runs.append((choice, reference, searched))
        return step, choice

    monkeypatch.setattr(api, "fit_budget", both)
    for fraction in (0.3, 0.6, 0.9):  # of the way from full recompute's peak to the peak that keeps everything
        budget = int(full + fraction * (kept - full))
        chosen = plan(world, budget=budget)
        choice, (recompute, prefetch, peak, time_s), searched = runs[-1]
        assert (dict(choice.chosen.recompute), choice.chosen.prefetch) == (recompute, prefetch), budget
        assert choice.chosen.peak == peak == chosen.memory.peak <= budget
        assert choice.chosen.step_time_s == time_s
        assert 0 < len(choice.chosen.recompute) < LAYERS + 2  # a mix: some units recompute, others do not
        assert len(choice.tried) == len(searched)


@pytest.mark.parametrize("model", [CostModel(), COMPUTE_BOUND], ids=["default", "compute-bound"])
def test_policy_floor_is_below_every_full_configuration(model):
    """Note [policy floor]'s bound, at the least k that could fit, is at most each fitting full plan's time."""
    world = 2
    none = plan(world)
    memory, timeline = none.memory, model.predict(none.schedule, none.graph_module)
    units = [f"layers.{i}" for i in range(LAYERS)]
    from shardlang.compiler.analysis.budget import _policy_floor

    for k in range(1, LAYERS + 1):
        step = plan(world, recompute=[(u, "full") for u in units[:k]])
        budget = step.memory.peak
        floor = _policy_floor(none, memory, timeline, Recompute.FULL, units, budget, model)
        time_s = model.predict(step.schedule, step.graph_module).step_time_s
        assert timeline.step_time_s <= floor <= time_s


def test_the_budget_counts_the_collective_scratch_of_the_cost_models_link():
    """On an NCCL link no copy of a collective's payload is held (Note [collective scratch]): a budget that the
    NCCL plan of keeping everything fits, and gloo's does not, is met with nothing recomputed, at the peak
    the plan under that link reports. (examples/gpt.py at N=4: its peak lies in a gather.)"""
    from shardlang.cli.common import rank_batch
    from shardlang.cli.job import build, load_job

    job, world, nccl = load_job(str(EXAMPLES / "gpt.py")), 4, CostModel(link=LINKS["nvlink"])

    def gpt(budget, cost_model=None):
        spec = attrs.evolve(job.spec, options=attrs.evolve(job.spec.options, memory_budget=budget))
        return sl.plan(lambda: build(job), job.loss_fn, spec, optimizer=job.optimizer,
                       example_batch=rank_batch(job, 0, world, 0), world_size=world, cost_model=cost_model)

    kept = gpt(None)
    gloo_peak, nccl_peak = kept.memory.peak, make_plan(kept, cost_model=nccl).memory.peak
    assert nccl_peak < gloo_peak
    budget = (nccl_peak + gloo_peak) // 2
    chosen = gpt(budget, nccl)
    assert chosen.budget.chosen.recompute == ()
    assert chosen.budget.chosen.peak == make_plan(chosen, cost_model=nccl).memory.peak <= budget
    with pytest.raises(BudgetError):  # under gloo's copies the same budget fits nothing
        gpt(budget)


def test_the_pool_keeps_the_peak_of_the_cost_models_link():
    """The pool holds a slot only where the plan for the cost model's link does not rise (Note [pool after the
    search]): under NCCL the chosen, pooled step plans to the peak of the same configuration without the pool.
    (examples/gpt.py at N=4 under 1.15 MiB: slots chosen against gloo's plan raised its NCCL peak by 21 KiB.)"""
    from shardlang.cli.common import rank_batch
    from shardlang.cli.job import build, load_job

    job, world, nccl = load_job(str(EXAMPLES / "gpt.py")), 4, CostModel(link=LINKS["nvlink"])

    def gpt(budget, **options):
        spec = attrs.evolve(job.spec, options=attrs.evolve(job.spec.options, memory_budget=budget, **options))
        return sl.plan(lambda: build(job), job.loss_fn, spec, optimizer=job.optimizer,
                       example_batch=rank_batch(job, 0, world, 0), world_size=world, cost_model=nccl)

    chosen = gpt(int(1.15 * 2**20))
    choice = chosen.budget.chosen
    assert choice.recompute, "the budget must choose a recompute for this test to compare like with like"
    unpooled = attrs.evolve(job.spec, recompute=list(choice.recompute), options=attrs.evolve(
        job.spec.options, prefetch=choice.prefetch, buffer_pool=False))
    alone = sl.plan(lambda: build(job), job.loss_fn, unpooled, optimizer=job.optimizer,
                    example_batch=rank_batch(job, 0, world, 0), world_size=world, cost_model=nccl)
    assert choice.peak == make_plan(chosen, cost_model=nccl).memory.peak == make_plan(alone, cost_model=nccl).memory.peak
    assert choice.step_time_s == pytest.approx(make_plan(alone, cost_model=nccl).timeline.step_time_s, rel=1e-12)


@pytest.mark.parametrize("world, model", [(1, CostModel()), (4, CostModel()), (2, COMPUTE_BOUND)],
                         ids=["default-1", "default-4", "compute-bound-2"])
def test_a_warm_started_search_chooses_what_a_cold_one_chooses(monkeypatch, world, model):
    """Note [warm start]: from the rows a first search learnt, a second search chooses the same configuration
    and compiles fewer; from wrong rows (units said to keep nothing under the policy, or all they keep without
    it) it still chooses the same, at the cost of compiles."""
    kept = plan(world).memory.peak
    full = plan(world, recompute=[("layers.*", "full")]).memory.peak
    runs = []

    def searches(budget, compile_at, units, **kwargs):
        kwargs.update(cost_model=model, finish=None, kept_under=None)

        def search(rows):
            calls = set()

            def counted(recompute, depth):
                calls.add((tuple(sorted((u, p.value) for u, p in recompute.items())), depth))
                return compile_at(recompute, depth)

            step, choice = fit_budget(budget, counted, units, **{**kwargs, "kept_under": rows})
            return step, choice, len(calls)

        cold = search(None)
        none = next(c for c in cold[1].tried if c.policy == "none").kept
        rows = {"learnt": cold[1].kept_under, "nothing kept": {p: {} for p in ("selective", "full")},
                "all kept": {p: dict(none) for p in ("selective", "full")}}
        runs.append((cold, {name: search(r) for name, r in rows.items()}))
        return cold[:2]

    monkeypatch.setattr(api, "fit_budget", searches)
    warmed = 0
    for fraction in (0.3, 0.6, 0.9):
        plan(world, budget=int(full + fraction * (kept - full)))
        (_, cold, cold_compiles), warm = runs[-1]
        assert set(cold.kept_under) <= {"selective", "full"} and cold.kept_under
        for name, (_, choice, compiles) in warm.items():
            assert (choice.chosen.recompute, choice.chosen.prefetch, choice.chosen.peak, choice.chosen.step_time_s) \
                == (cold.chosen.recompute, cold.chosen.prefetch, cold.chosen.peak, cold.chosen.step_time_s), name
        assert warm["learnt"][2] <= cold_compiles
        warmed += cold_compiles - warm["learnt"][2]
    assert warmed > 0  # k = n is not compiled where the learnt rows say the policy fits


def test_the_rows_a_search_learns_are_the_same_for_another_mesh_split():
    """Note [warm start]'s premise: what each unit keeps under a policy is its activations, which a mesh split
    does not change (the tiny Llama at N=4: fsdp=4 against replicate=2 x fsdp=2, each halfway between full
    recompute and none)."""
    world, rows = 4, []
    llama = models.load_llama_module()
    config = dataclasses.replace(llama.LlamaConfig(), n_layers=LAYERS)
    for mesh in (sl.Mesh(fsdp=4), sl.Mesh(replicate=2, fsdp=2)):
        def planned(**spec):
            return sl.plan(lambda: llama.Llama(config), llama.loss_fn, sl.Spec(mesh, units=["layers.*"], **spec),
                              world_size=world, example_batch=split_batch(models.llama_batch(0), world, 0))
        budget = (planned().memory.peak + planned(recompute=[("layers.*", "full")]).memory.peak) // 2
        rows.append(planned(options=sl.Options(memory_budget=budget)).budget.kept_under)
    assert rows[0] and rows[0] == rows[1]


@pytest.mark.parametrize("model", [CostModel(), COMPUTE_BOUND], ids=["default", "compute-bound"])
def test_the_search_floor_is_below_every_configuration_that_fits(model):
    """Note [search floor]: from the first configuration alone, a bound on what the search chooses and on every
    configuration at that depth that fits: its compute, and under a budget it misses, the least recompute."""
    from shardlang.compiler.analysis.budget import Candidate, search_floor

    world = 2
    none = plan(world)
    memory, timeline = none.memory, model.predict(none.schedule, none.graph_module)
    units = [f"layers.{i}" for i in range(LAYERS)]
    compute = search_floor(none, memory, timeline, units, memory.peak, model)  # it fits: its compute alone
    assert 0 < compute <= timeline.step_time_s
    configurations = [plan(world, recompute=[(u, policy) for u in units[:k]])
                      for policy in ("selective", "full") for k in range(1, LAYERS + 1)]
    full = plan(world, recompute=[("layers.*", "full")]).memory.peak
    tightened = []
    for fraction in (0.3, 0.6, 0.9):
        budget = int(full + fraction * (memory.peak - full))
        floor = search_floor(none, memory, timeline, units, budget, model)
        assert floor > compute  # once one fits at its depth, the recompute it needs to fit is counted
        assert search_floor(none, memory, timeline, units, budget, model, fitted=False) == compute
        fitting = [model.predict(s.schedule, s.graph_module).step_time_s for s in configurations
                   if s.memory.peak <= budget]
        assert fitting and floor <= min(fitting)
        chosen = plan(world, budget=budget, cost_model=model)
        assert floor <= model.predict(chosen.schedule, chosen.graph_module).step_time_s
        # each policy's own rows (every unit under it) say what it saves: a tighter bound, still below them all
        rows = [Candidate((), 1, s.memory.peak, 0.0, policy, LAYERS, {u.unit: u.kept for u in s.memory.units})
                for policy, s in (("selective", configurations[LAYERS - 1]), ("full", configurations[-1]))]
        tighter = search_floor(none, memory, timeline, units, budget, model, tried=rows)
        assert floor <= tighter <= min(fitting)
        tightened.append(tighter > floor)
    assert any(tightened)  # "selective" saves less than its units keep


def test_a_search_told_when_to_give_up_skips_the_recompute_that_cannot_fit():
    """Note [no recompute fits]: under a budget below the first peak less every unit's kept bytes, a search for
    `shardlang tune` (``give_up`` given) compiles no recompute, yet fails as the user's own search does."""
    from shardlang.compiler.analysis.budget import BudgetHints

    world = 2
    none = plan(world)
    budget = none.memory.peak - sum(u.kept for u in none.memory.units) - 1
    llama = models.load_llama_module()
    config = dataclasses.replace(llama.LlamaConfig(), n_layers=LAYERS)
    spec = sl.Spec(sl.Mesh(fsdp=world), units=["layers.*"], options=sl.Options(memory_budget=budget))
    compiled = []

    def search(hints):
        real = api.compile_step

        def counted(*args, **kwargs):
            compiled.append(args[2].scheduling)
            return real(*args, **kwargs)

        api.compile_step = counted
        try:
            with pytest.raises(BudgetError) as failed:
                sl.plan(lambda: llama.Llama(config), llama.loss_fn, spec, world_size=world, budget_hints=hints,
                        example_batch=split_batch(models.llama_batch(0), world, 0))
        finally:
            api.compile_step = real
        return failed.value, [s.recompute for s in compiled]

    users, users_compiles = search(None)
    compiled.clear()
    tunes, tunes_compiles = search(BudgetHints({}, lambda step, floor_s: None))
    assert any(users_compiles) and not any(tunes_compiles)  # the user's own search tried recompute; tune's not
    assert len(tunes_compiles) == 2  # none at its depth, then none without prefetch
    assert users.leanest_peak <= tunes.leanest_peak
