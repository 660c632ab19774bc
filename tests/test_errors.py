"""Bad input gets a clear error naming the value, where it came from, and what would be valid."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardlang as sl
from shardlang.batch import split_batch
from shardlang.runtime import DistContext


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def mse(model, batch):
    x, y = batch
    return (model(x) - y).pow(2).mean()


BATCH = (torch.randn(6, 4), torch.randn(6, 2))


def test_global_batch_that_does_not_divide_by_the_world():
    with pytest.raises(sl.ShardlangRuntimeError, match=r"global batch size 6 .* does not divide by world size 4"):
        split_batch(BATCH, 4, 0)


def test_batch_of_the_wrong_shape_names_both_shapes():
    step = sl.compile(mlp(), mse, sl.Spec(sl.Mesh(fsdp=1)), optimizer=sl.SGD(lr=0.1), example_batch=BATCH)
    with pytest.raises(sl.ShardlangRuntimeError, match=r"shape \(3, 4\).*compiled for shape \(6, 4\)"):
        step((torch.randn(3, 4), torch.randn(3, 2)))
    with pytest.raises(sl.ShardlangRuntimeError, match="has 1 tensors; the step was compiled for 2"):
        step((torch.randn(6, 4),))


def test_loss_that_is_not_a_scalar():
    with pytest.raises(sl.TraceError, match=r"scalar tensor; it returned a tensor of shape \(6, 2\)"):
        sl.compile(mlp(), lambda m, b: m(b[0]), sl.Spec(sl.Mesh(fsdp=1)), example_batch=BATCH)


def test_loss_that_does_not_depend_on_parameters():
    with pytest.raises(sl.TraceError, match="does not depend on any trainable parameter"):
        sl.compile(mlp(), lambda m, b: b[1].sum() * 1.0, sl.Spec(sl.Mesh(fsdp=1)), example_batch=BATCH)


def test_mesh_that_does_not_fit_the_world():
    with pytest.raises(sl.SpecError, match="4") as err:
        sl.compile(mlp(), mse, sl.Spec(sl.Mesh(fsdp=4)), example_batch=BATCH, dist_context=DistContext.single())
    assert "1" in str(err.value)


def test_step_run_in_the_wrong_world():
    compiled = sl.plan(mlp(), mse, sl.Spec(sl.Mesh(fsdp=2)), example_batch=split_batch(BATCH, 2, 0), world_size=2)
    with pytest.raises(sl.ShardlangRuntimeError, match="compiled for a mesh of 2 ranks but runs in a world of 1"):
        sl.Step(compiled, mlp(), sl.AdamW(lr=1e-3), DistContext.single())


@pytest.mark.parametrize(
    "make, pattern",
    [
        (lambda: sl.SGD(lr=-1.0), "lr=-1.0"),
        (lambda: sl.AdamW(lr=1e-3, betas=(0.9, 1.5)), r"betas=\(0.9, 1.5\)"),
        (lambda: sl.SGD(lr=0.1, nesterov=True), "nesterov needs momentum"),
        (lambda: sl.Adam(lr=1e-3, eps="tiny"), "eps='tiny'"),
    ],
)
def test_bad_optimizer_hyperparameters(make, pattern):
    with pytest.raises(sl.SpecError, match=pattern):
        make()


def test_spec_that_is_not_a_spec():
    with pytest.raises(sl.SpecError, match="spec must be a shardlang.Spec, got dict"):
        sl.compile(mlp(), mse, {"mesh": {"fsdp": 1}}, example_batch=BATCH)


def test_lr_changes_without_retracing():
    model = mlp()
    step = sl.compile(model, mse, sl.Spec(sl.Mesh(fsdp=1)), optimizer=sl.SGD(lr=0.0), example_batch=BATCH)
    before = step.full_parameters()
    step(BATCH)
    assert all(torch.equal(before[k], v) for k, v in step.full_parameters().items())  # lr 0: nothing moves
    graph = step._graph
    step.set_lr(0.1)
    step(BATCH)
    assert step._graph is graph
    assert any(not torch.equal(before[k], v) for k, v in step.full_parameters().items())
