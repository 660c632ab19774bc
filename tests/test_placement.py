"""Placement propagation on a tensor axis (compiler.placement): exact by simulation, Megatron's count, errors.

Each parity test traces a model's logical step once, places its parameters on
a ``tp`` axis, localizes the graph, and runs every rank of the axis in one
process (`simulate`) against the logical graph: same loss, and each rank's
flats and optimizer state the local blocks of the logical ones, after every step.
"""

from __future__ import annotations

import collections

import attrs
import hypothesis.strategies as st
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from torch import nn
from torch.utils import _pytree as pytree

import shardlang as sl
from models import CASES
from shardlang.compiler.ir import collectives
from shardlang.compiler.ir.trace import InputRole, Phase, phase_of
from shardlang.compiler.config import TensorAxis
from shardlang.compiler.placement.localize import localize
from shardlang.compiler.placement.placements import Partial, Replicate, Shard, local_shape
from shardlang.compiler.placement.propagate import propagate
from shardlang.compiler.placement.rules.views import dim_groups, reshape_shard_map
from shardlang.compiler.placement.simulate import simulate
from shardlang.compiler.placement.step import tensor_parallel_step
from shardlang.errors import CompileError

aten = torch.ops.aten

# Megatron's plan, written as placements of nn.Linear weights ((out, in)): column-parallel layers
# shard dim 0 (and their bias), row-parallel ones dim 1; the output head is column-parallel (vocab).
LLAMA_TP = {"wq": Shard(0), "wk": Shard(0), "wv": Shard(0), "wo": Shard(1),
            "w1": Shard(0), "w3": Shard(0), "w2": Shard(1), "output": Shard(0)}
GPT_TP = {"qkv": Shard(0), "fc": Shard(0), "attn.proj.weight": Shard(1), "mlp.proj.weight": Shard(1),
          "head": Shard(0)}


def seeds_for(model: nn.Module, table: dict) -> dict:
    """Member name -> placement, for every parameter whose name contains a key of ``table``."""
    seeds = {}
    for name, p in model.named_parameters():
        for key, placement in table.items():
            if key in name and not (isinstance(placement, Shard) and placement.dim >= p.dim()):
                seeds[name] = placement
    return seeds


def traced_step(case_name: str):
    """(traced step, logical parameters, global batch) of a test model in float64."""
    case = CASES[case_name]
    model = case.build(torch.float64)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    batch = case.make_batch(0, torch.float64)
    compiled = sl.plan(lambda: model, case.loss_fn, sl.Spec(sl.Mesh(fsdp=-1)), example_batch=batch, world_size=1)
    return compiled.traced, params, batch, seeds_for


def logical_inputs(traced, params, batch) -> list[torch.Tensor]:
    """What the logical step's placeholders receive at step 0: flats from ``params``, zero optimizer state."""
    graph = traced.graph_module.graph
    members = collections.defaultdict(list)
    for node in graph.nodes:
        member = node.meta.get("custom", {}).get("member")
        if member and node.target is aten.slice.Tensor:
            members[node.args[0].name].append((node.args[2], member))
    hyper = traced.optimizer.hyper()
    leaves = iter(pytree.tree_leaves(batch))
    values = []
    for node, spec in zip([n for n in graph.nodes if n.op == "placeholder"], traced.inputs):
        meta = node.meta["val"]
        if spec.role is InputRole.FLAT:
            values.append(torch.cat([params[m].reshape(-1) for _, m in sorted(members[node.name])]).clone())
        elif spec.role in (InputRole.STATE, InputRole.STEP):
            values.append(torch.zeros(meta.shape, dtype=meta.dtype))
        elif spec.role is InputRole.HYPER:
            values.append(torch.tensor(hyper[spec.name], dtype=meta.dtype))
        else:
            values.append(next(leaves).clone())
    return values


def run_parity(case_name: str, table: dict, n: int, steps: int = 2, sequence_dim: int | None = None,
               loss_parallel: bool = False, traced=None):
    """Train ``steps`` steps logically and simulated on ``n`` tp ranks; return the plan after asserting parity."""
    traced, params, batch = traced or traced_step(case_name)[:3]
    model = CASES[case_name].build(torch.float64) if case_name else None
    plan = propagate(traced, seeds_for(model, table) if model is not None else table, "tp", n, sequence_dim,
                     loss_parallel)
    local = localize(traced.graph_module, plan)
    logical = logical_inputs(traced, params, batch)
    flat_of = [spec.flat if spec.role in (InputRole.FLAT, InputRole.STATE) else None for spec in traced.inputs]
    ranks = [[plan.flats[f].local_block(v, r, n) if f else v.clone() for v, f in zip(logical, flat_of)]
             for r in range(n)]
    for _ in range(steps):
        expected = traced.graph_module(*logical)
        outputs = simulate(local, n, ranks)
        for r in range(n):
            torch.testing.assert_close(outputs[r], expected, rtol=1e-12, atol=1e-12)
            for want, have, f in zip(logical, ranks[r], flat_of):
                if f:
                    torch.testing.assert_close(have, plan.flats[f].local_block(want, r, n), rtol=1e-11, atol=1e-12)
    return plan, local, traced


@pytest.mark.parametrize("n", [1, 2, 4])
def test_llama_under_megatrons_placements_trains_like_the_logical_step(n):
    run_parity("llama_tiny", LLAMA_TP, n)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_gpt_with_a_fused_qkv_split_in_thirds_stays_exact(n):
    plan, _, traced = run_parity("gpt_tiny", GPT_TP, n)
    if n > 1:  # the thirds of a column-parallel qkv are not each rank's heads: the split gathers
        splits = [r for r in plan.redistributions if r.consumer.startswith("split")]
        assert splits and all(isinstance(r.source, Shard) and isinstance(r.target, Replicate) for r in splits)


def _collectives(local, kind, phase):
    return [node for node in local.graph.nodes if node.target is kind and phase_of(node) is phase]


def test_llama_plan_has_megatrons_count_of_all_reduces_per_block():
    plan, local, traced = run_parity("llama_tiny", LLAMA_TP, 2, steps=1)
    config = CASES["llama_tiny"].build().config
    b, s, h = 8, config.max_seq_len, config.dim
    forward = _collectives(local, collectives.all_reduce, Phase.FORWARD)
    backward = _collectives(local, collectives.all_reduce, Phase.BACKWARD)
    assert len(forward) == 2 * config.n_layers
    # 2 per block, and one for the gradient of the final norm's output (the vocab-parallel head's input)
    assert len(backward) == 2 * config.n_layers + 1
    reduced = {r.shape for r in plan.redistributions if isinstance(r.source, Partial)}
    assert reduced == {(b, s, h)}  # each all-reduce moves b*s*h elements of the local batch
    # every gradient comes out in its parameter's placement: none is made whole and then cut
    by_name = {node.name: node for node in traced.graph_module.graph.nodes}
    assert not [r for r in plan.redistributions if phase_of(by_name[r.consumer]) is Phase.OPTIMIZER]
    # the logits are gathered once for the loss; no parameter is ever moved
    gathers = _collectives(local, collectives.all_gather, Phase.FORWARD)
    assert len(gathers) == 1
    assert not _collectives(local, collectives.all_gather, Phase.BACKWARD)


@pytest.mark.parametrize("case_name, table", [("llama_tiny", LLAMA_TP), ("gpt_tiny", GPT_TP)])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_sequence_parallel_placements_train_like_the_logical_step(case_name, table, n):
    run_parity(case_name, table, n, sequence_dim=1)


def test_sequence_parallel_llama_reduce_scatters_and_gathers_where_megatron_all_reduces():
    plan, local, traced = run_parity("llama_tiny", LLAMA_TP, 2, steps=1, sequence_dim=1)
    config = CASES["llama_tiny"].build().config
    b, s, h = 8, config.max_seq_len, config.dim
    for phase in (Phase.FORWARD, Phase.BACKWARD):  # the activations between tp regions are sequence shards
        scattered = _collectives(local, collectives.reduce_scatter, phase)
        assert len(scattered) == 2 * config.n_layers + (phase is Phase.BACKWARD)  # + the head's input gradient
        assert all(tuple(node.args[0].meta["val"].shape) == (s, b, h) for node in scattered)  # sequence moved first
    # forward: a gather before each column-parallel product but the first block's attention (whose norm ran
    # on the embedding's whole output), one before the head, and the logits' for the loss
    assert len(_collectives(local, collectives.all_gather, Phase.FORWARD)) == 2 * config.n_layers + 1
    # backward: a gather of each row-parallel output's gradient; no activation is all-reduced
    assert len(_collectives(local, collectives.all_gather, Phase.BACKWARD)) == 2 * config.n_layers
    assert not [r for r in plan.redistributions if isinstance(r.source, Partial) and r.shape == (b, s, h)
                and isinstance(r.target, Replicate)]
    # the norms' weight gradients (partial: each rank saw its part of the sequence) are all-reduced over tp
    norms = {name for name, slot in _members(plan).items() if "norm" in name}
    assert len(norms) == 2 * config.n_layers + 1
    reduced = [r for r in plan.redistributions if isinstance(r.source, Partial) and isinstance(r.target, Replicate)]
    assert {r.shape[-1] for r in reduced} <= {h}, reduced  # weight-sized, never (b, s, h)


@pytest.mark.parametrize("sequence_dim", [None, 1])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_a_vocabulary_parallel_embedding_trains_like_the_logical_step(n, sequence_dim):
    run_parity("llama_tiny", dict(LLAMA_TP, tok_embeddings=Shard(0)), n, sequence_dim=sequence_dim)


def test_a_vocabulary_parallel_embedding_looks_up_in_its_rows_and_never_moves_the_table():
    plan, local, traced = run_parity("llama_tiny", dict(LLAMA_TP, tok_embeddings=Shard(0)), 2, steps=1)
    config = CASES["llama_tiny"].build().config
    b, s, h = 8, config.max_seq_len, config.dim
    # one all-reduce more than Megatron's forward: the partial lookups summed; backward is Megatron's
    assert len(_collectives(local, collectives.all_reduce, Phase.FORWARD)) == 2 * config.n_layers + 1
    assert len(_collectives(local, collectives.all_reduce, Phase.BACKWARD)) == 2 * config.n_layers + 1
    assert {r.shape for r in plan.redistributions if isinstance(r.source, Partial)} == {(b, s, h)}
    assert not [r for r in plan.redistributions if r.shape == (config.vocab_size, h)]  # the table stays put
    lookups = [node for node in local.graph.nodes if node.target is aten.embedding.default]
    assert [tuple(node.args[0].meta["val"].shape) for node in lookups] == [(config.vocab_size // 2, h)]
    sequence_parallel = propagate(traced, seeds_for(CASES["llama_tiny"].build(torch.float64),
                                                    dict(LLAMA_TP, tok_embeddings=Shard(0))), "tp", 2, 1)
    first = next(r for r in sequence_parallel.redistributions if isinstance(r.source, Partial))
    assert first.target == Shard(1)  # under sequence parallelism the lookups are reduce-scattered


@pytest.mark.parametrize("case_name, table", [("llama_tiny", LLAMA_TP), ("gpt_tiny", GPT_TP)])
@pytest.mark.parametrize("n, sequence_dim", [(1, None), (2, None), (4, None), (2, 1)])
def test_loss_parallel_trains_like_the_logical_step(case_name, table, n, sequence_dim):
    run_parity(case_name, table, n, sequence_dim=sequence_dim, loss_parallel=True)


def test_loss_parallel_never_moves_the_logits_only_their_rows_statistics():
    plan, local, traced = run_parity("llama_tiny", LLAMA_TP, 2, steps=1, loss_parallel=True)
    config = CASES["llama_tiny"].build().config
    b, s, h = 8, config.max_seq_len, config.dim
    # the logits (as the loss reads them, (b*s, V)) and their gradient stay split: without loss parallelism
    assert not [r for r in plan.redistributions if r.shape == (b * s, config.vocab_size)]  # one gather, two cuts
    forward_reduces = _collectives(local, collectives.all_reduce, Phase.FORWARD)
    # Megatron's, the rows' sums of exponentials, and the loss (each rank's sum over the targets in its rows)
    assert len(forward_reduces) == 2 * config.n_layers + 2
    (row_max,) = _collectives(local, collectives.all_gather, Phase.FORWARD)  # each rank's row maxima
    assert tuple(row_max.args[0].meta["val"].shape) == (b * s, 1)
    backward_reduces = _collectives(local, collectives.all_reduce, Phase.BACKWARD)
    assert len(backward_reduces) == 2 * config.n_layers + 2  # + the log-softmax gradient's row sums
    assert {tuple(node.args[0].meta["val"].shape) for node in forward_reduces + backward_reduces} == {
        (b, s, h), (b * s, 1), ()}


class _TwoReaders(nn.Module):
    """A column-parallel head whose log-softmax has a reader besides the loss (pytorch#190746's case)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.head = nn.Linear(8, 12)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def _two_readers_loss(model, batch):
    x, y = batch
    logits = model(x)
    entropy = -(F.log_softmax(logits, -1).exp() * F.log_softmax(logits, -1)).sum(-1).mean()
    return F.cross_entropy(logits, y) + 0.1 * entropy


def test_loss_parallel_keeps_every_other_reader_of_the_log_softmax_exact():
    torch.manual_seed(0)
    model = _TwoReaders().double()
    batch = (torch.randn(10, 6, dtype=torch.float64), torch.randint(0, 12, (10,)))
    compiled = sl.plan(lambda: model, _two_readers_loss, sl.Spec(sl.Mesh(fsdp=-1)), example_batch=batch,
                       world_size=1)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    for n in (2, 4):
        plan, _, _ = run_parity(None, {"head.weight": Shard(0), "head.bias": Shard(0)}, n, loss_parallel=True,
                                traced=(compiled.traced, params, batch))
        logits = [node for node in compiled.traced.graph_module.graph.nodes if node.target is aten._log_softmax.default]
        assert len(logits) >= 2 and all(plan.placement(node) == Shard(1) for node in logits)


def test_loss_parallel_refuses_logits_that_reach_the_loss_whole():
    traced, _, _, _ = traced_step("llama_tiny")
    model = CASES["llama_tiny"].build(torch.float64)
    axis = TensorAxis("tp", 2, 1, {k: v for k, v in seeds_for(model, LLAMA_TP).items() if k != "output.weight"},
                      loss_parallel=True)
    with pytest.raises(CompileError, match=r"loss_parallel.*reach nll_loss_forward as Replicate\(\), not split by "
                                           r"vocabulary; split the output head's weight"):
        tensor_parallel_step(traced, axis)


def _members(plan) -> dict:
    return {slot.name: slot for layout in plan.flats.values() for slot in layout.members}


def test_sequence_parallel_refuses_a_sequence_the_axis_does_not_divide():
    case = CASES["llama_tiny"]
    model = case.build(torch.float64)
    batch = case.make_batch(0, torch.float64)[:, :32]  # 31 tokens in, 31 targets: 2 ranks do not split it
    compiled = sl.plan(lambda: model, case.loss_fn, sl.Spec(sl.Mesh(fsdp=-1)), example_batch=batch, world_size=1)
    axis = TensorAxis("tp", 2, 1, seeds_for(model, LLAMA_TP), sequence_parallel=True)
    with pytest.raises(CompileError, match=r"(?s)sequence_parallel.*tp=2.*shape \[8, 31, 64\].*sequence length 31, "
                                           r"which is not a multiple of 2.*made at .*llama\.py:"):
        tensor_parallel_step(compiled.traced, axis)
    tensor_parallel_step(compiled.traced, attrs.evolve(axis, sequence_parallel=False))  # exact without it


def test_every_value_has_a_placement():
    traced, _, _, _ = traced_step("llama_tiny")
    model = CASES["llama_tiny"].build(torch.float64)
    plan = propagate(traced, seeds_for(model, LLAMA_TP), "tp", 2)
    values = [n for n in traced.graph_module.graph.nodes if n.op in ("placeholder", "call_function")]
    assert all(n.name in plan.placements for n in values)
    assert plan.placement("view_2") == Shard(0)  # layers.0.attention.wq.weight, viewed out of its flat


def test_a_shard_dim_out_of_range_names_the_parameter():
    traced, _, _, _ = traced_step("llama_tiny")
    with pytest.raises(CompileError, match=r"'layers\.0\.attention_norm\.weight' has shape \[64\].*dim 1"):
        propagate(traced, {"layers.0.attention_norm.weight": Shard(1)}, "tp", 2)


def test_a_shard_the_axis_does_not_divide_names_the_sizes():
    traced, _, _, _ = traced_step("llama_tiny")
    with pytest.raises(CompileError, match=r"'layers\.0\.feed_forward\.w1\.weight': dim 0 has size 160, which 3"):
        propagate(traced, {"layers.0.feed_forward.w1.weight": Shard(0)}, "tp", 3)


class _Cumulative(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)

    def forward(self, x):
        return torch.cumsum(self.fc(x), dim=1)


def test_an_op_without_a_rule_on_a_shard_is_an_error_naming_it_and_its_line():
    model = _Cumulative().double()
    batch = torch.randn(2, 4, dtype=torch.float64)
    compiled = sl.plan(lambda: model, lambda m, x: m(x).square().mean(), sl.Spec(sl.Mesh(fsdp=-1)),
                       example_batch=batch, world_size=1)
    with pytest.raises(CompileError, match=r"(?s)aten\.cumsum.*Shard\(1\).*no sharding rule.*torch\.cumsum"):
        propagate(compiled.traced, {"fc.weight": Shard(0), "fc.bias": Shard(0)}, "tp", 2)
    propagate(compiled.traced, {}, "tp", 2)  # replicated, it runs without a rule


def test_dim_groups_pair_runs_of_equal_size():
    assert dim_groups((8, 32, 64), (8, 32, 4, 16)) == [([0], [0]), ([1], [1]), ([2], [2, 3])]
    assert dim_groups((8, 4, 32, 16), (8, 4, 32, 8, 2)) == [([0], [0]), ([1], [1]), ([2], [2]), ([3], [3, 4])]
    assert reshape_shard_map((8, 32, 64), (8, 32, 4, 16), 2) == {0: 0, 1: 1, 2: 2}
    assert reshape_shard_map((8, 32, 64), (8, 32, 4, 16), 8) == {0: 0, 1: 1}  # 4 heads, 8 ranks


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([1, 2, 3, 4, 6]), min_size=1, max_size=4), st.data(), st.sampled_from([2, 3]))
def test_a_mapped_shard_is_the_same_block_after_the_reshape(source, data, n):
    """Whatever reshape_shard_map keeps, each rank's block reshaped locally is its block of the reshaped tensor."""
    numel = torch.Size(source).numel()
    target = data.draw(st.permutations(source).map(tuple) | st.just((numel,)))
    x = torch.arange(numel).reshape(source)
    y = x.reshape(target)
    for d, o in reshape_shard_map(tuple(source), target, n).items():
        for r in range(n):
            block = x.chunk(n, d)[r].reshape(local_shape(target, Shard(o), n))
            assert torch.equal(block, y.chunk(n, o)[r])
