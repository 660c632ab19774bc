"""The inductor backend: ``Options(backend="inductor")`` trains exactly like one process, collectives included.

Inductor compiles on the CPU with a C++ compiler, tens of seconds per graph on
two busy cores, so these tests use the smallest case (``mlp``: three Linear
layers) and few compiles: one per world size (at N = 2 with one unit per layer,
so that there is overlap to keep), plus ZeRO-1 (whose all-gather writes into
its input in place) and float32 at N = 2. Repeated runs
are faster: inductor's FX graph cache keeps the kernels (`compiler.lower.backend`).
"""

from __future__ import annotations

import pytest
import torch

import inductor_workers
import parity
import shardlang as sl
from shardlang.spec.vocabulary import StepBackend
from shardlang.compiler.analysis.cost import CostModel, plan_fusion
from shardlang.errors import SpecError

STEPS = 3
INDUCTOR = {"backend": "inductor"}


@pytest.mark.parametrize("world_size", [1, 4])
def test_inductor_step_matches_one_process_in_float64(run_on, references, world_size):
    results = run_on(world_size, parity.train_sharded, "mlp", "adamw", "float64", STEPS, INDUCTOR)
    ref_losses, ref_params, _ = references("mlp", "adamw")
    for rank, (losses, params, _buffers, _schedule) in enumerate(results):
        assert parity.max_relative_difference(params, ref_params) < 1e-9, f"rank {rank}"
    for k in range(STEPS):
        assert sum(r[0][k] for r in results) / world_size == pytest.approx(ref_losses[k], rel=1e-12)


def test_inductor_keeps_the_schedules_overlap_and_matches_one_process(run_on, references):
    """One unit per layer, so the schedule prefetches the next layer's gather and waits for each reduce-scatter
    after the next layer's backward; inductor runs no collective with less compute under it than the schedule."""
    results = run_on(2, inductor_workers.train_with_order, "mlp", "float64", STEPS, ("fc1", "fc2", "fc3"))
    ref_losses, ref_params, _ = references("mlp", "adamw")
    for rank, (losses, params, scheduled, compiled) in enumerate(results):
        assert parity.max_relative_difference(params, ref_params) < 1e-9, f"rank {rank}"
        assert len(compiled) == len(scheduled) and sum(scheduled) > 0, (scheduled, compiled)
        assert all(c >= s for c, s in zip(compiled, scheduled)), f"rank {rank}: matmuls under each collective, " \
            f"scheduled {scheduled}, compiled {compiled}"
    for k in range(STEPS):
        assert sum(r[0][k] for r in results) / 2 == pytest.approx(ref_losses[k], rel=1e-12)


def test_inductor_zero1_matches_one_process(run_on, references):
    """ZeRO-1's all-gather writes the updated slices into the whole flat parameter in place: inductor keeps that.
    Each rank's graph updates its own slice (a different offset), so the ranks compile at once, not in turn."""
    results = run_on(2, parity.train_sharded, "mlp", "adamw", "float64", STEPS, INDUCTOR, None, [("*", "ZeRO1")])
    _, ref_params, _ = references("mlp", "adamw")
    assert parity.max_relative_difference(results[0][1], ref_params) < 1e-9


# float32: inductor's fused kernels reassociate (vectorised sums in the matmul
# epilogues and reductions, fused multiply-adds in AdamW), so the compiled step
# rounds differently from the eager one. The yardstick is the one the eager
# float32 parity test uses (tests/test_parity.py): no further from the float64
# result than twice one process's own float32 error, and within 1e-3 of the
# float32 reference, where a real bug (a missing 1/N, a wrong shard) is 1e-1.
def test_inductor_float32_is_as_accurate_as_one_process(run_on, references):
    results = run_on(2, parity.train_sharded, "mlp", "adamw", "float32", STEPS, INDUCTOR)
    _, ref32, _ = references("mlp", "adamw", "float32")
    _, ref64, _ = references("mlp", "adamw", "float64")
    as_double = lambda params: {k: v.double() for k, v in params.items()}  # noqa: E731
    torch_error = parity.max_relative_difference(as_double(ref32), ref64)
    compiled_error = parity.max_relative_difference(as_double(results[0][1]), ref64)
    assert compiled_error <= max(2 * torch_error, 1e-6)
    assert parity.max_relative_difference(results[0][1], ref32) < 1e-3


def test_backend_option_round_trips_through_toml_and_rejects_unknown_names(tmp_path):
    spec = sl.Spec(sl.Mesh(fsdp=2), options=sl.Options(backend="inductor"))
    assert spec.options.backend is StepBackend.INDUCTOR
    (tmp_path / "spec.toml").write_text(spec.to_toml())
    assert 'backend = "inductor"' in spec.to_toml()
    assert sl.Spec.from_toml(tmp_path / "spec.toml").options == spec.options
    assert "backend" not in sl.Options().to_dict()
    with pytest.raises(SpecError, match="Options.backend is 'xla'.*'eager', 'inductor'"):
        sl.Options(backend="xla")


def test_cost_model_counts_fused_compute_once():
    """Under fusion a chain of pointwise ops costs one kernel: fewer kernels, less time, the same matmuls."""
    case = parity.CASES["gpt_tiny"]
    batch = case.make_batch(0, torch.float32)
    plan = sl.plan(case.build(torch.float32), case.loss_fn, sl.Spec(sl.Mesh(fsdp=2), units=case.units,
                                                                     options=sl.Options(backend="inductor")),
                   example_batch=batch[:4], world_size=2)
    fusion = plan_fusion(plan.graph_module)
    nodes = {n.name: n for n in plan.graph_module.graph.nodes}
    assert fusion.inlined and all(torch.Tag.pointwise in nodes[n].target.tags for n in fusion.inlined)
    assert all(u.name in fusion.inlined | fusion.kernels | fusion.views for n in fusion.inlined for u in nodes[n].users)
    eager = CostModel().predict(plan.schedule, plan.graph_module)
    fused = plan.timeline
    assert fused.model["fusion"] == fusion.summary()
    assert fused.compute_s < eager.compute_s
    matmuls = [n for n in nodes.values() if n.op == "call_function" and "mm" in str(n.target)]
    assert matmuls and all(n.name in fusion.kernels for n in matmuls)


def test_log_softmax_stays_aten_and_the_table_keeps_the_fx_graph_cache():
    """Note [log-softmax stays aten]: inductor calls aten's log-softmax and its backward; the table passed to
    compile_fx pickles (into the FX graph cache's key) as the call that builds it, the same in every process."""
    import pickle

    from shardlang.compiler.lower.backend import decompositions, kept_aten_ops

    aten = torch.ops.aten
    kept = kept_aten_ops([torch.zeros(2), torch.zeros(())])
    table = decompositions(kept)
    assert aten._log_softmax.default not in table and aten._log_softmax_backward_data.default not in table
    assert aten._softmax.default in table and aten.nll_loss_forward.default in table
    assert pickle.dumps(table) == pickle.dumps(decompositions(kept))
    assert pickle.loads(pickle.dumps(table)).keys() == table.keys()
    # measured on the CPU only: a step on another device keeps inductor's whole table
    assert kept_aten_ops([torch.zeros(2, device="meta")]) == ()
    assert aten._log_softmax.default in decompositions(())
