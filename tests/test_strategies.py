"""Strategies per unit: ZeRO-3, ZeRO-2, ZeRO-1 and DDP (docs/strategies.md).

- the spec syntax and its errors;
- the schedule's bytes equal each strategy's formula at N = 1, 2, 4 (planned,
  no processes), and the verifier catches a schedule that breaks a strategy;
- parity with one process (float64, within 1e-9) at N = 1, 2, 4 with SGD and
  AdamW, for each strategy, for a spec that mixes them, and for sharding
  along tensor dims; and the bytes the collectives really move equal the plan.
"""

from __future__ import annotations

import json
import math

import attrs
import pytest
import torch

import shardlang as sl
from shardlang.step.batch import split_batch
from shardlang.compiler.analysis.formulas import formula_bytes, formula_bytes_by_flat
from shardlang.compiler.schedule.schedule import OpKind
from shardlang.spec.strategy import StrategyRule

import parity
import strategy_workers as w
from models import CASES

STEPS = 3
TOLERANCE = 1e-9
STRATEGIES = ["zero3", "zero2", "zero1", "ddp"]


# ---- the spec ------------------------------------------------------------------------------------


def test_strategies_are_written_as_pairs_rules_or_one_strategy():
    spec = sl.Spec(sl.Mesh(fsdp=4), strategies=[("blocks.*", sl.ZeRO3), ("*", "ddp")])
    assert spec.strategies == (StrategyRule("blocks.*", sl.ZeRO3), StrategyRule("*", sl.DDP))
    assert repr(spec.strategies[1]) == "StrategyRule('*', DDP)"
    pattern, strategy = spec.strategies[0]
    assert (pattern, strategy) == ("blocks.*", sl.Strategy.ZERO3)
    assert sl.Spec(sl.Mesh(fsdp=4), strategies=sl.ZeRO1).strategies == (StrategyRule("*", sl.ZeRO1),)
    assert sl.Spec(sl.Mesh(fsdp=4), strategies=[("*", "ZeRO-2")]).strategies[0].strategy is sl.ZeRO2
    assert sl.Spec(sl.Mesh(fsdp=4)).strategies is None


def test_strategies_round_trip_through_dict_and_toml(tmp_path):
    spec = sl.Spec(sl.Mesh(replicate=2, fsdp=-1), units=["blocks.*"],
                   strategies=[("blocks.0", sl.ZeRO1), ("blocks.*", sl.ZeRO2), ("<root>", sl.DDP)])
    d = spec.to_dict()
    assert d["strategies"][0] == {"pattern": "blocks.0", "strategy": "zero1"}
    assert sl.Spec.from_dict(json.loads(json.dumps(d))) == spec
    path = tmp_path / "train.toml"
    path.write_text(spec.to_toml())
    assert "[[shardlang.strategies]]" in path.read_text()
    assert sl.Spec.from_toml(path) == spec


@pytest.mark.parametrize("strategies, message", [
    ([("*", "zero4")], r"strategies\[0\]: strategy is 'zero4'; valid strategies are sl.ZeRO3, sl.ZeRO2"),
    ([("*", 3)], r"strategy is 3; valid strategies"),
    ([("", sl.DDP)], r"strategies\[0\]: pattern is ''"),
    (["blocks.*"], r"strategies\[0\] is 'blocks.\*'; a strategy rule is a \(unit pattern, strategy\) pair"),
    ("zero3", r"strategies is 'zero3'; strategies are a list of \(unit pattern, strategy\) pairs"),
])
def test_bad_strategies_are_named(strategies, message):
    with pytest.raises(sl.SpecError, match=message):
        sl.Spec(sl.Mesh(fsdp=2), strategies=strategies)


def test_bad_strategy_tables_name_where_they_came_from():
    with pytest.raises(sl.SpecError, match=r"train.toml: strategies\[1\]: unknown key 'strategie'; valid keys"):
        sl.Spec.from_dict({"mesh": {"fsdp": 2}, "strategies": [{"pattern": "*", "strategy": "ddp"},
                                                                {"pattern": "*", "strategie": "ddp"}]},
                          source="train.toml")
    with pytest.raises(sl.SpecError, match=r"strategies\[0\]: missing key 'strategy'"):
        sl.Spec.from_dict({"mesh": {"fsdp": 2}, "strategies": [{"pattern": "*"}]})


def _resolve(strategies, units=("blocks.*",), **options):
    spec = sl.Spec(sl.Mesh(fsdp=2), units=units, strategies=strategies, options=sl.Options(**options))
    return spec.resolve(CASES["gpt_tiny"].build(), 2)


def test_each_unit_gets_the_first_matching_strategy_and_the_rest_the_default():
    resolved = _resolve([("blocks.1", sl.ZeRO1), ("blocks.*", sl.DDP)])
    assert resolved.param("blocks.1.attn.qkv.weight").strategy is sl.ZeRO1
    assert resolved.param("blocks.0.attn.qkv.weight").strategy is sl.DDP
    assert resolved.param("tok_emb.weight").strategy is sl.ZeRO3  # <root>: the default
    assert _resolve(None, reshard_after_forward=False).param("tok_emb.weight").strategy is sl.ZeRO2
    assert "ZeRO1" in resolved.describe().splitlines()[0] + resolved.describe() and "strategy" in resolved.describe()


def test_strategy_patterns_that_decide_no_unit_are_errors():
    with pytest.raises(sl.SpecError, match=r"strategies\[0\] = StrategyRule\('block.\*', DDP\) matches no unit; .*"
                                           r"'<root>', 'blocks.0', 'blocks.1'"):
        _resolve([("block.*", sl.DDP)])
    with pytest.raises(sl.SpecError, match=r"strategies\[1\] = StrategyRule\('blocks.0', DDP\) decides no unit: .*"
                                           r"strategies\[0\] = StrategyRule\('\*', ZeRO2\)"):
        _resolve([("*", sl.ZeRO2), ("blocks.0", sl.DDP)])


# ---- bytes: the plan follows each strategy's formula ---------------------------------------------------


def plan(case_name, world_size, strategies, rules=None, mesh=None):
    case = CASES[case_name]
    spec = sl.Spec(mesh=mesh or sl.Mesh(fsdp=world_size), rules=rules, units=case.units, strategies=strategies)
    batch = split_batch(case.make_batch(0, torch.float64), world_size, 0)
    return sl.plan(case.build(torch.float64), case.loss_fn, spec, example_batch=batch, world_size=world_size,
                   check_each_pass=True).schedule


def whole_flat_padded(schedule, n, trainable_only=True):
    """Each sharded flat parameter's members concatenated, padded once to a multiple of N (Note [whole-flat shards])."""
    return sum(math.ceil(f.numel / n) * n * f.element_size for f in schedule.flats
               if f.sharded and (f.trainable or not trainable_only))


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bytes_follow_each_strategys_formula(strategy, world_size):
    n = world_size
    schedule = plan("prime", n, [("*", strategy)])
    model = CASES["prime"].build(torch.float64)
    m, m_trainable = whole_flat_padded(schedule, n, trainable_only=False), whole_flat_padded(schedule, n)
    regathered = sum(schedule.flat(op.flat).padded_bytes for op in schedule.ops
                     if op.kind is OpKind.ALL_GATHER and op.detail == "re-gather for backward")
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    # A world of one reduces nothing: AdamW reads member gradients (Note [updates from member gradients]).
    reduced = int(n > 1)
    expected = {
        "zero3": {"all_gather": m + regathered, "reduce_scatter": m_trainable * reduced, "all_reduce": 0},
        "zero2": {"all_gather": m, "reduce_scatter": m_trainable * reduced, "all_reduce": 0},
        "zero1": {"all_gather": whole_flat_padded(schedule, n),
                  "reduce_scatter": whole_flat_padded(schedule, n) * reduced, "all_reduce": 0},
        "ddp": {"all_gather": 0, "reduce_scatter": 0, "all_reduce": whole * reduced},
    }[strategy]
    assert schedule.summary.bytes_per_rank == expected
    ring = {"all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_reduce": 2 * (n - 1) / n}
    assert schedule.summary.wire_bytes_per_rank == {k: round(v * ring[k]) for k, v in expected.items()}
    assert {f.strategy.value for f in schedule.flats} == {strategy}
    assert formula_bytes(schedule) == expected
    flat = schedule.flats[0]
    held = {"zero3": flat.local_numel, "zero2": flat.local_numel, "zero1": flat.padded_numel, "ddp": flat.numel}
    assert flat.held_numel == held[strategy]  # parameters a rank holds
    state = flat.numel if strategy == "ddp" else flat.padded_numel // n
    assert flat.local_numel == state  # optimizer shard (and each state tensor)


def test_a_mixed_spec_adds_up_flat_by_flat():
    """blocks.0 ZeRO-1, blocks.1 ZeRO-2, the root ZeRO-3, LayerNorms replicated: each flat follows its formula."""
    rules = [("*.ln*.*", sl.replicate()), ("ln_f.*", sl.replicate()), ("*", sl.shard("fsdp"))]
    schedule = plan("gpt_tiny", 4, [("blocks.0", sl.ZeRO1), ("blocks.1", sl.ZeRO2), ("*", sl.ZeRO3)], rules=rules)
    by_flat: dict[str, dict[str, int]] = {}
    for op in schedule.ops:
        if op.kind in (OpKind.ALL_GATHER, OpKind.REDUCE_SCATTER, OpKind.ALL_REDUCE) and op.flat:
            by_flat.setdefault(op.flat, {}).setdefault(op.kind.value, 0)
            by_flat[op.flat][op.kind.value] += op.bytes
    flats = {f.name: f for f in schedule.flats}
    assert {n: f.strategy.value for n, f in flats.items()} == {
        "<root>": "zero3", "<root>#replicated": "ddp", "blocks.0": "zero1", "blocks.0#replicated": "ddp",
        "blocks.1": "zero2", "blocks.1#replicated": "ddp"}
    assert by_flat["blocks.0"] == {"reduce_scatter": flats["blocks.0"].padded_bytes,
                                   "all_gather": flats["blocks.0"].padded_bytes}
    assert by_flat["blocks.1"] == {"all_gather": flats["blocks.1"].padded_bytes,
                                   "reduce_scatter": flats["blocks.1"].padded_bytes}
    assert by_flat["<root>"]["reduce_scatter"] == flats["<root>"].padded_bytes
    assert by_flat["<root>"]["all_gather"] in (flats["<root>"].padded_bytes, 2 * flats["<root>"].padded_bytes)
    for name in ("<root>#replicated", "blocks.0#replicated", "blocks.1#replicated"):
        assert by_flat[name] == {"all_reduce": flats[name].numel * flats[name].element_size}
    assert formula_bytes_by_flat(schedule) == {name: {k: row.get(k, 0) for k in ("all_gather", "reduce_scatter",
                                                                                 "all_reduce")}
                                               for name, row in by_flat.items()}
    assert formula_bytes(schedule) == schedule.summary.bytes_per_rank
    assert "updated shards" in schedule.table()
    summary = schedule.summary_text()
    for strategy in ("zero3", "zero2", "zero1", "ddp"):
        assert strategy in summary


# ---- the verifier knows each strategy --------------------------------------------------------------


def _reindexed(schedule, ops):
    return attrs.evolve(schedule, ops=tuple(attrs.evolve(op, index=i) for i, op in enumerate(ops)))


def test_verifier_catches_a_zero1_parameter_gathered_before_its_update():
    schedule = plan("mlp", 2, sl.ZeRO1)
    gather = next(op for op in schedule.ops if op.kind is OpKind.ALL_GATHER)
    assert gather.detail == "updated shards" and gather.phase.value == "optimizer"
    ops = [op for op in schedule.ops if op is not gather]
    ops.insert(0, gather)
    with pytest.raises(sl.ScheduleError, match=r"zero1 <root> is gathered at op 0, before its update"):
        sl.verify(_reindexed(schedule, ops))
    without = [op for op in schedule.ops if op is not gather and op.handle != gather.handle]
    with pytest.raises(sl.ScheduleError, match=r"zero1 <root> gathers its updated shards 0 times, expected 1"):
        sl.verify(_reindexed(schedule, without))


def test_verifier_catches_a_zero2_unit_gathered_twice_and_a_ddp_unit_gathered_at_all():
    zero3 = plan("gpt_tiny", 2, sl.ZeRO3)
    as_zero2 = attrs.evolve(zero3, flats=tuple(attrs.evolve(f, strategy="zero2") for f in zero3.flats))
    with pytest.raises(sl.ScheduleError, match=r"zero2 blocks.0 is gathered 2 times .* at most 1"):
        sl.verify(as_zero2)
    as_ddp = attrs.evolve(zero3, flats=tuple(attrs.evolve(f, strategy="ddp") for f in zero3.flats))
    with pytest.raises(sl.ScheduleError, match=r"ddp <root> is gathered 1 times .* at most 0"):
        sl.verify(as_ddp)


def test_verifier_catches_a_gradient_reduced_over_the_wrong_ranks():
    ddp = plan("mlp", 4, sl.DDP)
    reduce = next(op for op in ddp.ops if op.kind is OpKind.ALL_REDUCE)
    half = [attrs.evolve(op, group="half", group_size=2) if op is reduce else op for op in ddp.ops]
    mesh = (("half", 2), ("rest", 2))
    with pytest.raises(sl.ScheduleError, match=r"never summed over mesh axes \['rest'\]"):
        sl.verify(attrs.evolve(_reindexed(ddp, half), mesh=mesh))


# ---- parity with one process ---------------------------------------------------------------------


def check_parity(results, reference, world_size, buffers=False):
    ref_losses, ref_params, ref_buffers = reference
    for rank, (losses, params, bufs) in enumerate(results):
        assert parity.max_relative_difference(params, ref_params) < TOLERANCE, f"rank {rank}"
        if buffers:
            for name, ref in ref_buffers.items():
                assert parity.max_relative_difference({name: bufs[name].double()}, {name: ref.double()}) < TOLERANCE
    for k in range(STEPS):
        assert sum(r[0][k] for r in results) / world_size == pytest.approx(ref_losses[k], rel=1e-12)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("strategy", ["zero2", "zero1", "ddp"])  # ZeRO-3, the default: tests/test_parity.py
def test_each_strategy_trains_like_one_process(run_on, references, strategy, optimizer, world_size):
    """prime: every size prime, a 0-d scalar; nothing divides by 2 or 4, so every pad is exercised."""
    spec = {"mesh": {"fsdp": world_size}, "strategies": [{"pattern": "*", "strategy": strategy}]}
    results = run_on(world_size, w.train_with_spec, "prime", optimizer, spec, STEPS)
    check_parity(results, references("prime", optimizer), world_size)


MIXED = {"rules": [{"pattern": "*.ln*.*", "layout": "replicate"}, {"pattern": "ln_f.*", "layout": "replicate"},
                   {"pattern": "*", "layout": "shard", "axis": "fsdp"}],
         "strategies": [{"pattern": "blocks.0", "strategy": "zero1"}, {"pattern": "blocks.1", "strategy": "ddp"},
                        {"pattern": "*", "strategy": "zero3"}]}


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_mixed_spec_trains_like_one_process(run_on, references, optimizer, world_size):
    """GPT: blocks.0 ZeRO-1, blocks.1 DDP, the root (embeddings, tied head) ZeRO-3, LayerNorms replicated."""
    results = run_on(world_size, w.train_with_spec, "gpt_tiny", optimizer, {"mesh": {"fsdp": world_size}, **MIXED},
                     STEPS)
    check_parity(results, references("gpt_tiny", optimizer), world_size)


@pytest.mark.parametrize("case, strategy", [("frozen", "zero1"), ("convnet_bn", "zero1"), ("convnet_bn", "ddp")])
def test_zero1_and_ddp_with_frozen_layers_and_batch_norm(run_on, references, case, strategy):
    spec = {"mesh": {"fsdp": 4}, "strategies": [{"pattern": "*", "strategy": strategy}]}
    results = run_on(4, w.train_with_spec, case, "adamw", spec, STEPS)
    check_parity(results, references(case, "adamw"), 4, buffers=True)


DIM_RULES = [{"pattern": "scale", "layout": "shard", "axis": "fsdp"},
             {"pattern": "*.bias", "layout": "shard", "axis": "fsdp", "dim": -1},
             {"pattern": "*", "layout": "shard", "axis": "fsdp", "dim": 0}]


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_sharding_along_a_dim_trains_like_one_process(run_on, references, optimizer, world_size):
    """shard('fsdp', dim=0) on Embedding(11, 7), Linear(7, 13), LayerNorm(13), Linear(13, 5): every dim 0 padded."""
    results = run_on(world_size, w.train_with_spec, "prime", optimizer,
                     {"mesh": {"fsdp": world_size}, "rules": DIM_RULES}, STEPS)
    check_parity(results, references("prime", optimizer), world_size)


def test_the_collectives_move_the_bytes_the_plan_says(run_on):
    """Counted at the c10d ops while a mixed (ZeRO-3 / ZeRO-1 / DDP) step runs on 4 ranks."""
    results = run_on(4, w.held_bytes_and_traffic, "gpt_tiny", {"mesh": {"fsdp": 4}, **MIXED})
    for counts, schedule in results:
        planned: dict[tuple[str, int], int] = {}
        for op in schedule["ops"]:
            if op["kind"] in ("all_gather", "reduce_scatter", "all_reduce"):
                key = (op["kind"], op["group_size"])
                planned[key] = planned.get(key, 0) + op["bytes"]
        assert counts == planned
        assert set(k for k, _ in counts) == {"all_gather", "reduce_scatter", "all_reduce"}
