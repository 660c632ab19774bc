"""Worker functions for test_evaluate.py: train sharded, then evaluate on the step's state; and one process's
reference (torch.optim, then ``model.eval()`` under ``torch.no_grad``).

Runs are described by plain values so they cross to the worker processes:
a case name (of `CASES`), an optimizer name (of `parity.OPTIMIZERS`), a dtype
name, the training steps, and ``strategies`` (a list of (pattern, strategy
name) pairs, or None).
"""

from __future__ import annotations

import torch

import models
import parity
import shardlang as sl
from shardlang.step.batch import split_batch
from training_workers import DropoutMLP

CASES = {**models.CASES, "mlp_dropout": models.Case("mlp_dropout", DropoutMLP, models.mse_loss, models.mlp_batch)}
EVAL_STEP = 100  # the batch evaluated on: one no training step sees


def outputs(model, batch):
    """What the model computes from the batch's input, before the loss: logits, predictions."""
    x = batch[0] if isinstance(batch, (tuple, list)) else batch
    if x.dtype == torch.long:
        x = x[:, :-1]  # token streams: the inputs are all but the last token
    return {"out": model(x)}


def train_then_evaluate(ctx, case_name: str, optimizer: str, dtype: str, steps: int, strategies=None,
                        train_after: bool = True):
    """Train ``steps`` steps sharded, then evaluate: (eval loss, outputs, eval schedule dict, checks, losses after).

    ``checks`` holds what evaluation must not change: whether the state's tensors are the
    same objects (no copy) and unchanged in value. With ``train_after``, training goes on
    for one more step afterwards, to show the state still trains.
    """
    case, dt = CASES[case_name], parity.DTYPES[dtype]
    spec = sl.Spec(mesh=sl.Mesh(fsdp=ctx.world_size), units=case.units, strategies=strategies)
    losses, step = parity.run_steps(ctx, case, dt, spec, optimizer, steps)
    batch = split_batch(case.make_batch(EVAL_STEP, dt), ctx.world_size, ctx.rank)
    before = [t.clone() for t in step.state.graph_inputs()]
    ids = [id(t) for t in step.state.graph_inputs()]
    evaluation = step.evaluation(batch)
    loss = float(evaluation(batch))
    out = step.evaluate(batch, fn=outputs)["out"]
    checks = {
        "same_tensors": [id(t) for t in evaluation.graph_inputs(batch)[: len(step.state.flat_tensors)]]
        == [id(t) for t in step.state.flat_tensors],
        "state_unchanged": ids == [id(t) for t in step.state.graph_inputs()]
        and all(torch.equal(a, b) for a, b in zip(before, step.state.graph_inputs())),
        "cached": step.evaluation(batch) is evaluation,
        "training": [m.training for m in step._evaluations.module.modules()],
    }
    if train_after:
        losses.append(float(step(split_batch(case.make_batch(steps, dt), ctx.world_size, ctx.rank))))
    return loss, out, evaluation.schedule.to_dict(), checks, losses


def reference(case_name: str, optimizer: str, dtype: str, steps: int):
    """One process: ``steps`` torch.optim steps on the global batches, then eval mode and no_grad.

    Returns (eval loss on the global batch, per-row outputs, training losses including one step more,
    and the train-mode loss on the evaluated batch).
    """
    case, dt = CASES[case_name], parity.DTYPES[dtype]
    model = case.build(dt)
    opt = parity.OPTIMIZERS[optimizer][1]([p for p in model.parameters() if p.requires_grad])
    losses = []

    def train_step(k):
        opt.zero_grad()
        loss = case.loss_fn(model, case.make_batch(k, dt))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))

    for k in range(steps):
        train_step(k)
    model.eval()
    with torch.no_grad():
        batch = case.make_batch(EVAL_STEP, dt)
        loss, out = float(case.loss_fn(model, batch)), outputs(model, batch)["out"]
    model.train()
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # the same dropout masks whatever ran before in this process (else by chance close)
        train_mode_loss = float(case.loss_fn(model, batch))
    train_step(steps)
    return loss, out, losses, train_mode_loss
