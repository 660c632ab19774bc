"""Training features against one process with torch: clipping, parameter groups, lr schedules, frozen
models, dropout, BatchNorm, gradient accumulation (docs/training.md).

Every parity test trains K=3 steps in float64 at world sizes 1, 2 and 4 and
compares every parameter with one process running torch.optim (and
``clip_grad_norm_``, param groups, an ``lr_scheduler``) on the global batch,
within 1e-9 relative (measured: about 1e-15).
"""

from __future__ import annotations

import pytest
import torch

import parity
import shardlang as sl
import training_workers as w
from shardlang.compiler.schedule import OpKind

STEPS = 3
TOLERANCE = 1e-9
WORLDS = [1, 2, 4]
# prime's LayerNorm replicated: the norm must count a replicated gradient once, not N times.
PRIME_RULES = [("norm.*", sl.replicate()), ("*", sl.shard("fsdp"))]


def _ops(schedule: dict, kind: str, detail: str | None = None) -> list[dict]:
    return [op for op in schedule["ops"] if op["kind"] == kind and (detail is None or op["detail"] == detail)]


# -- gradient clipping ---------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", WORLDS)
def test_clipping_matches_clip_grad_norm(run_on, world_size):
    options = {"clip_grad_norm": 0.5}  # the unclipped norms are 0.54, 0.66, 0.66: every step clips
    results = run_on(world_size, w.train, "prime", "adamw", STEPS, options, None, PRIME_RULES)
    _, ref_params, _, norms, _ = w.reference("prime", "adamw", STEPS, options)
    assert all(n > 0.5 for n in norms)
    for rank, (_losses, params, _b, schedule, _lrs) in enumerate(results):
        assert parity.max_relative_difference(params, ref_params) < TOLERANCE, f"rank {rank}"
        norm_ops = _ops(schedule, "all_reduce", "gradient norm")
        assert len(norm_ops) == 1 and norm_ops[0]["bytes"] == 8  # one float64 per step
        assert norm_ops[0]["flat"] is None and norm_ops[0]["phase"] == "optimizer"
        first_update = min(op["index"] for op in schedule["ops"] if op["kind"] == "optimizer")
        assert norm_ops[0]["index"] < first_update  # every update reads a clipped gradient


def test_clipping_changes_the_result(run_on):
    """The same run without clipping ends elsewhere: the test above is not vacuous."""
    unclipped = run_on(2, w.train, "prime", "adamw", STEPS, None, None, PRIME_RULES)
    _, ref_params, _, _, _ = w.reference("prime", "adamw", STEPS, {"clip_grad_norm": 0.5})
    assert parity.max_relative_difference(unclipped[0][1], ref_params) > 1e-3


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), "1.0", True])
def test_bad_max_norm_is_named(bad):
    with pytest.raises(sl.SpecError, match=rf"Options.clip_grad_norm is {bad!r}.*> 0"):
        sl.Options(clip_grad_norm=bad)


# -- parameter groups ----------------------------------------------------------------------------

GPT_GROUPS = [("*.bias", {"weight_decay": 0.0}), ("*ln*", {"weight_decay": 0.0, "lr": 3e-3})]


@pytest.mark.parametrize("world_size", WORLDS)
def test_param_groups_match_torch_optim(run_on, world_size):
    results = run_on(world_size, w.train, "gpt_tiny", "adamw", STEPS, None, GPT_GROUPS)
    _, ref_params, _, _, ref_lrs = w.reference("gpt_tiny", "adamw", STEPS, None, GPT_GROUPS)
    for rank, (_losses, params, _b, schedule, lrs) in enumerate(results):
        assert parity.max_relative_difference(params, ref_params) < TOLERANCE, f"rank {rank}"
        assert list(lrs[0].values()) == ref_lrs[0] == [1e-2, 1e-2, 3e-3]
    names = [f["name"] for f in results[0][3]["flats"]]
    assert "blocks.0#group1" in names and "blocks.0#group2" in names  # a group boundary splits a flat


def test_sgd_groups_with_and_without_momentum(run_on):
    """A group may change the optimizer's state: momentum in one group, none in another (torch allows it)."""
    groups = [("fc3.*", {"momentum": 0.0, "lr": 0.1})]
    results = run_on(2, w.train, "mlp", "sgd", STEPS, None, groups)
    _, ref_params, _, _, _ = w.reference("mlp", "sgd", STEPS, None, groups)
    assert parity.max_relative_difference(results[0][1], ref_params) < TOLERANCE


@pytest.mark.parametrize(
    "groups, named",
    [
        ([("nothing.*", {"lr": 0.1})], ["param_groups[0]", "'nothing.*'", "matches no trainable parameter"]),
        ([("*", {"lr": 0.1}), ("fc1.*", {"lr": 0.2})], ["param_groups[1]", "decides no parameter", "earlier"]),
        ([("*.bias", {"betas": (0.9, 0.9)})], ["param_groups[0]", "['betas']", "SGD does not have"]),
        ([("*.bias", {"lr": -1.0})], ["ParamGroup.lr is -1.0"]),
        ([("*.bias", {"lr_scale": 2.0})], ["unknown key 'lr_scale'", "valid keys"]),
    ],
)
def test_bad_param_groups_are_named(groups, named):
    case = w.CASES["mlp"]
    with pytest.raises(sl.SpecError) as info:
        spec = sl.Spec(sl.Mesh(fsdp=1), param_groups=groups)
        sl.plan(case.build(), case.loss_fn, spec, optimizer=sl.SGD(lr=0.1), example_batch=case.make_batch(0),
                world_size=1)
    for part in named:
        assert part in str(info.value)


def test_group_matching_only_frozen_parameters_is_an_error():
    case = w.CASES["frozen"]
    spec = sl.Spec(sl.Mesh(fsdp=1), param_groups=[("base.*", {"lr": 0.1})])
    with pytest.raises(sl.SpecError, match=r"param_groups\[0\].*only frozen parameters \('base.weight'"):
        sl.plan(case.build(), case.loss_fn, spec, example_batch=case.make_batch(0), world_size=1)


def test_param_groups_round_trip_through_toml(tmp_path):
    spec = sl.Spec(sl.Mesh(fsdp=2), param_groups=[sl.ParamGroup("*.bias", weight_decay=0.0, betas=(0.9, 0.95))],
                   options=sl.Options(clip_grad_norm=1.0, microbatches=2, accumulation="keep"))
    path = tmp_path / "train.toml"
    path.write_text(spec.to_toml())
    assert sl.Spec.from_toml(path) == spec
    assert "[[shardlang.param_groups]]" in path.read_text()


# -- learning-rate schedules ---------------------------------------------------------------------


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("schedule", ["cosine", "warmup_cosine"])
def test_lr_schedule_matches_torch_scheduler(run_on, world_size, schedule):
    groups = [("fc3.*", {"lr": 0.2})]
    results = run_on(world_size, w.train, "mlp", "sgd_nesterov", STEPS, None, groups, None, schedule)
    _, ref_params, _, _, ref_lrs = w.reference("mlp", "sgd_nesterov", STEPS, None, groups, schedule)
    for rank, (_losses, params, _b, _s, lrs) in enumerate(results):
        assert [list(step.values()) for step in lrs] == ref_lrs  # the very same floats, every step and group
        assert parity.max_relative_difference(params, ref_params) < TOLERANCE, f"rank {rank}"
    assert len({tuple(step) for step in ref_lrs}) == STEPS  # the lr did change every step


def test_lr_schedule_with_adamw_and_clipping_together(run_on):
    options = {"clip_grad_norm": 0.5}
    results = run_on(4, w.train, "prime", "adamw", STEPS, options, [("*.bias", {"weight_decay": 0.0})],
                     PRIME_RULES, "lambda")
    _, ref_params, _, _, _ = w.reference("prime", "adamw", STEPS, options, [("*.bias", {"weight_decay": 0.0})],
                                         "lambda")
    assert parity.max_relative_difference(results[0][1], ref_params) < TOLERANCE


def test_set_lr_per_group_and_bad_schedules():
    case = w.CASES["mlp"]
    spec = sl.Spec(sl.Mesh(fsdp=1), param_groups=[("fc3.*", {"lr": 0.2})])
    step = sl.compile(case.build(), case.loss_fn, spec, optimizer=sl.SGD(lr=0.1), example_batch=case.make_batch(0))
    assert step.lrs == {"lr": 0.1, "lr/group1": 0.2}
    step.set_lr(0.05, group=1)
    assert step.lrs == {"lr": 0.1, "lr/group1": 0.05}
    step.set_lr(0.01)
    assert step.lrs == {"lr": 0.01, "lr/group1": 0.01}
    with pytest.raises(sl.ShardlangRuntimeError, match=r"set_lr\(group=2\).*2 parameter groups"):
        step.set_lr(0.1, group=2)
    with pytest.raises(sl.SpecError, match="lr_schedule returned 0.5"):
        sl.compile(case.build(), case.loss_fn, spec, optimizer=sl.SGD(lr=0.1), example_batch=case.make_batch(0),
                   lr_schedule=lambda opt: 0.5)
    with pytest.raises(sl.SpecError, match="lr_schedule is 0.5"):
        sl.compile(case.build(), case.loss_fn, spec, optimizer=sl.SGD(lr=0.1), example_batch=case.make_batch(0),
                   lr_schedule=0.5)


# -- frozen and partly frozen models (LoRA) ------------------------------------------------------


@pytest.mark.parametrize("world_size", WORLDS)
def test_lora_adapters_on_a_frozen_base_match_torch(run_on, world_size):
    results = run_on(world_size, w.train, "lora", "adamw", STEPS)
    _, ref_params, _, _, _ = w.reference("lora", "adamw", STEPS)
    schedule = results[0][3]
    for rank, (_losses, params, _b, _s, _lrs) in enumerate(results):
        assert parity.max_relative_difference(params, ref_params) < TOLERANCE, f"rank {rank}"
    frozen = {f["name"] for f in schedule["flats"] if not f["trainable"]}
    trainable = {f["name"] for f in schedule["flats"] if f["trainable"]}
    assert frozen == {"layers.0#frozen", "layers.1#frozen", "<root>#frozen"}
    assert trainable == {"layers.0", "layers.1"}
    reduced = [op["flat"] for op in schedule["ops"] if op["kind"] in ("reduce_scatter", "all_reduce")]
    updated = {op["flat"] for op in schedule["ops"] if op["kind"] == "optimizer"}
    assert sorted(reduced) == sorted(trainable) and updated == trainable  # frozen: never reduced, never updated


def test_frozen_parameters_get_no_optimizer_state():
    case = w.CASES["lora"]
    model = case.build()
    step = sl.compile(model, case.loss_fn, sl.Spec(sl.Mesh(fsdp=1)), optimizer=sl.AdamW(lr=1e-2),
                      example_batch=case.make_batch(0))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable == 2 * (2 * 16 + 16 * 2)  # two rank-2 adapters: 128 of 708 parameters
    assert sum(s.numel() for s in step.optimizer_state) == 2 * trainable  # AdamW: exp_avg and exp_avg_sq
