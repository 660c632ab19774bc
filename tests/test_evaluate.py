"""Sharded evaluation (`Step.evaluate`): equal to one process's ``model.eval()`` under ``torch.no_grad`` at
1, 2 and 4 ranks, forward only, on the training step's own state; and its schedule, alone and in plans."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import pytest
import torch

import evaluate_workers as w
import shardlang as sl
from models import CASES
from shardlang.step.batch import split_batch
from shardlang.cli import main
from shardlang.cli.job import build, load_job
from shardlang.compiler.schedule.schedule import OpKind, Schedule
from shardlang.compiler.schedule.verify import verify

STEPS = 3
TOLERANCE = 1e-9  # float64: rounding only


def _check_against_reference(results, case, optimizer, world_size, steps=STEPS):
    ref_loss, ref_out, ref_losses, _ = w.reference(case, optimizer, "float64", steps)
    # Every case's loss is a mean over rows, so the ranks' mean is the global batch's
    # (eval-mode BatchNorm couples no rows).
    assert sum(r[0] for r in results) / world_size == pytest.approx(ref_loss, rel=TOLERANCE)
    torch.testing.assert_close(torch.cat([r[1] for r in results]), ref_out, rtol=TOLERANCE, atol=1e-12)
    for rank, (_loss, _out, schedule, checks, losses) in enumerate(results):
        assert checks["same_tensors"] and checks["state_unchanged"] and checks["cached"], rank
        assert all(checks["training"]), "evaluation leaves the module in training mode"
    # Training goes on from the same state after evaluating.
    if results[0][4]:
        assert sum(r[4][-1] for r in results) / world_size == pytest.approx(ref_losses[-1], rel=1e-9)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("case", ["gpt_tiny", "convnet_bn", "llama_tiny"])
def test_evaluation_matches_one_process_in_eval_mode(run_on, case, world_size):
    results = run_on(world_size, w.train_then_evaluate, case, "adamw", "float64", STEPS)
    _check_against_reference(results, case, "adamw", world_size)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_evaluation_turns_dropout_off(run_on, world_size):
    """Untrained (training draws other masks than torch's), so only evaluation's dropout is in question."""
    results = run_on(world_size, w.train_then_evaluate, "mlp_dropout", "sgd", "float64", 0, None, False)
    _check_against_reference(results, "mlp_dropout", "sgd", world_size, steps=0)
    ref_loss, _, _, train_mode_loss = w.reference("mlp_dropout", "sgd", "float64", 0)
    assert abs(train_mode_loss - ref_loss) > 1e-3  # dropout on would have given another loss


@pytest.mark.parametrize("world_size", [2, 4])
def test_evaluation_under_every_strategy(run_on, world_size):
    strategies = [("blocks.0", "zero2"), ("blocks.1", "zero1"), ("*", "ddp")]
    results = run_on(world_size, w.train_then_evaluate, "gpt_tiny", "sgd", "float64", STEPS, strategies)
    _check_against_reference(results, "gpt_tiny", "sgd", world_size)
    schedule = results[0][2]
    gathered = {op["flat"] for op in schedule["ops"] if op["kind"] == "all_gather"}
    by_unit = {f["unit"]: f for f in schedule["flats"]}
    assert gathered == {by_unit["blocks.0"]["name"]}  # ZERO1 and DDP units are whole on every rank


@pytest.mark.parametrize("world_size", [2, 4])
def test_evaluation_schedule_is_forward_only(world_size):
    case = CASES["gpt_tiny"]
    model = case.build(torch.float64)
    batch = split_batch(case.make_batch(0, torch.float64), world_size, 0)
    spec = sl.Spec(mesh=sl.Mesh(fsdp=world_size), units=case.units)
    evaluation = sl.plan(model, case.loss_fn, spec, example_batch=batch, world_size=world_size, evaluate=True)
    training = sl.plan(model, case.loss_fn, spec, example_batch=batch, world_size=world_size)
    schedule = evaluation.schedule
    assert schedule.is_evaluation and not training.schedule.is_evaluation
    assert {op.phase.value for op in schedule.ops} == {"forward"}
    kinds = [op.kind for op in schedule.ops]
    assert OpKind.REDUCE_SCATTER not in kinds and OpKind.ALL_REDUCE not in kinds and OpKind.OPTIMIZER not in kinds
    gathers = [op.flat for op in schedule.ops if op.kind is OpKind.ALL_GATHER]
    frees = [op.flat for op in schedule.ops if op.kind is OpKind.FREE]
    assert sorted(gathers) == sorted(frees) == sorted(f.name for f in evaluation.flats)
    # The same flat parameters as training's, and the forward's bytes: each unit once.
    assert [f.name for f in evaluation.flats] == [f.name for f in training.flats]
    assert schedule.summary.bytes_per_rank["all_gather"] == sum(f.padded_bytes for f in schedule.flats)
    # Only the state's parameters and buffers, then the batch: no optimizer state, step or lr.
    assert {i.role.value for i in evaluation.context.inputs} == {"flat", "batch"}
    # Its memory peak is below training's: no gradients, no activations kept for backward.
    assert evaluation.memory.peak < training.memory.peak


def test_verify_rejects_training_ops_in_an_evaluation_schedule():
    case = CASES["mlp"]
    model = case.build(torch.float64)
    spec = sl.Spec(mesh=sl.Mesh(fsdp=2))
    batch = split_batch(case.make_batch(0, torch.float64), 2, 0)
    training = sl.plan(model, case.loss_fn, spec, example_batch=batch, world_size=2).schedule
    marked = Schedule(training.world_size, training.mesh, training.flats, training.ops,
                      {**training.options, "evaluate": True})
    with pytest.raises(sl.ScheduleError, match="evaluation is forward only"):
        verify(marked)


def test_evaluating_a_non_tensor_is_a_clear_error():
    case = CASES["mlp"]
    model = case.build(torch.float64)
    batch = case.make_batch(0, torch.float64)
    step = sl.compile(model, case.loss_fn, sl.Spec(mesh=sl.Mesh(fsdp=1)), example_batch=batch)
    with pytest.raises(sl.TraceError, match="must return a tensor or a tuple/list/dict of tensors; it returned float"):
        step.evaluate(batch, fn=lambda m, b: 1.0)


# ---- the command line ------------------------------------------------------------

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
LLAMA = str(EXAMPLES / "llama.py")


def test_plan_eval_shows_the_evaluation_schedule(capsys):
    assert main(["plan", LLAMA, "--world", "4", "--eval"]) == 0
    out = capsys.readouterr().out
    assert "world 4, evaluation (forward only)" in out
    assert "evaluation schedule (forward only): world 4" in out
    assert "= none: evaluation has no gradients" in out
    assert main(["plan", LLAMA, "--world", "4", "--eval", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["options"]["evaluate"] is True and plan["collectives"]["reduce_scatter"] == 0
    assert {op["phase"] for op in plan["ops"]} == {"forward"}


def test_run_eval_every_prints_the_validation_loss(capsys, monkeypatch):
    monkeypatch.delenv("LLAMA_SIZE", raising=False)
    assert main(["run", LLAMA, "--steps", "2", "--eval-every", "1"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "val loss" in line]
    assert [line.split()[:4] for line in lines] == [["step", "1", "val", "loss"], ["step", "2", "val", "loss"]]
    assert "(compiled the evaluation)" in lines[0] and "compiled" not in lines[1]
    # The printed number is Step.evaluate's on make_eval_batch, after that many steps.
    job = load_job(LLAMA)
    step = sl.compile(build(job, 0), job.loss_fn, job.spec, optimizer=job.optimizer,
                      example_batch=job.make_batch(0))
    for k in range(2):
        step(job.make_batch(k))
    assert float(lines[1].split()[4]) == pytest.approx(float(step.evaluate(job.make_eval_batch(2))), abs=1e-6)


def test_eval_every_needs_make_eval_batch(capsys):
    assert main(["run", str(EXAMPLES / "gpt.py"), "--steps", "2", "--eval-every", "1"]) == 2
    err = capsys.readouterr().err
    assert "gpt.py defines no make_eval_batch" in err and "def make_eval_batch(step: int)" in err


def test_make_eval_batch_must_take_a_step(tmp_path):
    job = tmp_path / "job.py"
    job.write_text((EXAMPLES / "mlp.py").read_text() + "\n\ndef make_eval_batch():\n    return None\n")
    with pytest.raises(sl.SpecError, match=r"make_eval_batch\(\) cannot be called with 1 positional argument"):
        load_job(job)


def test_evaluation_keeps_no_reference_to_the_users_weights():
    """The step keeps the module's structure on meta, not its weights: deleting the model frees them."""
    case = CASES["gpt_tiny"]
    model = case.build(torch.float64)
    batch = case.make_batch(0, torch.float64)
    expected = case.build(torch.float64).eval()
    step = sl.compile(model, case.loss_fn, sl.Spec(mesh=sl.Mesh(fsdp=1)), example_batch=batch)
    weight = weakref.ref(model.tok_emb.weight)
    del model
    gc.collect()
    assert weight() is None or weight().is_meta  # freed, or (the step owns the state) moved to meta
    with torch.no_grad():
        assert float(step.evaluate(batch)) == pytest.approx(float(case.loss_fn(expected, batch)), rel=1e-12)
