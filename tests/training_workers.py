"""Worker functions for test_training.py: train sharded with the training features, and the torch reference.

A run is described by plain values (so it crosses to the worker processes):
``options`` (a dict for ``sl.Options``), ``groups`` (a list of
``(pattern, overrides)`` pairs), ``rules`` (layout rules, None: shard all),
``schedule`` (a key of `SCHEDULES`).
"""

from __future__ import annotations

import torch
from torch import nn

import models
import parity
import shardlang as sl
from shardlang.step.batch import split_batch
from shardlang.compiler.ir.training import per_rank_seed
from shardlang.spec.training import to_param_groups, torch_param_groups


class DropoutMLP(nn.Module):
    """16 -> 32 -> 32 -> 4 with tanh and dropout after each hidden layer."""

    def __init__(self, p: float = 0.25) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.drop(torch.tanh(self.fc2(self.drop(torch.tanh(self.fc1(x)))))))


class NoisyMLP(DropoutMLP):
    """Gaussian noise on the input: a random op that is not F.dropout."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x + 0.01 * torch.randn_like(x))


CASES = {
    **models.CASES,
    "mlp_dropout": models.Case("mlp_dropout", DropoutMLP, models.mse_loss, models.mlp_batch),
    "mlp_dropout0": models.Case("mlp_dropout0", lambda: DropoutMLP(0.0), models.mse_loss, models.mlp_batch),
    "mlp_noise": models.Case("mlp_noise", NoisyMLP, models.mse_loss, models.mlp_batch),
}

SCHEDULES = {
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k)),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4, eta_min=1e-3),
    "warmup_cosine": lambda opt: torch.optim.lr_scheduler.SequentialLR(
        opt, [torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=2),
              torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=3)], milestones=[2]),
}


def train(ctx, case_name: str, optimizer: str, steps: int, options: dict | None = None, groups=None, rules=None,
          schedule: str | None = None, dtype: str = "float64"):
    """Train sharded on this rank; returns (losses, full params, buffers, schedule dict, lrs per step).

    The schedule dict also holds ``grad_norms``: `Step.grad_norm` after each step (None without clipping).
    """
    case, dt = CASES[case_name], parity.DTYPES[dtype]
    model = case.build(dt)
    spec = sl.Spec(mesh=sl.Mesh(fsdp=ctx.world_size), rules=rules, units=case.units,
                   options=sl.Options(**(options or {})), param_groups=groups or ())
    example = split_batch(case.make_batch(0, dt), ctx.world_size, ctx.rank)
    step = sl.compile(model, case.loss_fn, spec, optimizer=parity.OPTIMIZERS[optimizer][0](), example_batch=example,
                      dist_context=ctx, check_each_pass=True,
                      lr_schedule=SCHEDULES[schedule] if schedule else None)
    graph = step._graph  # the bound graph
    losses, lrs, norms = [], [], []
    for k in range(steps):
        lrs.append(step.lrs)
        losses.append(float(step(split_batch(case.make_batch(k, dt), ctx.world_size, ctx.rank))))
        norms.append(None if step.grad_norm is None else float(step.grad_norm))
    assert step._graph is graph  # one trace, one graph, whatever the lr
    schedule = step.schedule.to_dict() | {"grad_norms": norms}
    return losses, step.full_parameters(), {k: v.clone() for k, v in step.full_buffers().items()}, schedule, lrs


def reference(case_name: str, optimizer: str, steps: int, options: dict | None = None, groups=None,
              schedule: str | None = None, dtype: str = "float64", world_size: int = 1):
    """One process, torch.optim with the same param groups, clip_grad_norm_ and lr scheduler.

    Random numbers: with ``options["random"] == "global"`` the global generator
    is seeded with ``options["seed"]`` before the first step, as every rank's is;
    with ``"per_rank"`` (and a model that draws), the loss is the mean over
    ``world_size`` row blocks, block r drawing from its own generator seeded
    ``per_rank_seed(seed, r)``: what N ranks compute.
    """
    case, dt = CASES[case_name], parity.DTYPES[dtype]
    options = options or {}
    model = case.build(dt)
    seed = options.get("seed", 0)
    per_rank = options.get("random", "per_rank") == "per_rank"
    states = [torch.Generator().manual_seed(per_rank_seed(seed, r)).get_state() for r in range(world_size)]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = parity.OPTIMIZERS[optimizer][1](torch_param_groups(named, to_param_groups(groups)))
    scheduler = SCHEDULES[schedule](opt) if schedule else None
    losses, norms, lrs = [], [], []
    caller = torch.get_rng_state()
    torch.manual_seed(seed)
    for k in range(steps):
        lrs.append([g["lr"] for g in opt.param_groups])
        opt.zero_grad()
        if per_rank:
            loss = 0
            for r in range(world_size):
                torch.set_rng_state(states[r])
                loss = loss + case.loss_fn(model, split_batch(case.make_batch(k, dt), world_size, r)) / world_size
                states[r] = torch.get_rng_state()
        else:
            loss = case.loss_fn(model, case.make_batch(k, dt))
        loss.backward()
        if options.get("clip_grad_norm") is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_([p for _, p in named], options["clip_grad_norm"])))
        opt.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(float(loss.detach()))
    torch.set_rng_state(caller)
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
