"""Note [gradient sums in place]: autograd's out-of-place gradient sums write into an operand nothing reads after.

The pass must keep every value to the bit (tests/test_parity.py runs the
rewritten step against one process at N = 1, 2 and 4), write only into a
buffer no later node reads, and leave inductor's graph alone.
"""

from __future__ import annotations

import functools
import types
from unittest import mock

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import shardlang as sl
from shardlang import api
from shardlang.step.batch import split_batch
from shardlang.spec.vocabulary import StepBackend
from shardlang.compiler.compile import compile_step
from shardlang.compiler.passes import add_gradients_in_place as module
from shardlang.compiler.passes.add_gradients_in_place import add_gradients_in_place
from shardlang.compiler.passes.pipeline import DEFAULT_PASSES

import parity
from models import CASES

_aten = torch.ops.aten
OUT_OF_PLACE = tuple(p for p in DEFAULT_PASSES if p is not add_gradients_in_place)


def _train(rewrite: bool):
    case = CASES["gpt_tiny"]
    spec = sl.Spec(mesh=sl.Mesh(fsdp=1), units=case.units)
    patch = (mock.patch.object(api, "compile_step", functools.partial(compile_step, passes=OUT_OF_PLACE))
             if not rewrite else mock.MagicMock())
    with patch:
        step = sl.compile(case.build(torch.float64), case.loss_fn, spec, optimizer=parity.OPTIMIZERS["adamw"][0](),
                          example_batch=split_batch(case.make_batch(0, torch.float64), 1, 0), check_each_pass=True)
    losses = [float(step(case.make_batch(k, torch.float64))) for k in range(3)]
    return step, losses, step.full_parameters()


def _backward_adds(step, target) -> list[fx.Node]:
    return [n for n in step.graph.graph.nodes
            if n.target is target and n.meta.get("custom", {}).get("phase") == "backward"]


def test_the_tied_gradient_is_summed_in_place_to_the_bit():
    plain_step, plain_losses, plain = _train(rewrite=False)
    step, losses, params = _train(rewrite=True)
    assert losses == plain_losses
    assert all(torch.equal(params[n], plain[n]) for n in params)
    # The tied weight's two gradients: the embedding's (a buffer of its own) takes the head's.
    tied = [n for n in _backward_adds(step, _aten.add_.Tensor) if n.args[0].target is _aten.embedding_dense_backward.default]
    assert len(tied) == 1
    assert len(_backward_adds(step, _aten.add.Tensor)) < len(_backward_adds(plain_step, _aten.add.Tensor))


def _graph(fn, *args) -> fx.GraphModule:
    gm = make_fx(fn)(*args)
    FakeTensorProp(gm).propagate(*args)
    gm.meta["example_inputs"] = args
    for node in gm.graph.nodes:
        node.meta["custom"] = {"phase": "backward"}
    return gm


def _ctx(backend=StepBackend.EAGER):
    return types.SimpleNamespace(backend=backend)


@pytest.fixture
def plain_propagation(monkeypatch):
    """These graphs have no compile context: the pass re-derives their shapes with a plain FakeTensorProp."""
    def propagate(gm, _ctx):
        FakeTensorProp(gm).propagate(*gm.meta["example_inputs"])
        return gm
    monkeypatch.setattr(module, "propagate_shapes", propagate)


def test_a_buffer_read_after_the_sum_is_not_written(plain_propagation):
    def fn(x, y):
        a, b = x * 2, y * 3
        return a + b, a  # a is read after the sum (an output): only b may take it

    x, y = torch.randn(4, 5), torch.randn(4, 5)
    expected = fn(x, y)
    gm = add_gradients_in_place(_graph(fn, x, y), _ctx())
    (summed,) = [n for n in gm.graph.nodes if n.target is _aten.add_.Tensor]
    assert summed.args[0].args[1] == 3  # b = y * 3
    assert all(torch.equal(a, b) for a, b in zip(gm(x, y), expected))


def test_nothing_is_written_when_both_operands_live_on_or_are_inputs(plain_propagation):
    def both_read_later(x, y):
        a, b = x * 2, y * 3
        return a + b, a, b

    def inputs(x, y):
        return x + y

    def broadcast(x, y):
        return x * 2 + y[0] * 3  # the sum is larger than the fresh operand

    x, y = torch.randn(4, 5), torch.randn(4, 5)
    for fn in (both_read_later, inputs, broadcast):
        gm = add_gradients_in_place(_graph(fn, x, y), _ctx())
        assert not any(n.target is _aten.add_.Tensor for n in gm.graph.nodes), fn.__name__


def test_inductor_graphs_are_left_as_traced(plain_propagation):
    def fn(x, y):
        return x * 2 + y * 3

    x, y = torch.randn(4, 5), torch.randn(4, 5)
    gm = add_gradients_in_place(_graph(fn, x, y), _ctx(StepBackend.INDUCTOR))
    assert any(n.target is _aten.add.Tensor for n in gm.graph.nodes)
    assert not any(n.target is _aten.add_.Tensor for n in gm.graph.nodes)
