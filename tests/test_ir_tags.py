"""The compiler's typed IR: every inserted node carries a frozen `NodeTag`, and the pass pipeline checks its order.

`verify_tags` must catch a tag that breaks its invariants (a collective with no
wait, a wait of another kind, an unknown flat parameter, a node without a
phase); the pipeline must refuse an order whose contracts do not hold, naming
the pass, the property and the passes before it.
"""

from __future__ import annotations

import attrs
import pytest
import torch
import torch.nn as nn

import shardlang as sl
from shardlang.compiler.compile import compile_step
from shardlang.compiler.ir import collectives
from shardlang.compiler.ir.tags import NodeKind, NodeTag, kind_of, node_tag, verify_tags
from shardlang.compiler.passes.contract import GraphProperty, contract_of, order_error
from shardlang.compiler.passes.gather_parameters import gather_parameters
from shardlang.compiler.passes.pipeline import DEFAULT_PASSES
from shardlang.compiler.passes.recompute_activations import recompute_activations
from shardlang.compiler.passes.reshard_after_forward import reshard_after_forward
from shardlang.compiler.passes.prefetch_gathers import prefetch_gathers

SPEC = sl.Spec(sl.Mesh(fsdp=-1), units=["blocks.*"])


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Sequential(nn.Linear(16, 16), nn.ReLU()), nn.Linear(16, 1))


def _compiled(world=2, **kwargs):
    model = _model()
    spec = sl.Spec(sl.Mesh(fsdp=-1), units=["1"])
    resolved = spec.resolve(model, world)
    batch = (torch.randn(4, 8), torch.randn(4, 1))
    return compile_step(model, lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(), resolved.config,
                        sl.AdamW(lr=1e-3), batch, **kwargs)


def _flat_names(compiled):
    return [f.name for f in compiled.flats]


def test_every_inserted_node_carries_a_node_tag_and_the_final_graph_verifies():
    compiled = _compiled()
    tags = [node_tag(n) for n in compiled.graph_module.graph.nodes if node_tag(n) is not None]
    kinds = {t.kind for t in tags}
    assert all(isinstance(t, NodeTag) for t in tags)
    assert {NodeKind.ALL_GATHER, NodeKind.WAIT_GATHER, NodeKind.FREE, NodeKind.REDUCE_SCATTER,
            NodeKind.WAIT_REDUCE, NodeKind.PACK, NodeKind.AVERAGE} <= kinds
    verify_tags(compiled.graph_module.graph, _flat_names(compiled))


def test_a_tag_kind_must_be_a_node_kind():
    with pytest.raises(TypeError):
        NodeTag("all_gather", "x")


def _first(graph, kind):
    return next(n for n in graph.nodes if kind_of(n) is kind)


@pytest.mark.parametrize("breakage, message", [
    ("unknown flat", "names flat parameter 'nowhere', which this step lacks"),
    ("no phase", "has no phase"),
    ("wrong wait", "which is not a collective of its kind"),
    ("no wait", "is waited for 0 times"),
    ("not a tag", "not a NodeTag"),
])
def test_verify_tags_names_the_node_that_breaks_an_invariant(breakage, message):
    graph = _compiled().graph_module.graph
    gather = _first(graph, NodeKind.ALL_GATHER)
    wait = next(u for u in gather.users if kind_of(u) is NodeKind.WAIT_GATHER)
    if breakage == "unknown flat":
        gather.meta["sl"] = attrs.evolve(node_tag(gather), flat="nowhere")
    elif breakage == "no phase":
        gather.meta["custom"] = {}
    elif breakage == "wrong wait":  # a "wait" whose input is no collective
        wait = _first(graph, NodeKind.FREE)
        wait.meta["sl"] = attrs.evolve(node_tag(wait), kind=NodeKind.WAIT_REDUCE)
    elif breakage == "no wait":
        wait.meta["sl"] = attrs.evolve(node_tag(wait), kind=NodeKind.CLIP)
    else:
        gather.meta["sl"] = {"kind": "all_gather", "flat": node_tag(gather).flat}
    with pytest.raises(sl.CompileError, match=message) as err:
        verify_tags(graph, [f for f in (node_tag(n).flat for n in graph.nodes if node_tag(n) is not None
                                        and isinstance(node_tag(n), NodeTag)) if f != "nowhere"])
    assert (gather.name in str(err.value)) or (wait.name in str(err.value))


def test_the_default_pipeline_meets_every_contract_and_each_pass_declares_one():
    assert order_error(DEFAULT_PASSES) is None
    for p in DEFAULT_PASSES:
        assert contract_of(p).establishes, f"{p.__name__} declares nothing"


def test_a_pass_before_its_requirement_is_refused_naming_the_pass_and_those_before_it():
    error = order_error((reshard_after_forward, gather_parameters))
    assert error == ("pass reshard_after_forward requires that every sharded flat parameter is gathered before its "
                     "first forward use, which no pass before it establishes (passes before: [])")
    with pytest.raises(sl.CompileError, match="pass prefetch_gathers requires that every gathered buffer is freed"):
        _compiled(passes=(gather_parameters, prefetch_gathers))


def test_a_pass_that_would_break_an_earlier_one_is_refused():
    error = order_error((gather_parameters, reshard_after_forward, recompute_activations))
    assert error.startswith("pass recompute_activations must run before reshard_after_forward: it would break that "
                            f"{GraphProperty.GATHERS_FREED.value}")
    assert error.endswith("(passes before: ['gather_parameters', 'reshard_after_forward'])")


def test_a_pass_without_a_contract_runs_anywhere_and_each_pass_is_checked_when_asked():
    seen = []

    def count_collectives(gm, ctx):
        seen.append(sum(collectives.group_of(n) is not None for n in gm.graph.nodes))
        return gm

    compiled = _compiled(passes=(*DEFAULT_PASSES[:2], count_collectives, *DEFAULT_PASSES[2:]), check_each_pass=True)
    assert seen and seen[0] > 0
    verify_tags(compiled.graph_module.graph, _flat_names(compiled))


def test_a_pass_that_leaves_a_broken_tag_is_named_when_each_pass_is_checked():
    def drop_a_wait_tag(gm, ctx):
        wait = _first(gm.graph, NodeKind.WAIT_GATHER)
        del wait.meta["sl"]
        return gm

    with pytest.raises(sl.CompileError, match=r"pass drop_a_wait_tag failed after \[.*gather_parameters.*\]"):
        _compiled(passes=(*DEFAULT_PASSES[:2], drop_a_wait_tag, *DEFAULT_PASSES[2:]), check_each_pass=True)
