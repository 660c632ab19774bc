"""Job file for the non-finite tests: the global batch of step 2 (``make_batch(1)``) holds a nan in its last row.

At two ranks the last row is rank 1's, so only rank 1's own loss is nan: the run must still stop (or skip) on
every rank alike. ``NAN_JOB_SKIP=1`` in the environment compiles with ``Options(skip_nonfinite=True)``.
"""

from __future__ import annotations

import os

import torch
from torch import nn

import shardlang as sl


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)
    if step == 1:
        x[-1, 0] = float("nan")
    return x, y


spec = sl.Spec(mesh=sl.Mesh(fsdp=-1), options=sl.Options(skip_nonfinite=os.environ.get("NAN_JOB_SKIP") == "1"))
optimizer = sl.SGD(lr=0.1)
