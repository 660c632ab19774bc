"""Planning from a replicated trace (Note [replicated trace] in compiler/ir/replicate.py) is planning from the full trace.

The plan of a model with identical layers traces 3 and 4 of them and writes the
graph of all of them; every test here plans the same model both ways and
compares the traced graphs node for node (names, ops, arguments, tags, and per
value sizes, strides, dtype and storage sharing), the compiled graphs the same
way, the schedule text, the memory plan and the collective bytes. The fallback
tests build layers that only look identical and check that the full trace is used.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import models
import shardlang as sl
from shardlang.compiler.ir import replicate
from shardlang.compiler.ir.replicate import describe_graph
from tensor_parallel_workers import column, row

LAYERS = 6


def llama_case(layers: int = LAYERS):
    llama = models.load_llama_module()
    config = dataclasses.replace(llama.LlamaConfig(), n_layers=layers)
    return (lambda: llama.Llama(config)), llama.loss_fn, models.llama_batch(0), "layers.*"


def gpt_case(layers: int = LAYERS):  # its head is tied to the token embedding
    gpt = models.load_gpt_module()
    return (lambda: gpt.make_gpt(**{**models.GPT_TINY, "n_layer": layers})), models.gpt_loss, models.gpt_batch(0), \
        "blocks.*"


def plan_both(monkeypatch, case, world: int, recompute=None, budget=None, tp: int = 1, rules=None, **options):
    """(plan from the replicated trace, plan from the full trace) of one model and spec."""
    build, loss_fn, batch, units = case
    mesh = sl.Mesh(fsdp=world // tp, tp=tp) if tp > 1 else sl.Mesh(fsdp=world)
    spec = sl.Spec(mesh, rules=rules, units=[units], recompute=recompute,
                   options=sl.Options(memory_budget=budget, **options))
    rows = batch.shape[0] // (world // tp)
    plans = []
    for min_units in (5, 10**9):
        monkeypatch.setattr(replicate, "MIN_UNITS", min_units)
        plans.append(sl.plan(build, loss_fn, spec, example_batch=batch[:rows], world_size=world))
    return plans


def collective_bytes(compiled) -> list:
    collectives = (sl.OpKind.ALL_GATHER, sl.OpKind.REDUCE_SCATTER, sl.OpKind.ALL_REDUCE)
    return [(op.kind, op.bytes) for op in compiled.schedule.ops if op.kind in collectives]


def assert_same_plan(replicated, full) -> None:
    assert replicated.traced.replicated_from == 3 and full.traced.replicated_from is None
    assert describe_graph(replicated.traced.graph_module.graph) == describe_graph(full.traced.graph_module.graph)
    assert describe_graph(replicated.graph_module.graph) == describe_graph(full.graph_module.graph)
    assert replicated.traced.inputs == full.traced.inputs
    assert str(replicated.schedule) == str(full.schedule)
    assert replicated.schedule.to_json() == full.schedule.to_json()
    assert replicated.memory == full.memory
    assert collective_bytes(replicated) == collective_bytes(full) and collective_bytes(full)


@pytest.mark.parametrize("world,recompute", [(1, None), (2, [("layers.*", "full")]), (4, [("layers.*", "selective")])])
def test_llama_plan_from_replicated_trace(monkeypatch, world, recompute):
    assert_same_plan(*plan_both(monkeypatch, llama_case(), world, recompute))


def test_llama_plan_under_a_budget(monkeypatch):
    roomy, _ = plan_both(monkeypatch, llama_case(), 2)
    budget = int(roomy.memory.peak * 0.8)  # below the plan that keeps everything: the search recomputes
    replicated, full = plan_both(monkeypatch, llama_case(), 2, budget=budget)
    assert full.memory.peak <= budget
    assert_same_plan(replicated, full)


@pytest.mark.parametrize("world,recompute", [(1, None), (4, [("blocks.*", "full")])])
def test_gpt_with_tied_head_plan_from_replicated_trace(monkeypatch, world, recompute):
    assert_same_plan(*plan_both(monkeypatch, gpt_case(), world, recompute))


LLAMA_TP_RULES = [*column("*.wq.weight", "*.wk.weight", "*.wv.weight", "*.w1.weight", "*.w3.weight", "output.weight",
                          "tok_embeddings.weight"), *row("*.wo.weight", "*.w2.weight"), ("*", sl.shard("fsdp"))]


@pytest.mark.parametrize("world,tp,recompute", [(2, 2, None), (4, 2, [("layers.*", "full")])])
def test_a_tensor_axis_localizes_the_short_traces_and_plans_as_the_full_trace(monkeypatch, world, tp, recompute):
    """Sequence and loss parallelism and a vocabulary-parallel embedding: every tp collective is replicated too."""
    replicated, full = plan_both(monkeypatch, llama_case(), world, recompute, tp=tp, rules=LLAMA_TP_RULES,
                                 sequence_parallel=True, loss_parallel=True)
    assert_same_plan(replicated, full)
    assert full.traced.placements is not None and replicated.traced.placements is None
    assert any(op.kind is sl.OpKind.REDUCE_SCATTER and op.flat is None for op in full.schedule.ops)  # tp's


def test_too_few_layers_trace_in_full(monkeypatch):
    replicated, full = plan_both(monkeypatch, llama_case(layers=4), 2)
    assert replicated.traced.replicated_from is None
    assert str(replicated.schedule) == str(full.schedule)


class _Doubling(nn.Module):
    """Wraps a layer's feed-forward; doubles its output when ``twice`` (the code path differs, the parameters not)."""

    def __init__(self, inner: nn.Module, twice: bool):
        super().__init__()
        self.inner, self.twice = inner, twice

    def forward(self, x):
        out = self.inner(x)
        return out * 2 if self.twice else out


def _with_odd_layer(change):
    build, loss_fn, batch, units = llama_case()

    def odd():
        model = build()
        change(model.layers)
        return model
    return odd, loss_fn, batch, units


@pytest.mark.parametrize("change", [
    pytest.param(lambda layers: setattr(layers[5], "feed_forward", nn.Linear(64, 64, bias=False)), id="shape"),
    pytest.param(lambda layers: [setattr(layer, "feed_forward", _Doubling(layer.feed_forward, i == 5))
                                 for i, layer in enumerate(layers)], id="code-path"),
])
def test_layers_that_differ_trace_in_full(monkeypatch, change):
    replicated, full = plan_both(monkeypatch, _with_odd_layer(change), 2)
    assert replicated.traced.replicated_from is None
    assert describe_graph(replicated.traced.graph_module.graph) == describe_graph(full.traced.graph_module.graph)
    assert str(replicated.schedule) == str(full.schedule)


def test_a_model_that_treats_layers_by_index_fails_the_check_and_traces_in_full(monkeypatch):
    class Alternating(nn.Module):  # every other layer's output is scaled outside the layer: not periodic by one
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(LAYERS))

        def forward(self, x):
            for i, layer in enumerate(self.layers):
                x = layer(x) * (2.0 if i % 2 else 1.0)
            return x

    def loss_fn(model, batch):
        return model(batch).square().mean()

    calls = []
    original = replicate._replicated

    def spy(*args):
        calls.append(args[5])
        return original(*args)

    monkeypatch.setattr(replicate, "_replicated", spy)
    replicated, full = plan_both(monkeypatch, (Alternating, loss_fn, torch.ones(4, 8), "layers.*"), 1)
    assert calls == ["layers"]  # the layers looked identical: the check ran and refused
    assert replicated.traced.replicated_from is None
    assert describe_graph(replicated.traced.graph_module.graph) == describe_graph(full.traced.graph_module.graph)
