"""Job file: the smallest one. A 3-layer MLP regresses a fixed nonlinear function of its input.

Run it with ``shardlang run examples/mlp.py --nproc 2``. Every name below is part
of the job file format (docs/cli.md); ``spec`` shards every parameter flat
over all ranks. The spec names no units, so the default applies: the three Linear
layers are siblings of one class in an ``nn.Sequential``, so each (``0``, ``2``, ``4``)
is a unit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import shardlang as sl

GLOBAL_BATCH = 16  # a multiple of 4, so world sizes 1, 2 and 4 divide it
D_IN, D_HIDDEN, D_OUT = 8, 64, 4


def build_model() -> nn.Module:
    """Linear(8, 64) -> GELU -> Linear(64, 64) -> GELU -> Linear(64, 4)."""
    return nn.Sequential(
        nn.Linear(D_IN, D_HIDDEN),
        nn.GELU(),
        nn.Linear(D_HIDDEN, D_HIDDEN),
        nn.GELU(),
        nn.Linear(D_HIDDEN, D_OUT),
    )


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean squared error over the (per-rank) batch."""
    x, y = batch
    return F.mse_loss(model(x), y)


def _teacher() -> torch.Tensor:
    """The fixed (D_IN, D_OUT) projection the targets are made from, independent of the step."""
    return torch.randn(D_IN, D_OUT, generator=torch.Generator().manual_seed(1234)) / D_IN**0.5


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch for ``step``: ``x`` (16, 8) and targets ``y = tanh(2 x @ W) + noise`` (16, 4)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, D_IN, generator=g)
    y = torch.tanh(2.0 * x @ _teacher()) + 0.01 * torch.randn(GLOBAL_BATCH, D_OUT, generator=g)
    return x, y


spec = sl.Spec(mesh=sl.Mesh(fsdp=-1))
optimizer = sl.SGD(lr=0.05, momentum=0.9)
