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
from shardlang.compiler.schedule.schedule import OpKind

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
        assert schedule["grad_norms"] == pytest.approx(norms, rel=1e-12)  # what clip_grad_norm_ returned
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

# No weight decay for biases and the LayerNorm, and the LayerNorm with its own lr (prime's norm is replicated).
GROUPS = [("*.bias", {"weight_decay": 0.0}), ("norm.*", {"weight_decay": 0.0, "lr": 3e-3})]


@pytest.mark.parametrize("world_size", WORLDS)
def test_param_groups_match_torch_optim(run_on, world_size):
    results = run_on(world_size, w.train, "prime", "adamw", STEPS, None, GROUPS, PRIME_RULES)
    _, ref_params, _, _, ref_lrs = w.reference("prime", "adamw", STEPS, None, GROUPS)
    for rank, (_losses, params, _b, schedule, lrs) in enumerate(results):
        assert parity.max_relative_difference(params, ref_params) < TOLERANCE, f"rank {rank}"
        assert list(lrs[0].values()) == ref_lrs[0] == [1e-2, 1e-2, 3e-3]
    flats = {f["name"]: list(f["members"]) for f in results[0][3]["flats"]}
    # A group boundary splits a flat parameter: the root's biases leave it for <root>#group1.
    assert flats["<root>#group1"] == ["fc1.bias", "fc2.bias"]
    assert flats["<root>#replicated#group2"] == ["norm.weight"]
    assert "norm.bias" in flats["<root>#replicated#group1"]


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


@pytest.mark.parametrize("schedule, world_size", [("warmup_cosine", 1), ("cosine", 2), ("warmup_cosine", 4)])
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
    # Frozen: never reduced, never updated; a world of one reduces nothing (Note [updates from member gradients]).
    assert sorted(reduced) == (sorted(trainable) if world_size > 1 else []) and updated == trainable


def test_frozen_parameters_get_no_optimizer_state():
    case = w.CASES["lora"]
    model = case.build()
    step = sl.compile(model, case.loss_fn, sl.Spec(sl.Mesh(fsdp=1)), optimizer=sl.AdamW(lr=1e-2),
                      example_batch=case.make_batch(0))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable == 2 * (2 * 16 + 16 * 2)  # two rank-2 adapters: 128 of 708 parameters
    assert sum(s.numel() for s in step.optimizer_state) == 2 * trainable  # AdamW: exp_avg and exp_avg_sq


# -- gradient accumulation -----------------------------------------------------------------------

ACCUMULATIONS = ["per_microbatch", "keep"]


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("accumulation", ACCUMULATIONS)
def test_accumulation_equals_one_big_batch(run_on, world_size, accumulation):
    """k=2 micro-batches of b rows per rank, one optimizer step: one process on the whole batch of 2·b·N rows."""
    options = {"microbatches": 2, "accumulation": accumulation}
    # prime: an embedding, a replicated-size LayerNorm, a 0-d scale; gpt_tiny (attention, a tied head) is in
    # test_training_features_compose_with_strategies_on_a_hybrid_mesh.
    results = run_on(world_size, w.train, "prime", "adamw", STEPS, options)
    ref_losses, ref_params, _, _, _ = w.reference("prime", "adamw", STEPS)
    for rank, (_losses, params, _b, _s, _lrs) in enumerate(results):
        assert parity.max_relative_difference(params, ref_params) < TOLERANCE, f"rank {rank}"
    for k in range(STEPS):  # each rank's loss is the mean over its micro-batches
        assert sum(r[0][k] for r in results) / world_size == pytest.approx(ref_losses[k], rel=1e-12)


@pytest.mark.parametrize("accumulation", ACCUMULATIONS)
def test_accumulation_with_clipping_and_groups(run_on, accumulation):
    options = {"microbatches": 2, "accumulation": accumulation, "clip_grad_norm": 0.5}
    groups = [("*.bias", {"weight_decay": 0.0})]
    results = run_on(2, w.train, "prime", "adamw", STEPS, options, groups, PRIME_RULES)
    _, ref_params, _, _, _ = w.reference("prime", "adamw", STEPS, options, groups)
    assert parity.max_relative_difference(results[0][1], ref_params) < TOLERANCE


def _plan(case_name: str, world: int, **options):
    case = w.CASES[case_name]
    spec = sl.Spec(sl.Mesh(fsdp=world), units=case.units, options=sl.Options(**options))
    per_rank = sl.split_batch(case.make_batch(0), world, 0)
    return sl.plan(case.builder, case.loss_fn, spec, optimizer=sl.AdamW(lr=1e-3), example_batch=per_rank,
                   world_size=world, check_each_pass=True).schedule


@pytest.mark.parametrize("world", [2, 4])
def test_accumulation_collectives_and_bytes(world):
    """per_microbatch: k times one micro-batch step's collectives; keep: one step's collectives, whatever k."""
    k = 2
    one = _plan("lora", world).summary
    each = _plan("lora", world, microbatches=k)
    keep = _plan("lora", world, microbatches=k, accumulation="keep")
    for kind in ("all_gather", "reduce_scatter"):
        assert each.summary.collectives[kind] == k * one.collectives[kind]
        assert each.summary.bytes_per_rank[kind] == k * one.bytes_per_rank[kind]
    # keep: each sharded flat gathered once (kept across micro-batches) and reduced once: M each.
    sharded = sum(f.padded_bytes for f in keep.flats if f.sharded)
    assert keep.summary.bytes_per_rank["all_gather"] == sharded
    assert keep.summary.bytes_per_rank["reduce_scatter"] == sum(f.padded_bytes for f in keep.flats
                                                                if f.sharded and f.trainable)
    assert keep.options["microbatches"] == k and keep.options["accumulation"] == "keep"
    reduced = [(op.flat, op.microbatch) for op in each.ops if op.kind is OpKind.REDUCE_SCATTER]
    assert sorted(reduced) == [(f, m) for f in ("layers.0", "layers.1") for m in (0, 1)]  # frozen: never


@pytest.mark.parametrize(
    "options, error, named",
    [
        ({"microbatches": 0}, sl.SpecError, ["Options.microbatches is 0", ">= 1"]),
        ({"microbatches": 2.0}, sl.SpecError, ["Options.microbatches is 2.0"]),
        ({"accumulation": "sometimes"}, sl.SpecError, ["Options.accumulation is 'sometimes'", "'keep'"]),
        ({"microbatches": 3}, sl.TraceError, ["batch leaf 0 has 4 rows per rank", "microbatches=3"]),
    ],
)
def test_bad_accumulation_is_named(options, error, named):
    with pytest.raises(error) as info:
        _plan("mlp", 2, **options)
    for part in named:
        assert part in str(info.value)


# -- dropout and random numbers ------------------------------------------------------------------


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("scheme", ["global", "per_rank"])
def test_dropout_masks_are_the_documented_ones(run_on, world_size, scheme):
    """global: the masks one process seeded with `seed` draws for the whole batch; per_rank: rank r's rows
    drawn from a generator seeded per_rank_seed(seed, r). Either way the result is exact, not statistical."""
    options = {"random": scheme, "seed": 7}
    results = run_on(world_size, w.train, "mlp_dropout", "adamw", STEPS, options)
    _, ref_params, _, _, _ = w.reference("mlp_dropout", "adamw", STEPS, options, world_size=world_size)
    for rank, (_losses, params, _b, _s, _lrs) in enumerate(results):
        assert parity.max_relative_difference(params, ref_params) < TOLERANCE, f"rank {rank}"


def test_per_rank_masks_differ_between_ranks_and_from_global(run_on):
    per_rank = run_on(2, w.train, "mlp_dropout", "adamw", 1, {"random": "per_rank", "seed": 7})
    global_ = run_on(2, w.train, "mlp_dropout", "adamw", 1, {"random": "global", "seed": 7})
    assert parity.max_relative_difference(per_rank[0][1], global_[0][1]) > 1e-3
    # Without dropout the scheme does not matter: p=0 equals one process exactly.
    plain = run_on(2, w.train, "mlp_dropout0", "adamw", STEPS, {"random": "per_rank"})
    _, ref_params, _, _, _ = w.reference("mlp_dropout0", "adamw", STEPS)
    assert parity.max_relative_difference(plain[0][1], ref_params) < TOLERANCE


def test_step_draws_from_its_own_generator():
    """The step's masks depend on Options.seed only, and the caller's generator is left where it was."""
    case = w.CASES["mlp_dropout"]

    def first_loss(seed: int, caller_seed: int) -> float:
        torch.manual_seed(caller_seed)
        step = sl.compile(case.build(torch.float64), case.loss_fn,
                          sl.Spec(sl.Mesh(fsdp=1), options=sl.Options(seed=seed)), optimizer=sl.SGD(lr=0.1),
                          example_batch=case.make_batch(0, torch.float64))
        before = torch.get_rng_state()
        loss = float(step(case.make_batch(0, torch.float64)))
        assert torch.equal(torch.get_rng_state(), before)
        return loss

    assert first_loss(1, caller_seed=0) == first_loss(1, caller_seed=123)
    assert first_loss(1, caller_seed=0) != first_loss(2, caller_seed=0)


def test_global_random_refuses_other_random_ops():
    case = w.CASES["mlp_noise"]
    spec = sl.Spec(sl.Mesh(fsdp=2), options=sl.Options(random="global"))
    with pytest.raises(sl.TraceError, match=r"(?s)random='global'.*randn.*random='per_rank'"):
        sl.plan(case.builder, case.loss_fn, spec, example_batch=sl.split_batch(case.make_batch(0), 2, 0),
                world_size=2)
    with pytest.raises(sl.SpecError, match=r"Options.random is 'rank'.*'per_rank', 'global'"):
        sl.Options(random="rank")


# -- BatchNorm -----------------------------------------------------------------------------------


def test_batchnorm_statistics_stay_replicated_with_the_training_features(run_on):
    """BatchNorm's running statistics (replicated buffers, synchronised batch statistics) equal one process's
    with clipping and a no-decay group for the norms on (test_parity covers N=1,2,4 without them)."""
    options = {"clip_grad_norm": 1.0}
    groups = [("*.bn.*", {"weight_decay": 0.0})]
    results = run_on(4, w.train, "convnet_bn", "adamw", STEPS, options, groups)
    _, ref_params, ref_buffers, _, _ = w.reference("convnet_bn", "adamw", STEPS, options, groups)
    for rank, (_losses, params, buffers, _s, _lrs) in enumerate(results):
        assert parity.max_relative_difference(params, ref_params) < TOLERANCE, f"rank {rank}"
        for name, ref in ref_buffers.items():
            assert parity.max_relative_difference({name: buffers[name].double()}, {name: ref.double()}) < TOLERANCE


def test_memory_plan_shows_the_frozen_saving():
    """Frozen parameters hold no optimizer state: the plan's persistent bytes drop by exactly their state."""
    case = w.CASES["lora"]

    def plan(build):
        spec = sl.Spec(sl.Mesh(fsdp=2))
        return sl.plan(build, case.loss_fn, spec, optimizer=sl.AdamW(lr=1e-3),
                       example_batch=sl.split_batch(case.make_batch(0), 2, 0), world_size=2)

    lora = plan(case.builder)
    full = plan(lambda: case.builder().requires_grad_(True))
    frozen_local = sum(f.local_numel * f.element_size for f in lora.schedule.flats if not f.trainable)
    trainable_local = sum(f.local_numel * f.element_size for f in lora.schedule.flats if f.trainable)
    scalars = 8 * 2  # the step count and the lr, float64
    assert lora.memory.breakdown["optimizer_state"] == 2 * trainable_local + scalars  # AdamW: two states
    assert full.memory.persistent - lora.memory.persistent == 2 * frozen_local
    assert lora.memory.peak < full.memory.peak


# -- job files: shardlang check uses the same features in its reference ---------------------------

JOB = '''
import torch
import shardlang as sl

def build_model():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 2))

def loss_fn(model, batch):
    return (model(batch[0]) - batch[1]).pow(2).mean()

def make_batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 2, generator=g)

spec = sl.Spec(mesh=sl.Mesh(fsdp=-1), param_groups=[sl.ParamGroup("*.bias", weight_decay=0.0)],
               options=sl.Options(clip_grad_norm=0.1, microbatches=2, random="global", seed=5))
optimizer = sl.AdamW(lr=1e-2, weight_decay=0.1)
lr_schedule = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5 ** k)
'''


def test_shardlang_check_reference_uses_groups_clipping_schedule_and_seed(tmp_path, capsys):
    from shardlang.cli import main

    path = tmp_path / "job.py"
    path.write_text(JOB.replace("microbatches=2, ", ""))  # accumulation equals one process only without dropout
    assert main(["check", str(path), "--world-sizes", "1", "--steps", "3", "--dtype", "float64"]) == 0
    assert "PASS" in capsys.readouterr().out
    path.write_text(JOB.replace('random="global", seed=5', "seed=5").replace("torch.nn.Dropout(0.2), ", ""))
    assert main(["check", str(path), "--world-sizes", "1", "--steps", "3", "--dtype", "float64"]) == 0
    bad = tmp_path / "bad.py"
    bad.write_text(JOB.replace("lr_schedule = lambda opt:", "lr_schedule = 3 # "))
    with pytest.raises(sl.SpecError, match="lr_schedule is 3, not a function"):
        from shardlang.cli.job import load_job

        load_job(bad)


# -- with the strategies and hybrid meshes -------------------------------------------------------


@pytest.mark.parametrize("accumulation", ACCUMULATIONS)
def test_training_features_compose_with_strategies_on_a_hybrid_mesh(run_on, accumulation):
    """replicate=2 x fsdp=2, ZeRO-3 root, ZeRO-1 and DDP blocks, replicated LayerNorms; clipping (each value
    counted once across shards and replicas), a no-decay group and 2 micro-batches: still one process's result."""
    import strategy_workers

    spec = {"mesh": {"replicate": 2, "fsdp": 2},
            "rules": [{"pattern": "*ln*", "layout": "replicate"}, {"pattern": "*", "layout": "shard", "axis": "fsdp"}],
            "strategies": [{"pattern": "blocks.0", "strategy": "zero1"}, {"pattern": "blocks.1", "strategy": "ddp"}],
            "options": {"clip_grad_norm": 0.5, "microbatches": 2, "accumulation": accumulation},
            "param_groups": [{"pattern": "*.bias", "weight_decay": 0.0}]}
    results = run_on(4, strategy_workers.train_with_spec, "gpt_tiny", "adamw", spec)
    _, ref_params, _, _, _ = w.reference("gpt_tiny", "adamw", STEPS, {"clip_grad_norm": 0.5},
                                         [("*.bias", {"weight_decay": 0.0})])
    for rank, (_losses, params, _buffers) in enumerate(results):
        assert parity.max_relative_difference(params, ref_params) < TOLERANCE, f"rank {rank}"
