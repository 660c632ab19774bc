"""Job file with a shape bug in its loss (``model(x) @ y`` with mismatched shapes): tracing fails on every rank."""

from __future__ import annotations

import torch
from torch import nn

import shardlang as sl


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 4))


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return (model(x) @ y).mean()


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 8, generator=g), torch.randn(16, 3, generator=g)


spec = sl.Spec(mesh=sl.Mesh(fsdp=-1))
optimizer = sl.SGD(lr=0.1)
