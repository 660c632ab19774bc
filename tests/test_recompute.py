"""Activation recompute: the spec field, the pass's invariants, and bitwise parity with the step that keeps.

Parity: the tiny GPT with dropout (p = 0.25 on every block's attention and MLP
outputs) trains 2 AdamW steps in float64 with recompute "none", "full" and
"selective" on its blocks, under ZeRO-3 and ZeRO-2, at N = 1, 2 and 4: losses
and parameters must be bitwise equal to "none"'s, under both random schemes
(a recompute that drew fresh masks would differ at the first step).
"""

from __future__ import annotations

import pytest
import torch

import parity
import recompute_workers as rw
import shardlang as sl
import strategy_workers
from shardlang.step.batch import split_batch
from shardlang.errors import CompileError, ScheduleError, SpecError
from shardlang.compiler.schedule.schedule import OpKind
from shardlang.compiler.schedule.verify import _check_recompute, verify

POLICIES = ["full", "selective"]


def _plan(case_name="gpt_dropout", world=2, recompute=None, **options):
    case = rw.CASES[case_name]
    spec = sl.Spec(sl.Mesh(fsdp=world), units=case.units, recompute=recompute, options=sl.Options(**options))
    batch = split_batch(case.make_batch(0, torch.float64), world, 0)
    return sl.plan(case.build(torch.float64), case.loss_fn, spec, example_batch=batch, world_size=world,
                   check_each_pass=True)


# -- the spec field --------------------------------------------------------------------------------


def test_recompute_field_accepts_pairs_enums_and_one_policy():
    spec = sl.Spec(sl.Mesh(fsdp=2), recompute=[("blocks.*", "FULL"), ("*", sl.Recompute.SELECTIVE)])
    assert spec.recompute == (sl.RecomputeRule("blocks.*", sl.Recompute.FULL), sl.RecomputeRule("*", "selective"))
    assert sl.Spec(sl.Mesh(fsdp=2), recompute=sl.Recompute.FULL).recompute == (sl.RecomputeRule("*", "full"),)
    assert sl.Spec(sl.Mesh(fsdp=2)).recompute is None


def test_recompute_round_trips_through_toml(tmp_path):
    spec = sl.Spec(sl.Mesh(fsdp=2), units=["blocks.*"], recompute=[("blocks.0", "none"), ("blocks.*", "selective")])
    path = tmp_path / "spec.toml"
    path.write_text(spec.to_toml())
    assert "[[shardlang.recompute]]" in path.read_text()
    assert sl.Spec.from_toml(path) == spec


@pytest.mark.parametrize("value, message", [
    ([("blocks.*", "sometimes")], "recompute[0]: recompute policy is 'sometimes'; valid policies are"),
    ("full", "recompute is 'full'; recompute is a list of (unit pattern, policy) pairs"),
    ([("blocks.*",)], "recompute[0] is ('blocks.*',)"),
    ([("", "full")], "recompute[0]: pattern is ''"),
])
def test_bad_recompute_values_are_named(value, message):
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]").replace("*", r"\*")):
        sl.Spec(sl.Mesh(fsdp=2), recompute=value)


def test_bad_recompute_table_is_named():
    with pytest.raises(SpecError, match=r"recompute\[0\]: unknown key 'mode'"):
        sl.Spec.from_dict({"mesh": {"fsdp": 2}, "recompute": [{"pattern": "blocks.*", "mode": "full"}]})
    with pytest.raises(SpecError, match=r"recompute\[0\]: recompute policy is 'everything'"):
        sl.Spec.from_dict({"mesh": {"fsdp": 2}, "recompute": [{"pattern": "blocks.*", "policy": "everything"}]})


def test_pattern_that_matches_no_unit_is_named():
    model = rw.CASES["gpt_dropout"].build()
    spec = sl.Spec(sl.Mesh(fsdp=2), units=["blocks.*"], recompute=[("layers.*", "full")])
    with pytest.raises(SpecError, match=r"recompute\[0\] = RecomputeRule\('layers.\*', 'full'\) matches no unit; .*"
                                        r"'blocks.0'"):
        spec.resolve(model, 2)
    shadowed = sl.Spec(sl.Mesh(fsdp=2), units=["blocks.*"], recompute=[("*", "full"), ("blocks.0", "none")])
    with pytest.raises(SpecError, match=r"recompute\[1\] .* decides no unit"):
        shadowed.resolve(model, 2)


def test_resolved_spec_gives_each_unit_its_policy():
    model = rw.CASES["gpt_dropout"].build()
    spec = sl.Spec(sl.Mesh(fsdp=2), units=["blocks.*"], recompute=[("blocks.1", "selective"), ("blocks.*", "full")])
    resolved = spec.resolve(model, 2)
    assert resolved.recompute == {"": sl.Recompute.NONE, "blocks.0": sl.Recompute.FULL,
                                  "blocks.1": sl.Recompute.SELECTIVE}


# -- the pass and the schedule ---------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("reshard", [True, False])
def test_recompute_adds_no_collective_and_shows_in_the_schedule(policy, reshard):
    kept = _plan(reshard_after_forward=reshard)
    recomputed = _plan(recompute=[("blocks.*", policy)], reshard_after_forward=reshard)
    assert recomputed.schedule.summary.collectives == kept.schedule.summary.collectives
    assert recomputed.schedule.summary.bytes_per_rank == kept.schedule.summary.bytes_per_rank
    ops = [op for op in recomputed.schedule.ops if op.detail == "recompute"]
    assert {op.unit for op in ops} == {"blocks.0", "blocks.1"}
    assert all(op.phase.value == "backward" and op.kind is OpKind.COMPUTE for op in ops)
    assert recomputed.schedule.options["recompute"] == {"blocks.0": policy, "blocks.1": policy}
    assert "recompute, " in recomputed.schedule.table()


def test_recompute_reads_the_backward_regather():
    """ZeRO-3: blocks.0's recompute reads the re-gather for backward, which backward then reads too."""
    compiled = _plan(recompute=[("blocks.*", "full")])
    ops = compiled.schedule.ops
    regather = next(op for op in ops if op.kind is OpKind.ALL_GATHER and op.flat == "blocks.0"
                    and op.detail == "re-gather for backward")
    recompute = next(op for op in ops if op.detail == "recompute" and "blocks.0" in op.uses)
    free = next(op for op in ops if op.kind is OpKind.FREE and op.flat == "blocks.0" and op.index > regather.index)
    assert regather.index < recompute.index < free.index
    assert any(op.detail != "recompute" and op.phase.value == "backward" and "blocks.0" in op.uses
               for op in ops[recompute.index + 1:free.index])


def test_verifier_rejects_a_recompute_that_gathers_for_itself():
    """Free blocks.0 right after its recompute: the backward would need a gather of its own."""
    import attrs

    schedule = _plan(recompute=[("blocks.*", "full")]).schedule
    ops = list(schedule.ops)
    recompute = next(op for op in ops if op.detail == "recompute" and "blocks.0" in op.uses)
    free = next(op for op in ops if op.kind is OpKind.FREE and op.flat == "blocks.0" and op.index > recompute.index)
    moved = [op for op in ops if op is not free]
    moved.insert(recompute.index + 1, free)
    broken = attrs.evolve(schedule, ops=tuple(attrs.evolve(op, index=i) for i, op in enumerate(moved)))
    with pytest.raises(ScheduleError, match="recomputes unit blocks.0 reading blocks.0, but no backward op reads"):
        _check_recompute(broken)
    verify(schedule)  # the schedule as compiled passes


def test_full_recompute_keeps_fewer_activations_than_selective_than_none():
    peaks = {p: _plan(recompute=[("blocks.*", p)] if p != "none" else None).memory for p in ("none", "selective", "full")}
    kept = {p: m.breakdown["activations"] for p, m in peaks.items()}
    assert kept["full"] < kept["selective"] < kept["none"]


def test_unit_that_writes_running_statistics_cannot_be_recomputed():
    with pytest.raises(CompileError, match=r"recompute of unit 'blocks.0': its forward node .* writes .* in place"):
        _plan("convnet_bn", world=1, recompute=[("blocks.0", "full")])


# -- parity ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size, reshard, random", [
    *[(n, reshard, "global") for n in (1, 2, 4) for reshard in (True, False)],
    (2, True, "per_rank"),  # the default scheme: each rank's own masks, replayed as well
], ids=lambda v: {True: "zero3", False: "zero2"}.get(v, str(v)) if isinstance(v, bool) else str(v))
def test_recompute_is_bitwise_the_step_that_keeps(run_on, world_size, reshard, random):
    options = {"reshard_after_forward": reshard, "random": random, "seed": 3}
    runs = [{"options": options}] + [{"options": options, "recompute": [("blocks.*", p)]} for p in POLICIES]
    results = run_on(world_size, rw.train_each, "gpt_dropout", runs)
    for rank, per_run in enumerate(results):
        (losses, params, _), *recomputed = per_run
        for policy, (r_losses, r_params, schedule) in zip(POLICIES, recomputed):
            assert schedule["options"]["recompute"] == {"blocks.0": policy, "blocks.1": policy}
            assert r_losses == losses, (rank, policy)
            for name, value in params.items():
                assert torch.equal(r_params[name], value), (rank, policy, name)
    if random == "global":  # and the masks are one process's: the run matches it
        ref_losses, ref_params = rw.reference_global_dropout("gpt_dropout", seed=3)
        assert parity.max_relative_difference(results[0][1][1], ref_params) < 1e-9


def test_recompute_moves_the_same_collectives_at_run_time(run_on):
    """Counted by a dispatch mode on the c10d functional ops: bytes per kind and group equal with and without."""
    base = {"mesh": {"fsdp": 2}, "units": ["blocks.*"]}
    kept = run_on(2, strategy_workers.held_bytes_and_traffic, "gpt_tiny", base)
    recomputed = run_on(2, strategy_workers.held_bytes_and_traffic, "gpt_tiny",
                        {**base, "recompute": [{"pattern": "blocks.*", "policy": "full"}]})
    for (counts, _), (r_counts, r_schedule) in zip(kept, recomputed):
        assert r_counts == counts
        assert r_schedule["collectives"]["all_gather"] == 4  # root once, blocks.0 twice, blocks.1 once (kept last)


def test_memory_plan_shows_kept_and_recomputed_bytes_per_unit():
    kept = {u.unit: u for u in _plan().memory.units}
    plan = _plan(recompute=[("blocks.0", "full"), ("blocks.1", "selective")]).memory
    units = {u.unit: u for u in plan.units}
    assert [units[u].policy for u in ("", "blocks.0", "blocks.1")] == ["none", "full", "selective"]
    assert units[""].recomputed == 0 and kept["blocks.0"].recomputed == 0
    assert units["blocks.0"].kept < units["blocks.1"].kept < kept["blocks.1"].kept
    assert units["blocks.0"].recomputed > units["blocks.1"].recomputed > 0
    assert units[""].kept == kept[""].kept  # the root keeps what it kept
    text = plan.summary_text()
    assert "activations per unit" in text and "blocks.0    full" in text
    assert plan.to_dict()["units"][1] == units["blocks.0"].to_dict()


# -- the memory budget -------------------------------------------------------------------------------


def test_memory_budget_chooses_recompute_per_unit_when_activations_do_not_fit():
    kept, full = _plan(recompute=None), _plan(recompute=[("blocks.*", "full")])
    budget = (kept.memory.peak + full.memory.peak) // 2
    chosen = _plan(memory_budget=budget)
    choice = chosen.budget
    assert chosen.memory.peak <= budget < kept.memory.peak
    assert chosen.schedule.options.get("recompute")  # it had to recompute something
    assert choice.chosen.peak == chosen.memory.peak and choice.runner_up is not None
    fitting = [c for c in choice.tried if c.peak <= budget]
    assert choice.chosen.step_time_s == min(c.step_time_s for c in fitting)
    text = choice.summary_text()
    assert "memory budget" in text and "runner-up" in text and "predicted step" in text


def test_memory_budget_that_nothing_fits_says_by_how_much_and_what_would():
    full = _plan(recompute=[("blocks.*", "full")], prefetch=0)
    budget = full.memory.peak - 16 * 1024
    with pytest.raises(sl.SpecError, match=r"no configuration fits\. The leanest, recompute full on blocks.0, "
                                           r"blocks.1, prefetch \d, has a planned peak of .* over\nwhat would fit: about \d+ ranks"):
        _plan(memory_budget=budget)


# -- the command line --------------------------------------------------------------------------------


def test_plan_command_recomputes_and_reports_the_budget_choice(capsys):
    from shardlang.cli import main

    gpt = "examples/gpt.py"
    assert main(["plan", gpt, "--world", "2", "--recompute", "blocks.*=full"]) == 0
    out = capsys.readouterr().out
    assert "recompute={'blocks.0': 'full', 'blocks.1': 'full'}" in out and "recompute, " in out
    assert "activations per unit" in out
    assert main(["plan", gpt, "--world", "2", "--memory-budget", "64KiB"]) == 2
    err = capsys.readouterr().err
    assert "Options.memory_budget=64.00 KiB per rank: no configuration fits" in err and "what would fit" in err
    with pytest.raises(SystemExit) as exit_info:  # a bad argument: argparse's one-line error, exit 2
        main(["plan", gpt, "--world", "2", "--recompute", "blocks.*=sometimes"])
    assert exit_info.value.code == 2
    assert "recompute policy is 'sometimes'" in capsys.readouterr().err
