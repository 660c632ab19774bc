"""Worker functions for the mixed-precision tests (module level, importable by the launcher's workers)."""

from __future__ import annotations

import copy

import torch
from torch.utils import _pytree as pytree

import shardlang as sl
from shardlang.step.batch import split_batch

import parity
from models import CASES


def policy(param_dtype: str, reduce_dtype: str) -> sl.MixedPrecision:
    return sl.MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def train_sharded(ctx, case_name, optimizer, param_dtype, reduce_dtype, steps):
    """Train with mixed precision on this rank; returns (losses, full fp32 parameters, schedule dict)."""
    case = CASES[case_name]
    model = case.build(torch.float32)
    spec = sl.Spec(mesh=sl.Mesh(fsdp=ctx.world_size), units=case.units,
                   options=sl.Options(mixed_precision=policy(param_dtype, reduce_dtype)))
    example = split_batch(case.make_batch(0), ctx.world_size, ctx.rank)
    step = sl.compile(model, case.loss_fn, spec, optimizer=parity.OPTIMIZERS[optimizer][0](), example_batch=example,
                      dist_context=ctx, check_each_pass=True)
    losses = [float(step(split_batch(case.make_batch(k), ctx.world_size, ctx.rank))) for k in range(steps)]
    return losses, step.full_parameters(), step.schedule.to_dict()


def train_reference(case_name, optimizer, param_dtype, reduce_dtype, steps):
    """One process, the same recipe: fp32 master weights and torch.optim; a param_dtype copy computes;
    its gradients are cast to reduce_dtype and back to fp32 before the update."""
    case = CASES[case_name]
    low, reduce = policy(param_dtype, reduce_dtype).param_dtype, policy(param_dtype, reduce_dtype).reduce_dtype
    master = case.build(torch.float32)
    compute = copy.deepcopy(master).to(low)
    opt = parity.OPTIMIZERS[optimizer][1](list(master.parameters()))
    losses = []
    for k in range(steps):
        with torch.no_grad():
            for p, c in zip(master.parameters(), compute.parameters()):
                c.copy_(p)
        batch = pytree.tree_map(lambda t: t.to(low) if t.is_floating_point() else t, case.make_batch(k))
        loss = case.loss_fn(compute, batch)
        loss.backward()
        for p, c in zip(master.parameters(), compute.parameters()):
            p.grad = c.grad.to(reduce).to(p.dtype)
            c.grad = None
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in master.named_parameters()}
