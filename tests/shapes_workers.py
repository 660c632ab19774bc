"""Worker functions for test_shapes.py: training on batches whose shapes vary by step and by rank.

Each step gives every rank its own batch (`rank_batches`): ranks may hold
different row counts and sequence lengths in the same step. The reference is
one process that trains on all ranks' batches of a step with the documented
loss convention (docs/training.md, "Batches of varying shape"): the mean over
ranks of each rank's mean loss, which is what averaging gradients over ranks
computes (as DDP and FSDP2 do).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import shardlang as sl

from models import CASES, load_gpt_module
from parity import DTYPES, OPTIMIZERS

SEQ_LENS = (16, 8, 12, 4)  # tokens per row, input length + 1 for the shifted target
ROWS = (2, 3, 1)


def rank_batches(case_name: str, world: int, step: int, dtype: torch.dtype, row_counts=ROWS) -> list:
    """The batch of each rank at ``step``: shapes that differ across steps and across ranks."""
    out = []
    for rank in range(world):
        rows = row_counts[(step + 2 * rank) % len(row_counts)]
        seed = 1000 * step + rank
        if case_name == "gpt_tiny":
            length = SEQ_LENS[(step + rank) % len(SEQ_LENS)]
            out.append(load_gpt_module().make_tokens(seed, batch_size=rows, seq_len=length, vocab_size=32))
        elif case_name == "convnet_bn":  # rows vary; BatchNorm's statistics must count every rank's rows
            g = torch.Generator().manual_seed(seed)
            out.append((torch.randn(rows + 1, 3, 8, 8, generator=g, dtype=torch.float64).to(dtype),
                        torch.randint(10, (rows + 1,), generator=g)))
        else:
            raise KeyError(case_name)
    return out


def train_sharded(ctx, case_name: str, optimizer: str, dtype: str, steps: int, options: dict | None = None,
                  row_counts=ROWS):
    """Train on this rank's varying batches: (local losses, full parameters, buffers, shapes compiled, digests)."""
    case, dt = CASES[case_name], DTYPES[dtype]
    spec = sl.Spec(mesh=sl.Mesh(fsdp=ctx.world_size), units=case.units, options=sl.Options(**(options or {})))
    model = case.build(dt)
    first = rank_batches(case_name, ctx.world_size, 0, dt, row_counts)[ctx.rank]
    step = sl.compile(model, case.loss_fn, spec, optimizer=OPTIMIZERS[optimizer][0](), example_batch=first,
                      dist_context=ctx)
    model.to("meta")  # the step holds the state; retracing needs the module's structure only
    losses = [float(step(rank_batches(case_name, ctx.world_size, k, dt, row_counts)[ctx.rank])) for k in range(steps)]
    digests = sorted({step.schedule_for(b).collectives_digest() for b in
                      (rank_batches(case_name, ctx.world_size, k, dt, row_counts)[ctx.rank] for k in range(steps))})
    return losses, step.full_parameters(), step.full_buffers(), step.batch_shapes, digests


def train_reference(case_name: str, optimizer: str, dtype: str, steps: int, world: int, row_counts=ROWS):
    """One process on every rank's batch of each step: the mean of the per-rank mean losses."""
    case, dt = CASES[case_name], DTYPES[dtype]
    model = case.build(dt)
    opt = OPTIMIZERS[optimizer][1]([p for p in model.parameters() if p.requires_grad])
    losses = []
    for k in range(steps):
        batches = rank_batches(case_name, world, k, dt, row_counts)
        opt.zero_grad()
        if case.batch_coupled:  # one forward on the concatenated batch: BatchNorm sees every rank's rows
            x = torch.cat([b[0] for b in batches])
            logits = model(x).split([len(b[1]) for b in batches])
            per_rank = [F.cross_entropy(out, b[1]) for out, b in zip(logits, batches)]
        else:
            per_rank = [case.loss_fn(model, b) for b in batches]
        loss = torch.stack(per_rank).mean()
        loss.backward()
        opt.step()
        losses.append([float(r.detach()) for r in per_rank])
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, dict(model.named_buffers())
