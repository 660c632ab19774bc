"""Note [updates from member gradients]: at N = 1 the optimizer reads each member's gradient, not a packed copy.

One process, no process group: the rewritten step must train to the bit like
the step that packs (and so like one process, which tests/test_parity.py checks
at N = 1, 2 and 4), and the rewrite must happen exactly where every reader of
the packed gradient is an in-place elementwise op. The rewrite is a pass
(`passes.elide_local_reductions`), so the plan is read off the graph that runs.
"""

from __future__ import annotations

import functools
from unittest import mock

import pytest
import torch

import shardlang as sl
from shardlang import api
from shardlang.step.batch import split_batch
from shardlang.compiler.compile import compile_step
from shardlang.compiler.layout.flat import flatten_gradients, pack_gradients, pack_whole_gradients
from shardlang.compiler.layout.member_updates import update_members_
from shardlang.compiler.analysis.memory import plan_memory
from shardlang.compiler.passes.elide_local_reductions import elide_local_reductions
from shardlang.compiler.passes.pipeline import DEFAULT_PASSES

import parity
from models import CASES

STEPS = 3
PACKING = tuple(p for p in DEFAULT_PASSES if p is not elide_local_reductions)  # the pipeline without the rewrite


def _train(case_name: str, optimizer: str, rewrite: bool, strategy: str = "ZeRO3", **options):
    case = CASES[case_name]
    spec = sl.Spec(mesh=sl.Mesh(fsdp=1), units=case.units, options=sl.Options(**options),
                   strategies=[("*", getattr(sl, strategy))])
    patch = (mock.patch.object(api, "compile_step", functools.partial(compile_step, passes=PACKING)) if not rewrite
             else mock.MagicMock())
    with patch:
        step = sl.compile(case.build(torch.float64), case.loss_fn, spec, optimizer=parity.OPTIMIZERS[optimizer][0](),
                          example_batch=split_batch(case.make_batch(0, torch.float64), 1, 0), check_each_pass=True)
    losses = [float(step(case.make_batch(k, torch.float64))) for k in range(STEPS)]
    return step, losses, step.full_parameters()


def _targets(step) -> list:
    return [n.target for n in step.graph.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("strategy", ["ZeRO3", "ZeRO1", "DDP"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("case", ["gpt_tiny", "prime", "frozen"])
def test_member_updates_train_to_the_bit_like_packing(case, optimizer, strategy):
    packed_step, packed_losses, packed = _train(case, optimizer, rewrite=False, strategy=strategy)
    step, losses, params = _train(case, optimizer, rewrite=True, strategy=strategy)
    assert losses == packed_losses
    assert params.keys() == packed.keys()
    for name in params:
        assert torch.equal(params[name], packed[name]), name
    targets = _targets(step)
    if optimizer == "adamw":  # lerp_ and addcmul_ read the gradient: every pack goes
        assert update_members_ in targets
        assert not {pack_gradients, flatten_gradients, pack_whole_gradients} & set(targets)
    assert any(t in {pack_gradients, flatten_gradients, pack_whole_gradients} for t in _targets(packed_step))


def test_sgd_with_momentum_reads_member_gradients():
    """``buf.mul_(m).add_(grad)``: the in-place add reads each member's gradient."""
    step, _, _ = _train("mlp", "sgd", rewrite=True)  # parity's SGD has momentum 0.9
    assert update_members_ in _targets(step)
    assert pack_gradients not in _targets(step)


@pytest.mark.parametrize("options", [{"clip_grad_norm": 1.0}, {"skip_nonfinite": True}])
def test_other_readers_keep_the_pack(options):
    """A norm (clipping) or a functional select (skip_nonfinite) reads the whole flat gradient: it stays packed."""
    packed_step, packed_losses, packed = _train("gpt_tiny", "adamw", rewrite=False, **options)
    step, losses, params = _train("gpt_tiny", "adamw", rewrite=True, **options)
    assert losses == packed_losses
    assert all(torch.equal(params[n], packed[n]) for n in params)
    assert update_members_ not in _targets(step)
    assert _targets(step) == _targets(packed_step)  # nothing rewritten


def test_the_plan_describes_the_rewritten_step():
    """The schedule is read off the graph that runs: no pack, reduction or wait for a flat whose update reads
    member gradients, and the formulas and the verifier (run by compile) agree."""
    packed_step, _, _ = _train("gpt_tiny", "adamw", rewrite=False)
    step, _, _ = _train("gpt_tiny", "adamw", rewrite=True)
    assert step.graph is step.compiled.graph_module  # a world of one binds nothing: the plan's graph runs

    def kinds(s):
        return [op.kind.value for op in s.compiled.schedule.ops]
    assert "reduce_scatter" in kinds(packed_step)
    assert "reduce_scatter" not in kinds(step) and "all_reduce" not in kinds(step)
    assert kinds(step).count("wait") == kinds(packed_step).count("wait") - kinds(packed_step).count("reduce_scatter")
    summary = step.compiled.schedule.summary
    assert summary.bytes_per_rank["reduce_scatter"] == 0 < packed_step.compiled.schedule.summary.bytes_per_rank[
        "reduce_scatter"]
    # The memory plan counts the member gradients, alive until their updates, as gradients (not temporaries).
    compiled = step.compiled
    memory = plan_memory(compiled.graph_module, compiled.schedule, compiled.context.inputs)
    gradients = sum(p.numel() * p.element_size() for p in CASES["gpt_tiny"].build(torch.float64).parameters())
    assert max(op.breakdown.get("gradient_buffers", 0) for op in memory.ops) >= gradients


def test_rewritten_updates_keep_the_names_of_the_ops_they_replace():
    """Each `update_members_` node has the name of the in-place op it runs, so the N = 1 schedule's optimizer
    ops, and the ranges a profiled run names after them, name the same nodes as without the rewrite."""
    packed_step, _, _ = _train("gpt_tiny", "adamw", rewrite=False)
    step, _, _ = _train("gpt_tiny", "adamw", rewrite=True)
    packed = {n.name: n.target for n in packed_step.graph.graph.nodes}
    rewritten = [n for n in step.graph.graph.nodes if n.target is update_members_]
    assert rewritten
    assert all(packed.get(n.name) is n.args[0] for n in rewritten), [n.name for n in rewritten]

    def optimizer_nodes(s):
        return [op.node_names for op in s.compiled.schedule.ops if op.kind.value == "optimizer"]
    assert optimizer_nodes(step) == optimizer_nodes(packed_step)


def test_update_members_runs_the_op_on_each_slice():
    state = torch.arange(9.0)
    g0, g1 = torch.ones(2, 3), torch.full((3,), 2.0)
    expected = state.clone().lerp_(torch.cat([g0.reshape(-1), g1]), 0.5)
    out = update_members_(torch.ops.aten.lerp_.Scalar, ((0, 6), (6, 3)), ("flat", "grad", "same"), {}, 3,
                          state, None, 0.5, g0, g1)
    assert out is state
    assert torch.equal(state, expected)


def test_inductor_keeps_the_pack():
    """Under inductor the pack fuses into the update's kernels, while member updates would become one
    slice update of the whole flat per member (2.6x the eager step at 10M-latency, N = 1): the pass is eager only."""
    case = CASES["gpt_tiny"]

    def plan_targets(backend: str) -> set:
        spec = sl.Spec(mesh=sl.Mesh(fsdp=1), units=case.units, options=sl.Options(backend=backend))
        compiled = sl.plan(case.build(torch.float32), case.loss_fn, spec, example_batch=case.make_batch(0),
                           world_size=1)
        return {n.target for n in compiled.graph_module.graph.nodes if n.op == "call_function"}

    assert update_members_ in plan_targets("eager")
    inductor = plan_targets("inductor")
    assert update_members_ not in inductor
    assert {pack_gradients, flatten_gradients, pack_whole_gradients} & inductor
