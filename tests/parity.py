"""Worker functions for parity tests: train a case sharded and, on one process, with torch.optim.

They live in an importable module (not a test file) because the local
launcher's worker processes import them by name.
"""

from __future__ import annotations


import torch

import shardlang as sl
from shardlang.step.batch import split_batch

from models import CASES

DTYPES = {"float32": torch.float32, "float64": torch.float64}

OPTIMIZERS = {
    "sgd": (lambda: sl.SGD(lr=0.05, momentum=0.9), lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)),
    "sgd_nesterov": (lambda: sl.SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
                     lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "adamw": (lambda: sl.AdamW(lr=1e-2, weight_decay=0.01), lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01)),
    "adam": (lambda: sl.Adam(lr=1e-2), lambda ps: torch.optim.Adam(ps, lr=1e-2)),
}


def spec_for(case, world_size: int, **options) -> sl.Spec:
    return sl.Spec(mesh=sl.Mesh(fsdp=world_size), units=case.units, options=sl.Options(**options))


def train_sharded(ctx, case_name: str, optimizer: str, dtype: str, steps: int, options: dict | None = None,
                  rules=None, strategies=None):
    """Train ``steps`` steps sharded on this rank; every rank returns (losses, params, buffers, schedule dict).

    ``strategies`` are ``(pattern, strategy name)`` pairs, e.g. ``[("*", "ZeRO1")]``.
    """
    case, dt = CASES[case_name], DTYPES[dtype]
    spec = spec_for(case, ctx.world_size, **(options or {}))
    if rules is not None or strategies is not None:
        spec = sl.Spec(mesh=spec.mesh, rules=rules, units=spec.units, options=spec.options,
                       strategies=[(p, getattr(sl, s)) for p, s in strategies or ()] or None)
    losses, step = run_steps(ctx, case, dt, spec, optimizer, steps)
    params = step.full_parameters()
    return losses, params, {k: v.clone() for k, v in step.full_buffers().items()}, step.schedule.to_dict()


def run_steps(ctx, case, dt, spec, optimizer: str, steps: int):
    """Compile ``spec`` for this rank and train ``steps`` steps on the case's global batches: (losses, step)."""
    model = case.build(dt)
    example = split_batch(case.make_batch(0, dt), ctx.world_size, ctx.rank)
    step = sl.compile(model, case.loss_fn, spec, optimizer=OPTIMIZERS[optimizer][0](), example_batch=example,
                      dist_context=ctx, check_each_pass=True)
    losses = []
    for k in range(steps):
        batch = split_batch(case.make_batch(k, dt), ctx.world_size, ctx.rank)
        losses.append(float(step(batch)))
    return losses, step


def train_reference(case_name: str, optimizer: str, dtype: str, steps: int, world_size: int = 1):
    """One process, torch.optim, the global batch (the mean of per-shard losses for batch-coupled models)."""
    case, dt = CASES[case_name], DTYPES[dtype]
    model = case.build(dt)
    opt = OPTIMIZERS[optimizer][1]([p for p in model.parameters() if p.requires_grad])
    losses = []
    for k in range(steps):
        batch = case.make_batch(k, dt)
        opt.zero_grad()
        loss = case.loss_fn(model, batch)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, dict(model.named_buffers())


def max_relative_difference(params: dict, reference: dict) -> float:
    worst = 0.0
    for name, ref in reference.items():
        scale = ref.abs().max().clamp_min(1e-30)
        worst = max(worst, float((params[name] - ref).abs().max() / scale))
    return worst
