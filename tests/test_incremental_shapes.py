"""Planning at scale: incremental shape propagation, lazy GraphModule code, positions by fx sort keys.

The compile pipeline re-derives shapes only where the passes changed the graph
(Note [incremental shapes] in compiler/ir/shapes.py). Every test here compares it
with a full `FakeTensorProp` of the same final graph: the same sizes, strides,
dtypes and storage sharing, node for node, so memory plans cannot change.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import torch
import torch.fx as fx

import shardlang as sl
from shardlang.cli.common import split_for_rank
from shardlang.compiler.compile import copy_graph_module
from shardlang.compiler.ir.graph_utils import positions
from shardlang.compiler.analysis.memory import plan_memory
from shardlang.compiler.ir.replicate import describe_graph
from shardlang.compiler.ir.shapes import full_propagation
from shardlang.cli.job import build, global_batch, load_job

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def layout(gm: fx.GraphModule) -> list:
    """Each node's value: per tensor its size, strides, offset, dtype, device, storage bytes and storage (numbered)."""
    return [(row[0], row[-1]) for row in describe_graph(gm.graph)]


def plan_example(name: str, world: int, evaluate: bool = False, **changes):
    job = load_job(str(EXAMPLES / name))
    spec = attrs.evolve(job.spec, **changes)
    example = split_for_rank(job, global_batch(job, 0), world, 0, 0)
    return sl.plan(lambda: build(job), job.loss_fn, spec, optimizer=job.optimizer, example_batch=example,
                   world_size=world, evaluate=evaluate)


def assert_same_as_full_propagation(compiled) -> None:
    full = full_propagation(copy_graph_module(compiled.graph_module), compiled.context)
    incremental, reference = layout(compiled.graph_module), layout(full)
    assert len(incremental) == len(reference)
    for mine, theirs in zip(incremental, reference):
        assert mine == theirs
    schedule = compiled.schedule
    assert plan_memory(compiled.graph_module, schedule, compiled.context.inputs).to_dict() == \
        plan_memory(full, schedule, compiled.context.inputs).to_dict()


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("recompute", [None, "full", "selective"])
def test_gpt_shapes_equal_a_full_propagation(world, recompute):
    rules = None if recompute is None else [("blocks.*", recompute)]
    assert_same_as_full_propagation(plan_example("gpt.py", world, recompute=rules))


@pytest.mark.parametrize("recompute", [None, "full"])
def test_llama_mixed_precision_shapes_equal_a_full_propagation(recompute):
    options = sl.Options(mixed_precision=sl.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    rules = None if recompute is None else [("layers.*", recompute)]
    assert_same_as_full_propagation(plan_example("llama.py", 4, recompute=rules, options=options))


@pytest.mark.parametrize("strategy", ["zero2", "zero1", "ddp"])
def test_strategies_and_training_features_equal_a_full_propagation(strategy):
    """Whole-flat placeholders (ZERO1, DDP), micro-batches and clipping change other nodes than ZeRO-3 does."""
    options = sl.Options(microbatches=2, clip_grad_norm=1.0)
    assert_same_as_full_propagation(plan_example("gpt.py", 2, strategies=[("blocks.*", strategy)], options=options))


def test_batch_norm_buffers_equal_a_full_propagation():
    assert_same_as_full_propagation(plan_example("bert.py", 2))


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("example", ["gpt.py", "bert.py"])
def test_evaluation_graph_shapes_equal_a_full_propagation(example, world):
    """The evaluation graph remembers its trace's shapes too: only the gathers and what reads them re-run."""
    assert_same_as_full_propagation(plan_example(example, world, evaluate=True))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_compiles_of_one_trace_equal_a_full_propagation_and_their_own_trace(monkeypatch, world):
    """Note [shape memo]: the memory budget's way, several option sets compiled in turn from one trace.

    Each compile, whose shapes come mostly from the memo the earlier ones
    filled, equals a full propagation of its graph node for node, and its
    memory plan, pooled as the chosen configuration is (Note [pool after the search]), equals that of the
    same options compiled from a trace of their own.
    """
    import shardlang.api as api
    from shardlang.compiler import with_buffer_pool
    from shardlang.spec.vocabulary import Recompute

    configurations = [({}, 1), ({"blocks.0": Recompute.FULL}, 1), ({"blocks.0": Recompute.FULL}, 2),
                      ({"blocks.0": Recompute.SELECTIVE, "blocks.1": Recompute.FULL}, 1), ({}, 2), ({}, 1)]
    compiled = []

    def every_configuration(budget, compile_at, units, **kwargs):
        compiled.extend(compile_at(recompute, depth) for recompute, depth in configurations)
        return compiled[0], None

    monkeypatch.setattr(api, "fit_budget", every_configuration)
    plan_example("gpt.py", world, options=sl.Options(memory_budget=2**40))
    assert len({id(step.traced) for step in compiled}) == 1  # one trace served them all
    for step, (recompute, depth) in zip(compiled, configurations):
        assert_same_as_full_propagation(step)
        rules = [(unit, policy.value) for unit, policy in recompute.items()] or None
        own = plan_example("gpt.py", world, recompute=rules, options=sl.Options(prefetch=depth))
        assert with_buffer_pool(step).memory.to_dict() == own.memory.to_dict(), (recompute, depth)


def test_lazy_code_is_the_code_a_recompile_writes():
    compiled = plan_example("gpt.py", 2)
    gm = compiled.graph_module
    assert gm.code == fx.GraphModule(gm, gm.graph).code


def test_positions_follow_the_graph_as_nodes_move():
    graph = fx.Graph()
    x = graph.placeholder("x")
    nodes = [graph.call_function(torch.neg, (x,)) for _ in range(6)]
    order = positions(graph)
    nodes[0].append(nodes[4])  # 0, 4, 1, 2, 3, 5
    with graph.inserting_before(nodes[2]):
        new = graph.call_function(torch.abs, (x,))
    listed = list(graph.nodes)
    assert sorted(listed, key=order.__getitem__) == listed
    assert order[nodes[4]] < order[nodes[1]] and order[nodes[1]] < order[new] < order[nodes[2]]
