"""``shardlang tune``: the layouts it searches, the bound it prunes by, the spec it writes, and --measure."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import attrs
import pytest
import torch

import shardlang as sl
from shardlang.checkpoint.export import parse_size
from shardlang.cli import main
from shardlang.cli.job import build, load_job
from shardlang.cli.common import rank_batch
from shardlang.compiler import CostModel, make_plan
from shardlang.spec.strategy import Strategy
from shardlang.compiler.analysis.cost import LinkModel
from shardlang.compiler.analysis.formulas import REGATHER_DETAIL
from shardlang.tune import held_lower_bound, layouts, tune
from shardlang.tune.patterns import unit_patterns
from shardlang.tune.search import Job, _flat_summaries, _spec_of, communication_floor, compile_layout

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "examples" / "gpt.py")
SLOW_LINK = LinkModel("slow", alpha_s=1e-3, bandwidth=1e8, backend="gloo")  # communication decides
sys.path.insert(0, str(ROOT / "examples"))


def _gpt_job():
    return load_job(GPT)


def test_layouts_cover_granularity_strategy_and_mesh_split_once_each():
    job = _gpt_job()
    found = layouts(build(job), job.spec, 4)
    assert len(found) == len(set(found))
    grains = {(lay.granularity, lay.units) for lay in found}
    assert grains == {("job", ("blocks.*",)), ("whole", ())}  # the default blocks are the job's: not twice
    meshes = {tuple(lay.mesh.axes) for lay in found if lay.strategy is Strategy.ZERO3}
    assert meshes == {(("fsdp", 4),), (("replicate", 2), ("fsdp", 2))}
    assert all(tuple(lay.mesh.axes) == (("fsdp", 4),) for lay in found if lay.strategy is Strategy.DDP)


def test_the_lower_bound_is_what_each_strategy_must_hold():
    job = _gpt_job()
    by = {lay.strategy: lay for lay in layouts(build(job), job.spec, 4) if len(lay.mesh.axes) == 1}
    p = 1000
    assert held_lower_bound(by[Strategy.ZERO3], p, 2, 4) == 3 * p // 4
    assert held_lower_bound(by[Strategy.ZERO3], p, 2, 4, (100, 300)) == 3 * p // 4 + 300  # the largest unit gathered
    assert held_lower_bound(by[Strategy.ZERO2], p, 2, 4, (100, 300)) == 3 * p // 4 + 400  # every unit gathered
    assert held_lower_bound(by[Strategy.ZERO1], p, 2, 4) == p + 2 * p // 4
    assert held_lower_bound(by[Strategy.DDP], p, 2, 4) == 3 * p


def test_the_step_floor_is_the_link_time_of_the_collectives_and_never_above_a_prediction():
    job = _gpt_job()
    world, model = 4, CostModel(link=SLOW_LINK)
    chosen = [lay for lay in layouts(build(job), job.spec, world)  # every strategy, and a replicate x shard mesh
              if lay.granularity == "job" and (lay.strategy is Strategy.ZERO3 or len(lay.mesh.axes) == 1)]
    for layout in chosen:
        spec = _spec_of(job.spec, layout, None)
        compiled = sl.plan(lambda: build(job), job.loss_fn, spec, optimizer=job.optimizer,
                           example_batch=rank_batch(job, 0, world, 0), world_size=world)
        timeline = make_plan(compiled, cost_model=model).timeline
        flats = _flat_summaries(build(job), spec, world)
        again = frozenset(op.flat for op in compiled.schedule.ops if op.detail == REGATHER_DETAIL)
        learnt = communication_floor(flats, dict(layout.mesh.axes), world, model, again)
        assert learnt == pytest.approx(sum(timeline.comm_s.values()), rel=1e-9), layout.describe()
        assert communication_floor(flats, dict(layout.mesh.axes), world, model) <= learnt <= timeline.step_time_s


def test_pruning_by_the_step_floor_keeps_the_best_and_compiles_less():
    job = _gpt_job()
    world, model = 2, CostModel(link=SLOW_LINK)
    search = lambda keep: tune(lambda: build(job), job.loss_fn, job.spec, job.optimizer,  # noqa: E731
                               rank_batch(job, 0, world, 0), world, None, model, keep=keep)
    pruned, exhaustive = search(1), search(100)
    assert not exhaustive.bounded and pruned.bounded
    assert pruned.compiles < exhaustive.compiles
    assert (pruned.best.layout, pruned.best.step_time_s) == (exhaustive.best.layout, exhaustive.best.step_time_s)
    assert all(b.floor_s >= pruned.best.step_time_s for b in pruned.bounded)
    assert pruned.layouts_seen == exhaustive.layouts_seen


def test_layouts_compiled_in_parallel_find_what_the_serial_search_finds():
    job = _gpt_job()
    world, budget = 2, int(2.1 * 2**20)
    search = lambda keep, workers: tune(lambda: build(job), job.loss_fn, job.spec, job.optimizer,  # noqa: E731
                                        rank_batch(job, 0, world, 0), world, budget, CostModel(link=SLOW_LINK),
                                        keep=keep, workers=workers)
    seen = lambda r: ([(e.layout, e.step_time_s, e.peak, e.spec) for e in r.fitting],  # noqa: E731
                      sorted((u.layout.describe(), u.least_bytes) for u in r.unfit))
    serial, parallel = search(100, 1), search(100, 2)  # nothing pruned by time: the same layouts compiled
    assert seen(parallel) == seen(serial) and parallel.compiles == serial.compiles
    pruned, pruned_serial = search(1, 2), search(1, 1)  # Note [layouts in parallel]: the serial search's decisions
    assert pruned.bounded and (pruned.best.layout, pruned.best.step_time_s) == (serial.best.layout,
                                                                                serial.best.step_time_s)
    assert seen(pruned) == seen(pruned_serial)
    assert [(b.layout, b.floor_s) for b in pruned.bounded] == [(b.layout, b.floor_s) for b in pruned_serial.bounded]


def test_a_layout_whose_collectives_alone_take_the_cutoff_is_given_up_after_one_compile():
    """Note [step floor]: the first configuration compiled shows which units the layout gathers again; when its
    collectives alone then take the step time a layout must beat to lead, the layout is given up there (one
    compile, its floor and re-gathers reported). Just under that, it is searched in full, as with no cutoff."""
    job = _gpt_job()
    world, model, budget = 2, CostModel(link=SLOW_LINK), int(2.1 * 2**20)
    tune_job = Job(lambda: build(job), job.loss_fn, job.spec, job.optimizer, rank_batch(job, 0, world, 0), world,
                   budget, model)
    layout = next(lay for lay in layouts(build(job), job.spec, world) if lay.strategy is Strategy.ZERO3
                  and lay.granularity == "job" and len(lay.mesh.axes) == 1)
    spec = _spec_of(job.spec, layout, None)
    units = spec.resolve(build(job), world).units
    searched = compile_layout(tune_job, layout, units)
    assert searched.evaluated is not None and searched.compiles > 1 and searched.regathered
    floor = communication_floor(_flat_summaries(build(job), spec, world), dict(layout.mesh.axes), world, model,
                                searched.regathered)
    given_up = compile_layout(tune_job, layout, units, cutoff=lambda: floor)
    assert (given_up.compiles, given_up.evaluated, given_up.regathered) == (1, None, searched.regathered)
    assert given_up.bounded.layout == layout and given_up.bounded.compiled
    assert given_up.bounded.floor_s == pytest.approx(floor, rel=1e-12)
    kept = compile_layout(tune_job, layout, units, cutoff=lambda: floor * (1 + 1e-9))
    assert (kept.evaluated, kept.compiles) == (searched.evaluated, searched.compiles)


def _llama_job(layers: int):
    import dataclasses

    import models
    from shardlang.step.batch import split_batch

    llama = models.load_llama_module()
    config = dataclasses.replace(llama.LlamaConfig(), n_layers=layers)
    return (lambda: llama.Llama(config)), llama.loss_fn, sl.Spec(sl.Mesh(fsdp=2), units=["layers.*"]), \
        (lambda world: split_batch(models.llama_batch(0), world, 0))


def test_the_leading_layouts_are_tried_with_their_blocks_grouped(tmp_path):
    """Note [grouped blocks]: on a link where each collective's latency dominates, two and four layers to a
    collective predict faster than one, and the grouped spec runs what was predicted."""
    build_llama, loss_fn, spec, batch_of = _llama_job(8)
    world, latency = 2, CostModel(link=LinkModel("latency", alpha_s=5e-3, bandwidth=1e12, backend="gloo"))
    result = tune(build_llama, loss_fn, spec, sl.AdamW(lr=1e-3), batch_of(world), world, None, latency, keep=100)
    evaluated = {e.layout: e for e in result.fitting}
    one = next(e for lay, e in evaluated.items() if lay.granularity == "job" and lay.strategy is Strategy.ZERO3
               and lay.group == 1 and len(lay.mesh.axes) == 1)
    grouped = {g: evaluated[lay] for g in (2, 4) for lay in evaluated
               if lay == attrs.evolve(one.layout, group=g, bucket_bytes=lay.bucket_bytes)}
    assert set(grouped) == {2, 4}
    assert grouped[4].step_time_s < grouped[2].step_time_s < one.step_time_s
    for g, e in grouped.items():
        compiled = sl.plan(build_llama, loss_fn, e.spec, optimizer=sl.AdamW(lr=1e-3), example_batch=batch_of(world),
                           world_size=world)
        layers = [[u for u in f.unit.split("+") if u.startswith("layers.")] for f in compiled.flats]
        assert sorted(len(group) for group in layers if group)[1:] == [g] * (8 // g - 1), layers
        assert e.spec.options.bucket_bytes == e.layout.bucket_bytes > 0
        plan = make_plan(compiled, cost_model=latency)
        assert (plan.memory.peak, plan.timeline.step_time_s) == (e.peak, e.step_time_s)
        (tmp_path / "spec.toml").write_text(e.spec.to_toml())
        assert sl.Spec.from_toml(tmp_path / "spec.toml").options.bucket_bytes == e.layout.bucket_bytes


def test_tune_orders_by_predicted_time_and_its_spec_plans_to_what_it_predicted():
    job = _gpt_job()
    world, budget, model = 2, int(2.1 * 2**20), CostModel()
    result = tune(lambda: build(job), job.loss_fn, job.spec, job.optimizer, rank_batch(job, 0, world, 0), world,
                  budget, model)
    times = [e.step_time_s for e in result.fitting]
    assert times == sorted(times) and all(e.peak <= budget for e in result.fitting)
    assert any(not u.compiled or u.least_bytes > budget for u in result.unfit)
    best = result.best
    again = sl.plan(lambda: build(job), job.loss_fn, best.spec, optimizer=job.optimizer,
                    example_batch=rank_batch(job, 0, world, 0), world_size=world)
    plan = make_plan(again, cost_model=model)
    assert (plan.memory.peak, plan.timeline.step_time_s) == (best.peak, best.step_time_s)
    assert best.spec.options.memory_budget is None  # the written spec says what runs, with no search left


def test_the_command_writes_a_spec_that_run_takes(tmp_path, capfd):
    out = tmp_path / "spec.toml"
    assert main(["tune", GPT, "--world", "1", "--memory-budget", "4MiB", "--measure", "2", "--measure-steps", "1",
                 "--out", str(out)]) == 0
    text = capfd.readouterr().out
    assert re.search(r"searched \d+ layouts in [\d.]+ s with \d+ compiles \(\d+ at a time\): \d+ pruned by memory "
                     r"and \d+ by time", text)
    assert "measuring the 2 best on 1 local rank" in text and "ratio" in text
    rows = re.findall(r"^\s+[12]\s+\S+ms\s+\S+ms\s+\S+\s+([\d.]+ \w+)\s+([\d.]+ \w+)\s+([\d.]+ \w+)\s", text, re.M)
    assert len(rows) == 2, text
    for planned, in_use, resident in ([parse_size(v.replace(" ", "")) for v in row] for row in rows):
        # the sampled bytes in use hold at least most of what the plan counts, and less than the resident set;
        # above the plan: the runtime's own (about 30 MiB here: compiled graphs, gloo's buffers)
        assert 0.8 * planned <= in_use <= min(resident, planned + 64 * 2**20), text
    spec = sl.Spec.from_toml(out)
    assert spec.options.memory_budget is None
    assert main(["run", GPT, "--steps", "1", "--spec", str(out)]) == 0


def test_nothing_fits_says_by_how_much_and_exits_1(capsys):
    assert main(["tune", GPT, "--world", "2", "--memory-budget", "1KiB"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"nothing fits 1\.00 KiB per rank: the leanest layout, .* over", out), out


def test_a_per_unit_choice_is_written_as_few_patterns_that_decide_every_unit_alike():
    units = ["tok_embeddings", *(f"layers.{i}" for i in range(80)), "output"]
    chosen = {u: "full" for u in units[:60]}  # tok_embeddings, layers.0 .. layers.58
    assert unit_patterns(chosen, units) == [("tok_embeddings", "full"), ("layers.[0-9]", "full"),
                                            ("layers.[1-4][0-9]", "full"), ("layers.5[0-8]", "full")]
    mixed = {"layers.3": "full", "layers.4": "selective", "layers.5": "full", "layers.12": "full"}
    assert unit_patterns(mixed, units) == [("layers.3", "full"), ("layers.5", "full"), ("layers.12", "full"),
                                           ("layers.4", "selective")]
    # a name's own glob characters are matched literally, and the answer is checked unit by unit
    odd = ["x[1].1", "x[1].2", "x1.1", "y*"]
    assert unit_patterns({"x[1].1": "full", "x[1].2": "full", "y*": "full"}, odd) == [
        ("y[*]", "full"), ("x[[]1].[1-2]", "full")]
    assert unit_patterns({}, units) == []


@pytest.mark.parametrize("world", [1, 2, 4])
def test_layers_grouped_per_collective_train_like_one_process(run_on, references, world):
    """Note [grouped blocks]: the bucket_bytes a grouping writes (two layers of their flat size) merges the layers
    into one collective, and the step trains as one process does."""
    import models
    import parity
    from shardlang.compiler.schedule.schedule import flat_summary
    from shardlang.tune.search import _bucket_bytes

    case = models.CASES["llama_tiny"]
    resolved = parity.spec_for(case, world).resolve(case.build(torch.float64), world)
    layer = next(f for f in resolved.config.flats() if f.unit == "layers.0")
    results = run_on(world, parity.train_sharded, "llama_tiny", "adamw", "float64", 3,
                     {"bucket_bytes": 2 * _bucket_bytes(flat_summary(layer))})
    _, ref_params, _ = references("llama_tiny", "adamw", "float64", 3)
    assert parity.max_relative_difference(results[0][1], ref_params) < 1e-9
    units = [f["unit"] for f in results[0][3]["flats"]]
    assert any("layers.0+layers.1" in unit for unit in units), units


def test_jobs_must_be_a_positive_number(capsys):
    with pytest.raises(SystemExit):
        main(["tune", GPT, "--world", "2", "--jobs", "0"])
    assert "argument --jobs: '0' is not a number of processes; expected an integer >= 1" in capsys.readouterr().err


# Note [the job's own choices]: each dimension the search chooses, preset in the job's spec
PRESETS = {
    "units": lambda spec: attrs.evolve(spec, units=["blocks.0", "blocks.1"]),
    "strategies": lambda spec: attrs.evolve(spec, strategies=[("blocks.0", "zero2"), ("*", "zero1")]),
    "recompute": lambda spec: attrs.evolve(spec, recompute=[("blocks.0", "full"), ("blocks.*", "selective")]),
    "prefetch": lambda spec: attrs.evolve(spec, options=attrs.evolve(spec.options, prefetch=2)),
    "mesh": lambda spec: attrs.evolve(spec, mesh=sl.Mesh(replicate=2, fsdp=-1)),
    "bucket_bytes": lambda spec: attrs.evolve(spec, options=attrs.evolve(spec.options, bucket_bytes=2**20)),
}


@pytest.mark.parametrize("budget", [None, int(2.1 * 2**20)], ids=["no-budget", "budget"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_tune_starts_from_what_the_job_sets_and_its_choice_plans_as_predicted(preset, budget):
    job = _gpt_job()
    world, model = 2, CostModel()
    spec = PRESETS[preset](job.spec)
    result = tune(lambda: build(job), job.loss_fn, spec, job.optimizer, rank_batch(job, 0, world, 0), world,
                  budget, model, keep=100 if preset == "strategies" else 1)  # all compiled: the job's own too
    best = result.best
    again = sl.plan(lambda: build(job), job.loss_fn, best.spec, optimizer=job.optimizer,
                    example_batch=rank_batch(job, 0, world, 0), world_size=world)
    plan = make_plan(again, cost_model=model)
    assert (plan.memory.peak, plan.timeline.step_time_s) == (best.peak, best.step_time_s)
    assert sl.Spec.from_dict(best.spec.to_dict()).to_dict() == best.spec.to_dict()
    evaluated = [e for e in result.fitting if e.layout.granularity == "job" and e.layout.group == 1]
    assert evaluated and not [u for u in result.unfit if u.compiled is False and budget is None]
    if preset == "units":
        assert all(e.spec.units == ("blocks.0", "blocks.1") for e in evaluated)
    if preset == "mesh":  # the job's split first, then the others
        searched = [tuple(lay.mesh.axes) for lay in layouts(build(job), spec, world)]
        assert searched[0] == (("replicate", 2), ("fsdp", 1))
        assert set(searched) == {(("replicate", 2), ("fsdp", 1)), (("fsdp", 2),)}
    if preset == "prefetch" and budget is None:
        assert all(e.spec.options.prefetch == 2 for e in result.fitting)
    if preset == "bucket_bytes":
        assert all(e.spec.options.bucket_bytes == 2**20 for e in result.fitting if e.layout.group == 1)
    if preset == "strategies":  # the job's own layout is a candidate, with its strategies as written
        own = [e for e in result.fitting if e.layout.strategy is None]
        assert len(own) == 1 and own[0].spec.strategies == spec.strategies, result.fitting
        assert own[0].one_line().startswith("the job's strategies units [blocks.*]")
    else:
        assert all(e.layout.strategy is not None for e in result.fitting)


def test_the_job_s_recompute_goes_with_the_layouts_it_fits_and_is_left_out_with_its_reason_where_not():
    job = _gpt_job()
    world = 2
    spec = PRESETS["recompute"](job.spec)
    result = tune(lambda: build(job), job.loss_fn, spec, job.optimizer, rank_batch(job, 0, world, 0), world,
                  None, CostModel(), keep=100)
    by_grain = {e.layout.granularity: e for e in result.fitting}
    assert by_grain["job"].spec.recompute == spec.recompute
    assert "left out" not in by_grain["job"].one_line()
    whole = by_grain["whole"]
    assert whole.spec.recompute is None and whole.spec.units == ()
    assert whole.one_line().endswith(
        "recompute as the job's (left out: recompute[0] = RecomputeRule('blocks.0', 'full') matches no unit here; "
        "recompute[1] = RecomputeRule('blocks.*', 'selective') matches no unit here), prefetch 1")
    # a rule that matches only units an earlier rule took decides nothing there, and is left out alone
    from shardlang.spec.recompute import RecomputeRule
    from shardlang.tune.search import fitting_recompute
    rules = (RecomputeRule("blocks.*", "full"), RecomputeRule("blocks.1", "selective"), RecomputeRule("*", "full"))
    assert fitting_recompute(rules, frozenset({"blocks.0", "blocks.1"})) == (
        rules[::2], ("recompute[1] = RecomputeRule('blocks.1', 'selective') decides no unit here",))


def test_the_command_tunes_a_hugging_face_job_that_already_recomputes(tmp_path, capsys):
    """The job that stopped tune: an HF Llama on meta, units and selective recompute over its layers, bf16 params
    with fp32 reduce, under a memory budget."""
    pytest.importorskip("transformers")
    job = tmp_path / "hf_llama.py"
    job.write_text(
        "import torch, transformers, shardlang as sl\n"
        "import torch.nn.functional as F\n"
        "config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,"
        " num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)\n"
        "def build_model():\n"
        "    with torch.device('meta'):\n"
        "        return transformers.LlamaForCausalLM(config)\n"
        "def loss_fn(model, tokens):\n"
        "    logits = model(tokens[:, :-1]).logits\n"
        "    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))\n"
        "def make_batch(step):\n"
        "    return torch.randint(96, (8, 17), generator=torch.Generator().manual_seed(step))\n"
        "spec = sl.Spec(mesh=sl.Mesh(fsdp=-1), units=['model.layers.*'], recompute=[('model.layers.*', 'selective')],"
        " options=sl.Options(mixed_precision=sl.MixedPrecision(param_dtype=torch.bfloat16,"
        " reduce_dtype=torch.float32)))\n"
        "optimizer = sl.AdamW(lr=1e-3)\n")
    out = tmp_path / "spec.toml"
    assert main(["tune", str(job), "--world", "8", "--memory-budget", "80GiB", "--link", "nvlink",
                 "--compute", "h100-bf16", "--jobs", "1", "--out", str(out)]) == 0, capsys.readouterr()
    text = capsys.readouterr().out
    assert "units [the whole model]" in text and "error" not in text
    assert sl.Spec.from_toml(out).options.mixed_precision == sl.MixedPrecision(param_dtype=torch.bfloat16,
                                                                                 reduce_dtype=torch.float32)


def test_a_layout_whose_compute_and_needed_recompute_take_the_cutoff_is_given_up_after_one_compile():
    """Note [search floor]: on a link so fast that the collectives take no time, the first configuration bounds
    the layout by its compute, and once a configuration fits, by its compute and the recompute it needs to fit
    the budget. At each bound the layout is given up there, reported with its compute; just over the second, it
    is searched in full. The bounds are below the step the search finds."""
    job = _gpt_job()
    fast = CostModel(link=LinkModel("fast", alpha_s=0.0, bandwidth=1e18, backend="gloo"))
    world, budget = 2, int(1.98 * 2**20)  # between full recompute's peak (1.92 MiB) and none's (2.04 MiB)
    tune_job = Job(lambda: build(job), job.loss_fn, job.spec, job.optimizer, rank_batch(job, 0, world, 0), world,
                   budget, fast)
    layout = next(lay for lay in layouts(build(job), job.spec, world) if lay.strategy is Strategy.ZERO3
                  and lay.granularity == "job" and len(lay.mesh.axes) == 1)
    units = _spec_of(job.spec, layout, None).resolve(build(job), world).units
    searched = compile_layout(tune_job, layout, units)
    assert searched.evaluated is not None and searched.compiles > 1
    assert "recompute none" not in searched.evaluated.schedule_choice  # the budget needs recompute
    first = compile_layout(tune_job, layout, units, cutoff=lambda: 0.0)
    compute = first.bounded
    assert first.compiles == 1 and compute.compiled and compute.by_compute
    assert "its compute, with the recompute it needs" in compute.why()
    then = compile_layout(tune_job, layout, units, cutoff=lambda: compute.floor_s * (1 + 1e-9))
    recompute = then.bounded
    assert then.compiles == 2 and recompute.by_compute
    assert 0 < compute.floor_s < recompute.floor_s <= searched.evaluated.step_time_s
    given_up = compile_layout(tune_job, layout, units, cutoff=lambda: recompute.floor_s)
    assert (given_up.compiles, given_up.bounded) == (2, recompute)
    kept = compile_layout(tune_job, layout, units, cutoff=lambda: recompute.floor_s * (1 + 1e-9))
    assert (kept.evaluated, kept.compiles) == (searched.evaluated, searched.compiles)


def test_a_layout_over_the_budget_rules_out_its_splits_with_larger_shards():
    """Note [larger shards]: a layout found over the budget reports each layout like it over no more fsdp ranks
    uncompiled; compiled, each is over the budget too, its leanest peak no lower."""
    job = _gpt_job()
    world, budget = 4, int(1.2 * 2**20)  # over every layout's leanest peak (1.29 MiB and up)
    bandwidth_bound = CostModel(link=LinkModel("bandwidth-bound", alpha_s=0.0, bandwidth=1e8, backend="gloo"))
    lines: list[str] = []
    result = tune(lambda: build(job), job.loss_fn, job.spec, job.optimizer, rank_batch(job, 0, world, 0), world,
                  budget, bandwidth_bound, say=lines.append)
    ruled_out = [u for u in result.unfit if u.like is not None]
    assert ruled_out and result.best is None
    assert not any(f"layout, {u.layout.describe()}," in result.shortfall() for u in ruled_out)  # never leanest
    tune_job = Job(lambda: build(job), job.loss_fn, job.spec, job.optimizer, rank_batch(job, 0, world, 0), world,
                   budget, bandwidth_bound)
    for unfit in ruled_out:
        assert not unfit.compiled and attrs.evolve(unfit.layout, mesh=unfit.like.mesh) == unfit.like
        assert any(f"its shards are no smaller than those of {unfit.like.describe()}" in line for line in lines)
        units = _spec_of(job.spec, unfit.layout, None).resolve(build(job), world).units
        compiled = compile_layout(tune_job, unfit.layout, units)
        assert compiled.unfit is not None and compiled.unfit.least_bytes >= unfit.least_bytes
