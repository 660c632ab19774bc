"""Worker functions for test_nonfinite.py: a batch that makes the gradient non-finite, trained sharded and on one process."""

from __future__ import annotations

import torch

import parity
import shardlang as sl
from shardlang.step.batch import split_batch

from models import CASES

UNITS = ("fc1", "fc2", "fc3")  # mlp's layers, one unit each, so that a report can name one


def poisoned_batch(case_name: str, step: int, bad_step: int, dtype: torch.dtype):
    """The case's global batch for ``step``; at ``bad_step`` one input of the first sample is inf.

    For mlp (tanh after each hidden layer) the loss stays finite (tanh saturates) while the
    first layer's weight gradient is nan (inf * 0): only unit ``fc1`` goes non-finite.
    """
    x, y = CASES[case_name].make_batch(step, dtype)
    if step == bad_step:
        x = x.clone()
        x[0, 0] = float("inf")
    return x, y


def train_skipping(ctx, case_name: str, optimizer: str, steps: int, bad_step: int, options: dict):
    """Train sharded with ``Options(skip_nonfinite=True, **options)``; (losses, params, skipped, steps done, reports)."""
    case, dt = CASES[case_name], torch.float64
    spec = sl.Spec(mesh=sl.Mesh(fsdp=ctx.world_size), units=UNITS, options=sl.Options(skip_nonfinite=True, **options))
    example = split_batch(poisoned_batch(case_name, 0, bad_step, dt), ctx.world_size, ctx.rank)
    step = sl.compile(case.build(dt), case.loss_fn, spec, optimizer=parity.OPTIMIZERS[optimizer][0](),
                      example_batch=example, dist_context=ctx, check_each_pass=True)
    losses, reports = [], []
    for k in range(steps):
        loss = step(split_batch(poisoned_batch(case_name, k, bad_step, dt), ctx.world_size, ctx.rank))
        losses.append(float(loss))
        reports.append(step.nonfinite_report(loss))
    return losses, step.full_parameters(), step.skipped_steps, step.steps_done, reports


def reference_skipping(case_name: str, optimizer: str, steps: int, bad_step: int, clip: float | None = None):
    """One process with torch.optim that does not step at ``bad_step``: what GradScaler's skip does."""
    case, dt = CASES[case_name], torch.float64
    model = case.build(dt)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = parity.OPTIMIZERS[optimizer][1](params)
    for k in range(steps):
        opt.zero_grad()
        case.loss_fn(model, poisoned_batch(case_name, k, bad_step, dt)).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        if k != bad_step:
            opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_plain(ctx, case_name: str, optimizer: str, steps: int, bad_step: int):
    """The same run without skip_nonfinite: (params,) after ``steps`` steps."""
    case, dt = CASES[case_name], torch.float64
    spec = sl.Spec(mesh=sl.Mesh(fsdp=ctx.world_size), units=UNITS)
    example = split_batch(poisoned_batch(case_name, 0, bad_step, dt), ctx.world_size, ctx.rank)
    step = sl.compile(case.build(dt), case.loss_fn, spec, optimizer=parity.OPTIMIZERS[optimizer][0](),
                      example_batch=example, dist_context=ctx)
    for k in range(steps):
        step(split_batch(poisoned_batch(case_name, k, bad_step, dt), ctx.world_size, ctx.rank))
    return (step.full_parameters(),)
