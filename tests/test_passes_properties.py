"""Property tests: for random models, layouts and worlds, every pass keeps the schedule's invariants.

Hypothesis draws stacks of Linear layers with small and prime sizes, a layout
for each parameter (flat, along a dim, replicated), some frozen layers, a world
size and the resharding option. Compiling runs the verifier after every pass
(`check_each_pass`); the byte totals must equal the formula; and at world size
1 the compiled step must train exactly like torch.optim.
"""

from __future__ import annotations

import copy
import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import shardlang as sl
from shardlang.compiler.compile import compile_step
from shardlang.compiler.config import Scheduling, StepConfig
from shardlang.compiler.layout.optim import SGD
from shardlang.compiler.layout.placement import LayoutKind, MeshShape, ParamInfo, Placement

SIZES = st.sampled_from([1, 2, 3, 5, 7, 8, 11, 13])


@st.composite
def models(draw):
    widths = draw(st.lists(SIZES, min_size=2, max_size=5))
    layers = [nn.Linear(a, b, bias=draw(st.booleans())) for a, b in zip(widths, widths[1:])]
    model = nn.Sequential(*layers).double()
    for layer in layers:
        if draw(st.booleans()) and draw(st.booleans()):  # about a quarter of the layers frozen
            layer.requires_grad_(False)
    if not any(p.requires_grad for p in model.parameters()):
        layers[-1].requires_grad_(True)
    return model, widths


@st.composite
def placements(draw, model, world):
    infos = []
    units = draw(st.sampled_from(["per_layer", "one"]))
    for name, p in model.named_parameters():
        kind = draw(st.sampled_from(list(LayoutKind)))
        dim = draw(st.integers(0, p.dim() - 1)) if kind is LayoutKind.SHARD_DIM else None
        axis = None if kind is LayoutKind.REPLICATE else "fsdp"
        unit = name.split(".")[0] if units == "per_layer" else ""
        infos.append(ParamInfo(name, p.shape, p.dtype, p.requires_grad, unit, Placement(kind, axis, dim)))
    return tuple(infos)


def loss_fn(model, batch):
    x, y = batch
    return (model(x) - y).pow(2).mean()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_passes_keep_invariants_and_bytes_follow_the_formula(data):
    model, widths = data.draw(models())
    world = data.draw(st.sampled_from([1, 2, 3, 4, 5]))
    reshard = data.draw(st.booleans())
    params = data.draw(placements(model, world))
    batch = (torch.randn(2, widths[0], dtype=torch.float64), torch.randn(2, widths[-1], dtype=torch.float64))
    config = StepConfig(params, MeshShape((("fsdp", world),)), scheduling=Scheduling(reshard_after_forward=reshard))
    compiled = compile_step(model, loss_fn, config, SGD(lr=0.1, momentum=0.9), batch, check_each_pass=True)
    schedule = compiled.schedule
    sharded = [f for f in schedule.flats if f.sharded]
    padded = {f.name: _padded_flat(f.members, params, world) * f.element_size for f in sharded}
    regathered = {op.flat for op in schedule.ops if op.kind is sl.OpKind.ALL_GATHER and op.detail}
    gathered_once = {op.flat for op in schedule.ops if op.kind is sl.OpKind.ALL_GATHER and not op.detail}
    summary = schedule.summary
    assert summary.bytes_per_rank["all_gather"] == sum(padded[f] for f in gathered_once | regathered) + sum(
        padded[f] for f in regathered)
    # A world of one reduces nothing: SGD's momentum add_ reads member gradients (Note [updates from member gradients]).
    reduced = int(world > 1)
    assert summary.bytes_per_rank["reduce_scatter"] == sum(padded[f.name] for f in sharded if f.trainable) * reduced
    replicated_grads = sum(f.numel * f.element_size for f in schedule.flats if not f.sharded and f.trainable)
    assert summary.bytes_per_rank["all_reduce"] == replicated_grads * reduced
    if not reshard:
        assert not regathered


def _padded_flat(member_names, params, world):
    """A sharded flat's padded elements: its members whole, padded once, unless one is sharded along a dim
    (then each member's pieces are padded; Note [whole-flat shards], Note [shard layout])."""
    infos = [next(p for p in params if p.name == name) for name in member_names]
    if any(info.placement.kind is LayoutKind.SHARD_DIM for info in infos):
        return sum(_padded(name, params, world) for name in member_names)
    return math.ceil(sum(info.numel for info in infos) / world) * world


def _padded(member_name, params, world):
    info = next(p for p in params if p.name == member_name)
    if info.placement.kind is LayoutKind.SHARD_DIM:
        d = info.placement.dim
        return math.ceil(info.shape[d] / world) * world * info.numel // max(info.shape[d], 1)
    return math.ceil(info.numel / world) * world


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_world_of_one_trains_like_torch_optim(data):
    model, widths = data.draw(models())
    params = data.draw(placements(model, 1))
    reference = copy.deepcopy(model)
    batch = (torch.randn(4, widths[0], dtype=torch.float64), torch.randn(4, widths[-1], dtype=torch.float64))
    spec_free = compile_step(model, loss_fn, StepConfig(params, MeshShape((("fsdp", 1),))), SGD(lr=0.1, momentum=0.9),
                             batch)
    step = sl.Step(spec_free, model, SGD(lr=0.1, momentum=0.9), sl.runtime.DistContext.single())
    opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    for _ in range(3):
        step(batch)
        opt.zero_grad()
        loss_fn(reference, batch).backward()
        opt.step()
    full = step.full_parameters()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=1e-12, atol=1e-12)
