"""Worker functions for the checkpoint tests: train, save, continue; or load and continue. Several cases a call.

A case is a plain dict (it travels to the workers)::

    {"case": "prime", "optimizer": "adamw", "dtype": "float64", "spec": {"mesh": {"fsdp": -1}},
     "steps": 2, "schedule": "lambda", "async": False, "path": "/tmp/.../0"}

``steps`` is k: `train_save_continue` trains k steps, saves, trains k more; `load_continue` loads
and trains the same k more (global batches k..2k-1, whatever the world size).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import shardlang as sl
from shardlang.step.batch import split_batch

from parity import DTYPES, OPTIMIZERS
from training_workers import CASES, SCHEDULES


_COMPILED: dict[str, object] = {}  # this worker's compiled steps by case: tracing dominates the tests' time


def compile_case(ctx, c: dict, *, perturbed: bool = False):
    """The step of case ``c`` on this rank (the case's model, same seed on every rank).

    With ``perturbed``, a step of the same compiled graph whose parameters are off by a factor of 2 and whose
    optimizer state is fresh: what a load must overwrite entirely. The compiled graph is reused between
    calls with the same case and world size.
    """
    key = json.dumps({k: v for k, v in c.items() if k not in ("path", "async")}, sort_keys=True) + f"@{ctx.world_size}"
    case, dt = CASES[c["case"]], DTYPES[c.get("dtype", "float64")]
    if key in _COMPILED:
        step = _COMPILED[key]
        model = case.build(dt)
        if perturbed:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(2.0).add_(0.5)
        schedule = SCHEDULES[c["schedule"]] if c.get("schedule") else None
        return sl.Step(step.compiled, model, step.optimizer, ctx, lr_schedule=schedule, spec=step.spec), case, dt
    spec_dict = dict(c.get("spec", {"mesh": {"fsdp": -1}}))
    if case.units and "units" not in spec_dict:
        spec_dict["units"] = list(case.units)
    spec = sl.Spec.from_dict(spec_dict)
    model = case.build(dt)
    example = split_batch(case.make_batch(0, dt), ctx.world_size, ctx.rank)
    schedule = SCHEDULES[c["schedule"]] if c.get("schedule") else None
    step = sl.compile(model, case.loss_fn, spec, optimizer=OPTIMIZERS[c.get("optimizer", "adamw")][0](),
                      example_batch=example, dist_context=ctx, lr_schedule=schedule)
    _COMPILED[key] = step
    return step, case, dt


def _train(ctx, step, case, dt, start: int, stop: int) -> list[float]:
    losses = []
    for k in range(start, stop):
        loss = step(split_batch(case.make_batch(k, dt), ctx.world_size, ctx.rank)).detach().to(torch.float64)
        if ctx.has_process_group:
            loss = loss.clone()
            torch.distributed.all_reduce(loss)
            loss /= ctx.world_size
        losses.append(float(loss))
    return losses


def train_save_continue(ctx, cases: list[dict]) -> list[dict]:
    """Per case: k steps, save (or async save) to ``path``, k more steps. Returns losses of the last k, params."""
    out = []
    for c in cases:
        step, case, dt = compile_case(ctx, c)
        k = c.get("steps", 2)
        first = _train(ctx, step, case, dt, 0, k)
        if c.get("async"):  # True, or the checkpointer's name
            pending = step.save_async(c["path"], checkpointer=c["async"] if isinstance(c["async"], str) else "thread")
            second = _train(ctx, step, case, dt, k, 2 * k)  # training goes on while the checkpoint is written
            pending.wait()
        else:
            step.save(c["path"])
            second = _train(ctx, step, case, dt, k, 2 * k)
        out.append({"first": first, "losses": second, "params": step.full_parameters(), "lrs": step.lrs})
    return out


def load_continue(ctx, cases: list[dict]) -> list[dict]:
    """Per case: a fresh step, load ``path``, k steps from the restored data position. Returns losses, params."""
    out = []
    for c in cases:
        step, case, dt = compile_case(ctx, c, perturbed=True)
        restored = step.load(c["path"])
        k = c.get("steps", 2)
        losses = _train(ctx, step, case, dt, restored.data_position, restored.data_position + k)
        out.append({"losses": losses, "params": step.full_parameters(), "steps": restored.steps,
                    "data_position": restored.data_position, "world_size": restored.world_size, "lrs": step.lrs,
                    "foreign": restored.foreign})
    return out


def load_error(ctx, c: dict) -> str:
    """The message of the `CheckpointError` loading case ``c`` raises (or 'no error')."""
    step, _, _ = compile_case(ctx, c)
    try:
        step.load(c["path"])
    except sl.CheckpointError as exc:
        return str(exc)
    return "no error"


def load_params(ctx, c: dict) -> dict:
    """A perturbed step loads ``path``; its full parameters."""
    step, _, _ = compile_case(ctx, c, perturbed=True)
    step.load(c["path"])
    return step.full_parameters()


def save_only(ctx, c: dict) -> dict:
    """k steps, then save; the parameters and buffers saved."""
    step, case, dt = compile_case(ctx, c)
    _train(ctx, step, case, dt, 0, c.get("steps", 2))
    step.save(c["path"])
    return {"params": step.full_parameters(), "buffers": {k: v.clone() for k, v in step.full_buffers().items()}}


# ---- FSDP2 on the same case: fully_shard per block and on the root, torch.optim.AdamW --------------------


def fsdp_run(ctx, c: dict, save: bool) -> dict:
    """FSDP2 on ``c`` (a GPT case): with ``save``, k steps, ``dcp.save`` of its state dicts to ``path``, k more;
    otherwise ``dcp.load`` from ``path`` and k steps. Returns the last k losses and the full parameters."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    from torch.distributed.fsdp import fully_shard

    case, dt = CASES[c["case"]], DTYPES[c.get("dtype", "float64")]
    model = case.build(dt)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = OPTIMIZERS[c.get("optimizer", "adamw")][1](model.parameters())
    k = c.get("steps", 2)

    def train(start, stop):
        losses = []
        for i in range(start, stop):
            opt.zero_grad()
            loss = case.loss_fn(model, split_batch(case.make_batch(i, dt), ctx.world_size, ctx.rank))
            loss.backward()
            opt.step()
            value = loss.detach().to(torch.float64).clone()
            torch.distributed.all_reduce(value)
            losses.append(float(value / ctx.world_size))
        return losses

    if save:
        train(0, k)
        dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=c["path"])
        losses = train(k, 2 * k)
    else:
        sd = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}
        dcp.load(sd, checkpoint_id=c["path"])
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optimizer"])
        losses = train(k, 2 * k)
    return {"losses": losses, "params": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()},
            "step": float(next(iter(opt.state.values()))["step"])}


def save_twice(ctx, c: dict) -> dict:
    """Save, train a step, save again with the same step (its cached plan), async by ``c["async"]`` when given.

    Returns each save's files as the manifest lists them, the files left in the directories, whether this
    process's DCP plan cache holds this step's plan (a checkpointer process caches it in its own), and the
    parameters at each save.
    """
    from torch.distributed.checkpoint.planner import SavePlanner
    from shardlang.checkpoint import store
    from shardlang.checkpoint.background import Saves

    step, case, dt = compile_case(ctx, c)
    out: dict = {"params": [], "manifests": [], "listed": []}
    for k, path in enumerate((c["path"] + "-a", c["path"] + "-b")):
        _train(ctx, step, case, dt, k, k + 1)
        out["params"].append(step.full_parameters())
        if c.get("async"):
            step.save_async(path, checkpointer=c["async"]).wait()
        else:
            step.save(path)
        out["manifests"].append(store.read_manifest(Path(path))["files"])
        out["listed"].append(sorted(p.name for p in Path(path).iterdir()))
    out["cached"] = Saves.of(step).plan_key in SavePlanner._cached_final_save_plan  # every rank's, after a save
    return out
