"""The bound step: in-place updates, effects kept in the graph, the start-up schedule check."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

import shardlang as sl
from shardlang.compiler.ir import collectives

import step_workers


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def mse(model, batch):
    return (model(batch[0]) - batch[1]).pow(2).mean()


BATCH = (torch.randn(4, 4), torch.randn(4, 2))


def test_update_happens_in_place():
    """Parameters and optimizer state are updated where they live: nothing is held twice."""
    step = sl.compile(mlp(), mse, sl.Spec(sl.Mesh(fsdp=1)), optimizer=sl.AdamW(lr=1e-2), example_batch=BATCH)
    tensors = step.flat_tensors + step.optimizer_state
    pointers = [t.data_ptr() for t in tensors]
    before = [t.clone() for t in tensors]
    step(BATCH)
    assert [t.data_ptr() for t in tensors] == pointers
    assert all(not torch.equal(a, b) for a, b in zip(before, tensors))
    assert step.steps_done == 1


def test_dead_code_elimination_keeps_collectives():
    graph = fx.Graph()
    shard = graph.placeholder("shard")
    issued = graph.call_function(collectives.all_gather, (shard, "fsdp", 2))
    graph.call_function(collectives.wait, (issued,))
    graph.call_function(torch.ops.aten.relu.default, (shard,))  # pure and unused: goes
    graph.output(shard)
    collectives.eliminate_dead_code(graph)
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert targets == [collectives.all_gather, collectives.wait]


def test_load_into_returns_the_trained_model():
    model = mlp()
    step = sl.compile(model, mse, sl.Spec(sl.Mesh(fsdp=1)), optimizer=sl.SGD(lr=0.1), example_batch=BATCH)
    step(BATCH)
    fresh = mlp()
    step.load_into(fresh)
    for name, p in fresh.named_parameters():
        assert torch.equal(p, step.full_parameters()[name])
    assert not torch.equal(fresh[0].weight, mlp()[0].weight)


def test_ranks_with_different_schedules_fail_naming_them(run_on):
    messages = run_on(4, step_workers.compile_with_rank_dependent_model)
    for message in messages:
        assert message is not None
        assert "ranks [1] have schedule" in message and "ranks [0, 2, 3] have schedule" in message
