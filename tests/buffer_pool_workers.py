"""Worker functions for test_buffer_pool.py: gathers and packs in the step's pool (Note [buffer assignment]).

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


def _compile(ctx, case, dt, strategy: str, pool: bool):
    spec = sl.Spec.from_dict({"mesh": {"fsdp": ctx.world_size}, **({"units": list(case.units)} if case.units else {}),
                              "strategies": [{"pattern": "*", "strategy": strategy}],
                              "options": {"buffer_pool": pool}})
    example = split_batch(case.make_batch(0, dt), ctx.world_size, ctx.rank)
    return sl.compile(case.build(dt), case.loss_fn, spec, optimizer=OPTIMIZERS["adamw"][0](), example_batch=example,
                      dist_context=ctx)


def pooled_and_fresh_alike(ctx, case_name: str, strategy: str, steps: int = 3):
    """Train the same steps with the pool and without: per run (losses, parameters, slots' data_ptr per step)."""
    case, dt = CASES[case_name], DTYPES["float32"]
    out = []
    for pool in (True, False):
        torch.manual_seed(0)
        step = _compile(ctx, case, dt, strategy, pool)
        slots = emit.buffer_pool(step.graph)
        losses, pointers = [], []
        for k in range(steps):
            losses.append(step(split_batch(case.make_batch(k, dt), ctx.world_size, ctx.rank)))
            pointers.append(sorted(t.data_ptr() for t in slots.slots.values()) if slots is not None else [])
        out.append((torch.stack(losses), step.full_parameters(), pointers))
    return out
