"""Worker functions for test_step.py (module level, so the launcher's workers can import them)."""

from __future__ import annotations

import torch
from torch import nn

import shardlang as sl
from shardlang.errors import ShardlangRuntimeError


def compile_with_rank_dependent_model(ctx):
    """Rank 1 builds a wider model than the others: the start-up check must name the ranks."""
    torch.manual_seed(0)
    width = 8 if ctx.rank != 1 else 9
    model = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))
    batch = (torch.randn(2, 4), torch.randn(2, 2))
    try:
        sl.compile(model, lambda m, b: (m(b[0]) - b[1]).pow(2).mean(), sl.Spec(sl.Mesh(fsdp=-1)),
                   example_batch=batch, dist_context=ctx)
    except ShardlangRuntimeError as exc:
        return str(exc)
    return None
