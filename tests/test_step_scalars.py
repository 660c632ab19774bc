"""Note [step scalars before inductor]: the optimizer's 0-d step arithmetic runs before the compiled graph.

One process, eager: the split graph plus its prologue must compute the step to
the bit, the graph handed to inductor must hold no 0-d arithmetic on the step
count or the learning rate (inductor would evaluate it once per vector of the
update's loop), and nothing that reads a value written in place may move.
"""

from __future__ import annotations

import torch
import torch.fx as fx

import shardlang as sl
from shardlang.compiler.lower.step_scalars import split_step_scalars

from models import CASES
from parity import OPTIMIZERS


def _step(optimizer: str):
    case = CASES["gpt_tiny"]
    torch.manual_seed(0)
    spec = sl.Spec(mesh=sl.Mesh(fsdp=1), units=case.units)
    return case, sl.compile(case.build(torch.float64), case.loss_fn, spec, optimizer=OPTIMIZERS[optimizer][0](),
                            example_batch=case.make_batch(0, torch.float64))


def _zero_d_arithmetic(gm: fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() == 0
            and n.all_input_nodes and all(a.op == "placeholder" for a in n.all_input_nodes)
            and not n.target._schema.is_mutable]


def test_adamw_step_scalars_move_to_the_prologue_and_the_step_is_the_same_to_the_bit():
    (case, eager), (_, other) = _step("adamw"), _step("adamw")
    split = split_step_scalars(other._graph, other._inputs(other.compiled, case.make_batch(0, torch.float64)))
    assert split is not None
    moved = {str(n.target) for n in other._graph.graph.nodes if n.name in split.moved}
    assert {"aten.pow.Scalar", "aten.sqrt.default"} <= moved
    assert "aten.pow.Scalar" not in {str(n.target) for n in split.graph_module.graph.nodes}
    assert not _zero_d_arithmetic(split.graph_module)

    for k in range(3):  # the step count advances in place: each step's prologue reads that step's count
        batch = case.make_batch(k, torch.float64)
        a, b = eager._inputs(eager.compiled, batch), other._inputs(other.compiled, batch)
        with torch.no_grad():
            loss_a = eager._graph(*a)
            loss_b = split.graph_module(*b, *split.prologue(*split.scalar_inputs(b)))
        assert torch.equal(loss_a, loss_b)
        for x, y in zip(eager.state.graph_inputs(), other.state.graph_inputs()):
            assert torch.equal(x, y)
    assert eager.state.graph_inputs() and float(other.step_count) == 3


def test_sgd_without_step_arithmetic_is_left_alone():
    case, step = _step("sgd")
    inputs = step._inputs(step.compiled, case.make_batch(0, torch.float64))
    split = split_step_scalars(step._graph, inputs)
    if split is not None:  # momentum's first-step test reads the count; whatever moves must be 0-d
        assert not _zero_d_arithmetic(split.graph_module)


def test_a_scalar_written_in_place_before_it_is_read_stays():
    def f(step, lr, x):
        a = step + 1  # before the write: movable
        step.add_(1)
        b = step * lr  # after the write: reads the new count, stays
        return x * a * b

    gm = fx.experimental.proxy_tensor.make_fx(f)(torch.tensor(0.0), torch.tensor(0.5), torch.ones(4))
    inputs = [torch.tensor(0.0), torch.tensor(0.5), torch.ones(4)]
    split = split_step_scalars(gm, inputs)
    assert split is not None and len(split.moved) == 1
    assert str(next(n for n in gm.graph.nodes if n.name == split.moved[0]).target) == "aten.add.Tensor"
    expected = gm(torch.tensor(0.0), torch.tensor(0.5), torch.ones(4))
    x = [torch.tensor(0.0), torch.tensor(0.5), torch.ones(4)]
    got = split.graph_module(*x, *split.prologue(*split.scalar_inputs(x)))
    assert torch.equal(expected, got) and x[0].item() == 1.0


def test_the_inductor_backend_compiles_the_graph_without_its_step_scalars():
    """compile_graph hands inductor the split graph; its runner adds the prologue's values (inductor mocked out)."""
    from unittest import mock

    from shardlang.compiler.lower.backend import compile_graph
    from shardlang.spec.vocabulary import StepBackend

    (case, eager), (_, other) = _step("adamw"), _step("adamw")
    handed = []

    def fake_compile_fx(gm, fakes, **kwargs):
        handed.append((gm, len(fakes)))
        return gm

    inputs = other._inputs(other.compiled, case.make_batch(0, torch.float64))
    with mock.patch("torch._inductor.compile_fx.compile_fx", fake_compile_fx):
        runner = compile_graph(other._graph, StepBackend.INDUCTOR, inputs)
    (gm, n_inputs), = handed
    assert "aten.pow.Scalar" not in {str(n.target) for n in gm.graph.nodes}
    assert n_inputs > len(inputs) and not _zero_d_arithmetic(gm)
    for k in range(2):
        batch = case.make_batch(k, torch.float64)
        with torch.no_grad():
            assert torch.equal(eager._graph(*eager._inputs(eager.compiled, batch)),
                               runner.run(*other._inputs(other.compiled, batch)))
    assert all(torch.equal(x, y) for x, y in zip(eager.state.graph_inputs(), other.state.graph_inputs()))
