"""Job file for the terminal tests: steps slow enough (a sleep in make_batch) that a live bar is seen live.

Rank 1 prints one line of its own in step 5, and rank 0 one in step 7, as a user's debugging
print would, so the tests can see where the ranks' lines go while rank 0's bar is drawn.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

import shardlang as sl

STEP_S = 0.15  # each step's data takes this long


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    time.sleep(STEP_S)
    if step == 4 and dist.is_initialized() and dist.get_rank() == 1:
        print("a line from rank 1", flush=True)
    if step == 6 and (not dist.is_initialized() or dist.get_rank() == 0):
        print("a line from rank 0", end="")  # a partial line, then its end: one line above the bar
        print(" of the job's own", flush=True)
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)


spec = sl.Spec(mesh=sl.Mesh(fsdp=-1))
optimizer = sl.SGD(lr=0.1)
