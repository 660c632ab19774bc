"""Workers for tensor-parallel parity: train a test model on a (data, tp) mesh with Megatron's placements.

They live in an importable module because the local launcher's worker processes import them by name.
"""

from __future__ import annotations

import shardlang as sl
from models import CASES
from parity import DTYPES, OPTIMIZERS
from shardlang.step.batch import split_batch

TP, FSDP = sl.shard("tp", dim=0), sl.shard("fsdp")


def column(*patterns):
    """Column-parallel linears: the weight's output dim (0) split over tp, each tp block sharded over fsdp."""
    return [(p, (sl.shard("tp", dim=0), sl.shard("fsdp"))) for p in patterns]


def row(*patterns):
    """Row-parallel linears: the weight's input dim (1) split over tp."""
    return [(p, (sl.shard("tp", dim=1), sl.shard("fsdp"))) for p in patterns]


RULES = {
    "llama_tiny": [*column("*.wq.weight", "*.wk.weight", "*.wv.weight", "*.w1.weight", "*.w3.weight",
                           "output.weight"),
                   *row("*.wo.weight", "*.w2.weight"), ("*", sl.shard("fsdp"))],
    "gpt_tiny": [*column("*.qkv.*", "*.fc.*"), *row("*.attn.proj.weight", "*.mlp.proj.weight"),
                 ("*", sl.shard("fsdp"))],
}


def train_tensor_parallel(ctx, case_name: str, tp: int, steps: int, options: dict | None = None,
                          strategies=None, replicate: int = 1, recompute=None):
    """Train ``steps`` steps on ``Mesh(fsdp=-1, tp=tp)`` (``replicate=r`` in front: hybrid sharding);
    every rank returns (losses, whole parameters, schedule)."""
    case, dt = CASES[case_name], DTYPES["float64"]
    mesh = sl.Mesh(replicate=replicate, fsdp=-1, tp=tp) if replicate > 1 else sl.Mesh(fsdp=-1, tp=tp)
    spec = sl.Spec(mesh, rules=RULES[case_name], units=case.units, recompute=recompute,
                   options=sl.Options(**(options or {})),
                   strategies=[(p, getattr(sl, s)) for p, s in strategies or ()] or None)
    parts, index = spec.mesh.batch_split(ctx.world_size, ctx.rank)
    model = case.build(dt)
    step = sl.compile(model, case.loss_fn, spec, optimizer=OPTIMIZERS["adamw"][0](),
                      example_batch=split_batch(case.make_batch(0, dt), parts, index), dist_context=ctx,
                      check_each_pass=True)
    losses = [float(step(split_batch(case.make_batch(k, dt), parts, index))) for k in range(steps)]
    return losses, step.full_parameters(), step.schedule.to_dict()


def evaluate_tensor_parallel(ctx, case_name: str, tp: int):
    """The loss of ``loss_fn`` in evaluation (``step.evaluate``) on batch 1 after one step, on every rank."""
    case, dt = CASES[case_name], DTYPES["float64"]
    spec = sl.Spec(sl.Mesh(fsdp=-1, tp=tp), rules=RULES[case_name], units=case.units)
    parts, index = spec.mesh.batch_split(ctx.world_size, ctx.rank)
    step = sl.compile(case.build(dt), case.loss_fn, spec, optimizer=OPTIMIZERS["adamw"][0](),
                      example_batch=split_batch(case.make_batch(0, dt), parts, index), dist_context=ctx)
    step(split_batch(case.make_batch(0, dt), parts, index))
    return float(step.evaluate(split_batch(case.make_batch(1, dt), parts, index), case.loss_fn))


def rows_of(case_name: str, k: int, dt):
    """Global batch ``k`` of a run whose second batch is short (4 rows): a batch of another shape mid-run."""
    batch = CASES[case_name].make_batch(k, dt)
    return batch[:4] if k == 1 else batch


def train_varying_shapes(ctx, case_name: str, tp: int, steps: int):
    """As `train_tensor_parallel`, on `rows_of`'s batches: the step compiles the short batch's shape once more."""
    case, dt = CASES[case_name], DTYPES["float64"]
    spec = sl.Spec(sl.Mesh(fsdp=-1, tp=tp), rules=RULES[case_name], units=case.units)
    parts, index = spec.mesh.batch_split(ctx.world_size, ctx.rank)
    step = sl.compile(case.build(dt), case.loss_fn, spec, optimizer=OPTIMIZERS["adamw"][0](),
                      example_batch=split_batch(rows_of(case_name, 0, dt), parts, index), dist_context=ctx)
    losses = [float(step(split_batch(rows_of(case_name, k, dt), parts, index))) for k in range(steps)]
    return losses, step.full_parameters()
