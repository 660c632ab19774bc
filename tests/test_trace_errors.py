"""Trace and compile errors name the user's file:line, the module (its name in named_modules()) and what to do.

Each bad line below carries a ``# site: NAME`` comment; the tests look its
line number up, so they check the exact line the error points at.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from torch import nn

import shardlang as sl
from shardlang.compiler.compile import compile_step
from shardlang.compiler.passes.pipeline import DEFAULT_PASSES
from shardlang.compiler.ir.trace import Phase, phase_of

HERE = pathlib.Path(__file__)
SOURCE = HERE.read_text().splitlines()


def site(name: str) -> str:
    """``file:line`` of the line marked ``# site: name`` in this file."""
    (line,) = [i for i, text in enumerate(SOURCE, 1) if text.rstrip().endswith(f"# site: {name}")]
    return f"{HERE}:{line}"


@torch.library.custom_op("sl_errors_test::no_fake", mutates_args=())
def no_fake(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@torch.library.custom_op("sl_errors_test::no_backward", mutates_args=())
def no_backward(x: torch.Tensor) -> torch.Tensor:
    return x * 3


@no_backward.register_fake
def _(x):
    return torch.empty_like(x)


class Item(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * x.abs().max().item()  # site: item


class Branch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        if h.sum() > 0:  # site: branch
            return h
        return -h


class MaskIndex(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return h + h[h > 0].sum()  # site: mask


class ParamInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        self.lin.weight.mul_(0.5)  # site: param_inplace
        return self.lin(x)


class Overwrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = torch.exp(self.lin(x))
        h.mul_(2)  # site: overwrite
        return h


class NoFake(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return no_fake(self.lin(x))  # site: no_fake


class NoBackward(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return no_backward(self.lin(x))  # site: no_backward


class Numpy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * float(x.detach().numpy().mean())  # site: numpy


class ClampInPlace(nn.Module):
    """Weight clipping inside forward: lost on more than one rank, so refused."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            self.lin.weight.clamp_(-0.1, 0.1)  # site: clamp
        return self.lin(x)


class Noise(nn.Module):
    def forward(self, x):
        return x + torch.rand_like(x)  # site: rand


class Net(nn.Module):
    """``blocks.1`` is the block under test."""

    def __init__(self, block: nn.Module):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.ReLU()), block])
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)  # site: relu
        return self.head(h)


def mse(model, batch):
    x, y = batch
    return (model(x) - y).pow(2).mean()


BATCH = (torch.randn(6, 4), torch.randn(6, 2))
SPEC = sl.Spec(sl.Mesh(fsdp=1))


def compile_(model, loss_fn=mse, spec=SPEC):
    return sl.compile(model, loss_fn, spec, optimizer=sl.SGD(lr=0.1), example_batch=BATCH)


@pytest.mark.parametrize(
    "block, name, cause, advice",
    [
        (Item, "item", "DataDependentOutputException", ".item(), .tolist()"),
        (Branch, "branch", "DataDependentOutputException", "Keep the decision in tensor ops"),
        (MaskIndex, "mask", "DynamicOutputShapeException", "Use a fixed-shape form"),
        (ParamInPlace, "param_inplace", "leaf Variable", "compute a new tensor instead (w = w * s)"),
        (Overwrite, "overwrite", "modified by an inplace operation", "Use the out-of-place form"),
        (NoFake, "no_fake", "no fake impl", "torch.library.register_fake"),
        (NoBackward, "no_backward", "no autograd formula", "torch.autograd.Function with a backward"),
        (Numpy, "numpy", ".numpy()", "Keep the computation in torch ops"),
    ],
    ids=lambda v: v if isinstance(v, str) and v.isidentifier() else None,
)
def test_trace_failure_names_the_line_the_module_and_what_to_do(block, name, cause, advice):
    with pytest.raises(sl.TraceError) as err:
        compile_(Net(block()))
    message = str(err.value)
    assert f"at {site(name)} in forward, module 'blocks.1' ({block.__name__})" in message
    assert cause in message
    assert "\nwhat to do: " in message and advice in message.split("\nwhat to do: ", 1)[1]
    assert err.value.site.module == "blocks.1" and err.value.site.line == int(site(name).rsplit(":", 1)[1])


class DropPathNet(nn.Module):
    """A timm-style model: its __init__ reads tensor values (drop-path rates), fine in eager, not under a tracer."""

    def __init__(self):
        super().__init__()
        rates = [r.item() for r in torch.linspace(0, 0.1, 2)]  # site: drop_path
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in rates])
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_model_built_inside_loss_fn_is_named_with_its_line():
    """The issue's example: the model's __init__ ran under the tracer and failed on _local_scalar_dense."""

    def loss_fn(model, batch):
        x, y = batch
        teacher = DropPathNet()  # site: built_failing
        return (model(x) - teacher(x)).pow(2).mean()

    with pytest.raises(sl.TraceError) as err:
        compile_(Net(nn.Identity()), loss_fn)
    message = str(err.value)
    assert "DataDependentOutputException: aten._local_scalar_dense.default" in message
    assert f"failed at {site('drop_path')} in <listcomp>, outside the model's modules" in message
    assert "what to do: build modules once, outside loss_fn" in message
    assert f"A DropPathNet was built while the step was being traced, at {site('built_failing')} in loss_fn, " \
           "outside the model's modules" in message


def test_module_built_inside_loss_fn_is_refused_even_when_tracing_succeeds():
    """Silently wrong otherwise: a module made under the tracer gets fresh random weights at every step."""

    def loss_fn(model, batch):
        x, y = batch
        projection = nn.Linear(2, 2)  # site: built
        return (projection(model(x)) - y).pow(2).mean()

    with pytest.raises(sl.TraceError) as err:
        compile_(Net(nn.Identity()), loss_fn)
    message = str(err.value)
    assert f"A Linear (parameters 'weight', 'bias') was built while the step was being traced, at " \
           f"{site('built')} in loss_fn, outside the model's modules" in message
    assert "what to do: build modules once, outside loss_fn" in message


def test_parameter_changed_in_place_under_no_grad_is_refused():
    with pytest.raises(sl.TraceError) as err:
        compile_(Net(ClampInPlace()))
    message = str(err.value)
    assert "changes parameter 'blocks.1.lin.weight' in place with aten.clamp_.default" in message
    assert f"at {site('clamp')} in forward, module 'blocks.1' (ClampInPlace)" in message
    assert "what to do: inside the step a parameter is a view of a gathered copy" in message


def test_batch_changed_in_place_is_refused():
    def loss_fn(model, batch):
        x, y = batch
        x.mul_(2)  # site: batch_inplace
        return (model(x) - y).pow(2).mean()

    with pytest.raises(sl.TraceError) as err:
        compile_(Net(nn.Identity()), loss_fn)
    message = str(err.value)
    assert f"changes batch leaf 0 in place with aten.mul_.Tensor (node mul_) at {site('batch_inplace')} in loss_fn, " \
           "outside the model's modules" in message
    assert "what to do: shardlang splits the batch over ranks" in message


def test_random_op_under_global_randomness_names_its_line_and_module():
    spec = sl.Spec(sl.Mesh(fsdp=1), options=sl.Options(random="global"))
    with pytest.raises(sl.TraceError) as err:
        compile_(Net(Noise()), spec=spec)
    message = str(err.value)
    assert f"at {site('rand')} in forward, module 'blocks.1' (Noise)" in message
    assert "Use Options(random='per_rank')" in message


def test_pass_failure_names_the_user_line_of_the_node_it_failed_on():
    """A pass that breaks on a node reports the node's user line and module, after the pass's name."""

    def picky(gm, ctx):
        for node in gm.graph.nodes:
            if phase_of(node) is Phase.FORWARD and node.target is torch.ops.aten.relu.default:
                raise ValueError(f"cannot handle {node.name}")
        return gm

    model = Net(nn.Identity())
    resolved = SPEC.resolve(model, 1)
    with pytest.raises(sl.CompileError) as err:
        compile_step(model, mse, resolved.config, sl.SGD(lr=0.1), BATCH,
                     passes=(*DEFAULT_PASSES[:1], picky))
    message = str(err.value)
    assert message.startswith(f"pass picky failed after ['{DEFAULT_PASSES[0].__name__}'], on the op made at ")
    assert f"{site('relu')} in forward, module 'blocks.0.1' (ReLU)" in message
    assert "ValueError: cannot handle relu" in message
    assert err.value.pass_name == "picky" and err.value.site.module == "blocks.0.1"
