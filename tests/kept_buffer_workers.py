"""Worker functions for test_kept_buffers.py: the DDP strategy's all-reduce buffers kept between steps.

A module of its own (not a test file) because the local launcher's workers
import worker functions by name.
"""

from __future__ import annotations

import torch

import shardlang as sl
from shardlang.step.batch import split_batch
from shardlang.compiler.lower import emit

from models import CASES
from parity import DTYPES, OPTIMIZERS

DDP = {"strategies": [{"pattern": "*", "strategy": "ddp"}]}


def _compile(ctx, case, dt, keep: bool, optimizer: str = "adamw"):
    spec = sl.Spec.from_dict({"mesh": {"fsdp": ctx.world_size}, **({"units": list(case.units)} if case.units else {}), **DDP,
                              "options": {"keep_reduction_buffers": keep}})
    example = split_batch(case.make_batch(0, dt), ctx.world_size, ctx.rank)
    return sl.compile(case.build(dt), case.loss_fn, spec, optimizer=OPTIMIZERS[optimizer][0](), example_batch=example,
                      dist_context=ctx)


def pointers_over_steps(ctx, case_name: str, steps: int = 3):
    """Each kept buffer's data_ptr after every step, and the bound all-reduces' targets (in place or not)."""
    case, dt = CASES[case_name], DTYPES["float64"]
    step = _compile(ctx, case, dt, keep=True)
    kept = emit.kept_reduction_buffers(step.graph)
    before = [k.buffer for k in kept.values()]
    pointers = []
    for k in range(steps):
        step(split_batch(case.make_batch(k, dt), ctx.world_size, ctx.rank))
        pointers.append({name: buffer.buffer.data_ptr() for name, buffer in kept.items()})
    all_reduces = [str(n.target) for n in step.graph.graph.nodes if "all_reduce" in str(n.target)]
    return before, pointers, all_reduces


def kept_and_freed_alike(ctx, case_name: str, steps: int = 3):
    """Train the same steps with the buffers kept and freed: (losses, parameters) of each, on this rank."""
    case, dt = CASES[case_name], DTYPES["float32"]
    out = []
    for keep in (True, False):
        torch.manual_seed(0)
        step = _compile(ctx, case, dt, keep=keep)
        losses = [step(split_batch(case.make_batch(k, dt), ctx.world_size, ctx.rank)) for k in range(steps)]
        out.append((torch.stack(losses), step.full_parameters(), len(emit.kept_reduction_buffers(step.graph))))
    return out


def new_batch_shape(ctx, case_name: str):
    """Two batch shapes, each its own graph with buffers of its own; then the first shape again: same buffers."""
    case, dt = CASES[case_name], DTYPES["float64"]
    step = _compile(ctx, case, dt, keep=True)
    full = split_batch(case.make_batch(0, dt), ctx.world_size, ctx.rank)
    half = full[: full.shape[0] // 2]  # gpt_tiny: one tensor of tokens
    losses = [float(step(full)), float(step(half))]
    first = {n: k.buffer.data_ptr() for n, k in emit.kept_reduction_buffers(step.graph_for(full)).items()}
    second = emit.kept_reduction_buffers(step.graph_for(half))
    losses.append(float(step(full)))
    again = {n: k.buffer.data_ptr() for n, k in emit.kept_reduction_buffers(step.graph_for(full)).items()}
    return losses, first, again, sorted(k.buffer is not None for k in second.values())
