"""Worker functions for test_recompute.py: the tiny GPT with dropout, trained with and without recompute.

``DropoutGPT`` is examples/gpt.py's GPT whose blocks drop out their attention
and MLP outputs (p = 0.25), so a recompute that drew new masks would change the
numbers at once.
"""

from __future__ import annotations

import torch
from torch import nn

import models
import parity
import shardlang as sl

DROPOUT = 0.25


class DropoutBlock(nn.Module):
    """examples/gpt.py's Block with dropout on what each sub-layer adds to the residual stream."""

    def __init__(self, config) -> None:
        super().__init__()
        gpt = models.load_gpt_module()
        self.ln1 = nn.LayerNorm(config.n_embd)
        self.attn = gpt.CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embd)
        self.mlp = gpt.MLP(config)
        self.drop = nn.Dropout(DROPOUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


def dropout_gpt() -> nn.Module:
    gpt = models.load_gpt_module()
    model = gpt.make_gpt(**models.GPT_TINY)
    model.blocks = nn.ModuleList(DropoutBlock(model.config) for _ in range(model.config.n_layer))
    model.apply(gpt.init_weights)
    return model


CASES = {
    "gpt_dropout": models.Case("gpt_dropout", dropout_gpt, models.gpt_loss, models.gpt_batch, units=("blocks.*",)),
    **models.CASES,
}


def train_each(ctx, case_name: str, runs: list[dict], steps: int = 2):
    """Train ``steps`` steps once per spec dict in ``runs`` (keys ``recompute``, ``options``) on this rank.

    Returns, per run, ``(losses, full parameters, schedule dict)``.
    """
    case = CASES[case_name]
    out = []
    for run in runs:
        spec = sl.Spec(mesh=sl.Mesh(fsdp=ctx.world_size), units=case.units, recompute=run.get("recompute"),
                       options=sl.Options(**run.get("options", {})))
        losses, step = parity.run_steps(ctx, case, torch.float64, spec, run.get("optimizer", "adamw"), steps)
        out.append((losses, step.full_parameters(), step.schedule.to_dict()))
    return out


def reference_global_dropout(case_name: str, steps: int = 2, seed: int = 0):
    """One process on the global batch, AdamW, generator seeded with ``seed`` (what ``random="global"`` matches)."""
    case = CASES[case_name]
    model = case.build(torch.float64)
    opt = parity.OPTIMIZERS["adamw"][1](list(model.parameters()))
    caller = torch.get_rng_state()
    torch.manual_seed(seed)
    losses = []
    for k in range(steps):
        opt.zero_grad()
        loss = case.loss_fn(model, case.make_batch(k, torch.float64))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    torch.set_rng_state(caller)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}

