"""Worker functions for test_training.py: train sharded with the training features, and the torch reference.

A run is described by plain values (so it crosses to the worker processes):
``options`` (a dict for ``sl.Options``), ``groups`` (a list of
``(pattern, overrides)`` pairs), ``rules`` (layout rules, None: shard all),
``schedule`` (a key of `SCHEDULES`).
"""

from __future__ import annotations

import torch

import parity
import shardlang as sl
from models import CASES
from shardlang.batch import split_batch
from shardlang.training import ParamGroup, assign_groups

SCHEDULES = {
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k)),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4, eta_min=1e-3),
    "warmup_cosine": lambda opt: torch.optim.lr_scheduler.SequentialLR(
        opt, [torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=2),
              torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=3)], milestones=[2]),
}


def train(ctx, case_name: str, optimizer: str, steps: int, options: dict | None = None, groups=None, rules=None,
          schedule: str | None = None, dtype: str = "float64"):
    """Train sharded on this rank; returns (losses, full params, buffers, schedule dict, lrs per step)."""
    case, dt = CASES[case_name], parity.DTYPES[dtype]
    model = case.build(dt)
    spec = sl.Spec(mesh=sl.Mesh(fsdp=ctx.world_size), rules=rules, units=case.units,
                   options=sl.Options(**(options or {})), param_groups=groups or ())
    example = split_batch(case.make_batch(0, dt), ctx.world_size, ctx.rank)
    step = sl.compile(model, case.loss_fn, spec, optimizer=parity.OPTIMIZERS[optimizer][0](), example_batch=example,
                      dist_context=ctx, check_each_pass=True,
                      lr_schedule=SCHEDULES[schedule] if schedule else None)
    graph = step._graph  # the bound graph
    losses, lrs = [], []
    for k in range(steps):
        lrs.append(step.lrs)
        losses.append(float(step(split_batch(case.make_batch(k, dt), ctx.world_size, ctx.rank))))
    assert step._graph is graph  # one trace, one graph, whatever the lr
    return losses, step.full_parameters(), {k: v.clone() for k, v in step.full_buffers().items()}, \
        step.schedule.to_dict(), lrs


def reference(case_name: str, optimizer: str, steps: int, options: dict | None = None, groups=None,
              schedule: str | None = None, dtype: str = "float64"):
    """One process, torch.optim with the same param groups, clip_grad_norm_ and lr scheduler."""
    case, dt = CASES[case_name], parity.DTYPES[dtype]
    options = options or {}
    model = case.build(dt)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    param_groups = [ParamGroup(pattern, **overrides) for pattern, overrides in (groups or ())]
    group_of = assign_groups([(n, True) for n, _ in named], tuple(param_groups))
    torch_groups = [{"params": [p for n, p in named if group_of.get(n, 0) == 0]}]
    torch_groups += [{"params": [p for n, p in named if group_of.get(n) == g], **pg.overrides}
                     for g, pg in enumerate(param_groups, start=1)]
    opt = parity.OPTIMIZERS[optimizer][1](torch_groups)
    scheduler = SCHEDULES[schedule](opt) if schedule else None
    losses, norms, lrs = [], [], []
    for k in range(steps):
        lrs.append([g["lr"] for g in opt.param_groups])
        opt.zero_grad()
        loss = case.loss_fn(model, case.make_batch(k, dt))
        loss.backward()
        if options.get("clip_grad_norm") is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_([p for _, p in named], options["clip_grad_norm"])))
        opt.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, dict(model.named_buffers()), \
        norms, lrs


def gradient_norms(case_name: str, steps: int, dtype: str = "float64") -> list[float]:
    """The unclipped global gradient norm of the first ``steps`` batches, at the initial weights."""
    case, dt = CASES[case_name], parity.DTYPES[dtype]
    model = case.build(dt)
    norms = []
    for k in range(steps):
        model.zero_grad()
        case.loss_fn(model, case.make_batch(k, dt)).backward()
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])))
    return norms
