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
                          strategies=None, replicate: int = 1, recompute=None, extra_rules=()):
    """Train ``steps`` steps on ``Mesh(fsdp=-1, tp=tp)`` (``replicate=r`` in front: hybrid sharding),
    ``extra_rules`` before the case's; every rank returns (losses, whole parameters, schedule)."""
    case, dt = CASES[case_name], DTYPES["float64"]
    mesh = sl.Mesh(replicate=replicate, fsdp=-1, tp=tp) if replicate > 1 else sl.Mesh(fsdp=-1, tp=tp)
    spec = sl.Spec(mesh, rules=[*extra_rules, *RULES[case_name]], units=case.units, recompute=recompute,
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


# ---- checkpoints on a 2-D mesh: shardlang at any mesh, FSDP2 + TP (torchtitan's plan) ---------------------


def _checkpoint_step(ctx, case_name: str, tp: int | None, *, perturbed: bool = False):
    """The case's step on ``Mesh(fsdp=-1, tp=tp)`` with `RULES`, or on ``Mesh(fsdp=-1)`` alone when ``tp`` is None;
    and the batch this rank takes of global batch k. ``perturbed``: parameters a load must overwrite."""
    import torch

    case, dt = CASES[case_name], DTYPES["float64"]
    if tp is None:
        spec = sl.Spec(sl.Mesh(fsdp=-1), rules=[("*", FSDP)], units=case.units)
    else:
        spec = sl.Spec(sl.Mesh(fsdp=-1, tp=tp), rules=RULES[case_name], units=case.units)
    parts, index = spec.mesh.batch_split(ctx.world_size, ctx.rank)
    model = case.build(dt)
    if perturbed:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(2.0).add_(0.5)
    step = sl.compile(model, case.loss_fn, spec, optimizer=OPTIMIZERS["adamw"][0](),
                      example_batch=split_batch(case.make_batch(0, dt), parts, index), dist_context=ctx)
    return step, lambda k: split_batch(case.make_batch(k, dt), parts, index)


def save_midway(ctx, case_name: str, tp: int | None, path: str, steps: int):
    """``steps`` steps, ``step.save(path)``, ``steps`` more: (this rank's losses of the second half, parameters)."""
    step, batch = _checkpoint_step(ctx, case_name, tp)
    for k in range(steps):
        step(batch(k))
    step.save(path)
    losses = [float(step(batch(k))) for k in range(steps, 2 * steps)]
    return losses, step.full_parameters()


def load_and_continue(ctx, case_name: str, tp: int | None, path: str, steps: int):
    """A step of perturbed parameters loads ``path`` and trains ``steps`` steps from the restored position:
    (this rank's losses, parameters, (restored steps, data position, foreign))."""
    step, batch = _checkpoint_step(ctx, case_name, tp, perturbed=True)
    restored = step.load(path)
    start = restored.data_position
    losses = [float(step(batch(k))) for k in range(start, start + steps)]
    return losses, step.full_parameters(), (restored.steps, restored.data_position, restored.foreign)


def fsdp2_tp_run(ctx, tp: int, path: str, steps: int, save: bool):
    """FSDP2 + TP on llama_tiny as torchtitan builds it (``parallelize_module`` with its Llama plan, then
    ``fully_shard`` over dp). With ``save``: ``steps`` steps, then ``dcp.save`` of its state dicts to ``path``.
    Otherwise ``dcp.load`` from ``path``, then ``steps`` steps from global batch ``steps``.
    Returns (this rank's losses, full parameters)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    case, dt = CASES["llama_tiny"], DTYPES["float64"]
    data = ctx.world_size // tp
    mesh = init_device_mesh("cpu", (data, tp), mesh_dim_names=("dp", "tp"))
    model = case.build(dt)
    parallelize_module(model, mesh["tp"], {"output": ColwiseParallel(output_layouts=Replicate())})
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(), "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(), "feed_forward.w3": ColwiseParallel()})
        layer.attention.n_heads //= tp  # the modules read their heads from sizes: a tp rank holds 1/tp of them
        layer.attention.n_kv_heads //= tp
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = OPTIMIZERS["adamw"][1](model.parameters())

    def train(start, stop):
        losses = []
        for k in range(start, stop):
            opt.zero_grad()
            loss = case.loss_fn(model, split_batch(case.make_batch(k, dt), data, ctx.rank // tp))
            loss.backward()
            opt.step()
            losses.append(float(loss))
        return losses

    def state():
        return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}

    if save:
        losses = train(0, steps)
        dcp.save(state(), checkpoint_id=path)
    else:
        sd = state()
        dcp.load(sd, checkpoint_id=path)
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optimizer"])
        losses = train(steps, 2 * steps)
    return losses, {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


# ---- pretrained weights on a 2-D mesh -------------------------------------------------------------------


def save_llama_weights(directory: str) -> str:
    """llama_tiny at values no initialisation gives, in the Hugging Face layout (two files and an index)."""
    import json
    from pathlib import Path

    import torch
    from safetensors.torch import save_file

    model = CASES["llama_tiny"].build(DTYPES["float64"], seed=7)
    tensors = {n: (p.detach() + 0.01 * torch.randn_like(p)).contiguous() for n, p in model.named_parameters()}
    names, out = list(tensors), Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for k, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        file = f"model-0000{k + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(out / file))
        weight_map |= {n: file for n in part}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return str(out)


def train_from_weights(ctx, tp: int, weights: str, steps: int):
    """llama_tiny built on meta, compiled on ``Mesh(fsdp=-1, tp=tp)`` with ``weights=``: each rank reads its
    FSDP shard of its tp block. Returns (this rank's losses, full parameters)."""
    import torch

    case, dt = CASES["llama_tiny"], DTYPES["float64"]
    with torch.device("meta"):
        model = case.build(dt)
    spec = sl.Spec(sl.Mesh(fsdp=-1, tp=tp), rules=RULES["llama_tiny"], units=case.units)
    parts, index = spec.mesh.batch_split(ctx.world_size, ctx.rank)
    step = sl.compile(model, case.loss_fn, spec, optimizer=OPTIMIZERS["adamw"][0](),
                      example_batch=split_batch(case.make_batch(0, dt), parts, index), dist_context=ctx,
                      weights=weights)
    losses = [float(step(split_batch(case.make_batch(k, dt), parts, index))) for k in range(steps)]
    return losses, step.full_parameters()
