"""Job file for the collective-timeout test: rank 1 stops reaching collectives at step 2.

``make_batch(1)`` (the batch of step 2) sleeps on rank 1 as a stuck data loader
would, far longer than the test's ``--timeout``; rank 0 goes on to step 2's
first collective and must fail within the timeout, naming rank 1 and the op.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

import shardlang as sl

STUCK_S = 120.0  # far beyond the test's --timeout: only the timeout can end the run


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    if step == 1 and dist.is_initialized() and dist.get_rank() == 1:
        time.sleep(STUCK_S)
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)


spec = sl.Spec(mesh=sl.Mesh(fsdp=-1))
optimizer = sl.SGD(lr=0.1)
