"""Hybrid sharding on 2-D meshes: shard within each group of S ranks, replicate across the R groups.

Tested on 4 ranks as ``Mesh(replicate=2, fsdp=2)``: parameters are sharded over
``fsdp`` (ranks {0, 1} and {2, 3}), gradients reduce-scattered there and their
shards all-reduced across ``replicate`` ({0, 2} and {1, 3}). Planned bytes
follow the formulas; the collectives really move them, on groups of the
right size; and training matches one process (float64, within 1e-9).
"""

from __future__ import annotations

import math

import pytest
import torch

import shardlang as sl
from shardlang.step.batch import split_batch
from shardlang.compiler.analysis.formulas import formula_bytes
from shardlang.compiler.layout.placement import WORLD, MeshShape
from shardlang.compiler.schedule.schedule import OpKind

import parity
import strategy_workers as w
from models import CASES, load_gpt_module

STEPS = 3
TOLERANCE = 1e-9
HYBRID = {"replicate": 2, "fsdp": 2}


def test_coordinates_are_row_major_and_groups_partition_the_ranks():
    mesh = MeshShape((("replicate", 2), ("fsdp", 2)))
    assert [mesh.coordinate(r) for r in range(4)] == [
        {"replicate": 0, "fsdp": 0}, {"replicate": 0, "fsdp": 1}, {"replicate": 1, "fsdp": 0}, {"replicate": 1, "fsdp": 1}]
    assert mesh.groups("fsdp") == [[0, 1], [2, 3]]
    assert mesh.groups("replicate") == [[0, 2], [1, 3]]
    assert mesh.groups(WORLD) == [[0, 1, 2, 3]]
    assert mesh.complement("fsdp") == "replicate"
    cube = MeshShape((("a", 2), ("b", 3), ("fsdp", 2)))
    assert cube.complement("fsdp") == "a+b" and cube.group_size("a+b") == 6
    assert cube.groups("a+b")[1] == [1, 3, 5, 7, 9, 11]
    assert MeshShape((("fsdp", 4),)).complement("fsdp") == ""


def plan_hybrid(case_name, strategies=None, mesh=None, world_size=4, rules=None):
    case = CASES[case_name]
    spec = sl.Spec(mesh or sl.Mesh(**HYBRID), rules=rules, units=case.units, strategies=strategies)
    batch = split_batch(case.make_batch(0, torch.float64), world_size, 0)
    return sl.plan(case.build(torch.float64), case.loss_fn, spec, example_batch=batch, world_size=world_size,
                   check_each_pass=True).schedule


@pytest.mark.parametrize("strategy", ["zero3", "zero2", "zero1", "ddp"])
def test_hybrid_bytes_follow_the_formulas(strategy):
    schedule = plan_hybrid("gpt_tiny", [("*", strategy)])
    model = CASES["gpt_tiny"].build(torch.float64)
    s = 2  # shard group; r = 2 replicas
    m = sum(math.ceil(p.numel() / s) * s * p.element_size() for p in model.parameters())
    collectives = [op for op in schedule.ops if op.kind in (OpKind.ALL_GATHER, OpKind.REDUCE_SCATTER, OpKind.ALL_REDUCE)]
    if strategy == "ddp":
        assert {(op.kind, op.group, op.group_size) for op in collectives} == {(OpKind.ALL_REDUCE, WORLD, 4)}
        assert schedule.summary.bytes_per_rank["all_reduce"] == sum(p.numel() * 8 for p in model.parameters())
    else:
        # gathers and reduce-scatters within the shard group, all-reduces of shards across the replicas
        assert {(op.kind, op.group, op.group_size) for op in collectives} == {
            (OpKind.ALL_GATHER, "fsdp", 2), (OpKind.REDUCE_SCATTER, "fsdp", 2), (OpKind.ALL_REDUCE, "replicate", 2)}
        bytes_ = schedule.summary.bytes_per_rank
        if strategy != "zero1":  # ZeRO-1 pads each flat parameter whole, the others each member
            assert bytes_["reduce_scatter"] == m
            assert bytes_["all_reduce"] == m // s
        assert bytes_["all_gather"] >= bytes_["reduce_scatter"]
        across = [op for op in collectives if op.kind is OpKind.ALL_REDUCE]
        assert all(op.detail == "across replicas" for op in across)
        wire = schedule.summary.wire_bytes_per_rank
        assert wire["reduce_scatter"] == bytes_["reduce_scatter"] // 2  # (S-1)/S with S = 2
        assert wire["all_reduce"] == bytes_["all_reduce"]  # 2(R-1)/R with R = 2
    assert formula_bytes(schedule) == schedule.summary.bytes_per_rank


def test_plan_of_a_2d_spec_needs_no_processes():
    """``shardlang plan`` on a 2-D mesh: fake tensors, any world size the mesh fits (here 8 = 2 x 4)."""
    gpt = load_gpt_module()
    spec = sl.Spec(sl.Mesh(replicate=2, fsdp=-1), units=["blocks.*"])
    assert spec.rules == (sl.Rule("*", sl.shard("fsdp")),)  # the default shards over the last axis
    batch = split_batch(gpt.make_batch(0), 8, 0)
    schedule = sl.plan(gpt.build_model, gpt.loss_fn, spec, example_batch=batch, world_size=8).schedule
    assert schedule.mesh == (("replicate", 2), ("fsdp", 4))
    assert {op.group_size for op in schedule.ops if op.kind is OpKind.REDUCE_SCATTER} == {4}
    assert {op.group for op in schedule.ops if op.kind is OpKind.ALL_REDUCE} == {"replicate"}
    assert "across replicas" in schedule.table()
    assert formula_bytes(schedule) == schedule.summary.bytes_per_rank


def test_three_axes_reduce_across_every_other_axis():
    schedule = plan_hybrid("mlp", mesh=sl.Mesh(a=2, b=1, fsdp=2))
    assert {(op.kind, op.group) for op in schedule.ops if op.kind is not OpKind.WAIT and op.group} == {
        (OpKind.ALL_GATHER, "fsdp"), (OpKind.REDUCE_SCATTER, "fsdp"), (OpKind.ALL_REDUCE, "a+b")}


def test_verifier_catches_a_missing_all_reduce_across_replicas():
    import attrs

    schedule = plan_hybrid("mlp")
    across = next(op for op in schedule.ops if op.kind is OpKind.ALL_REDUCE)
    ops = [op for op in schedule.ops if op.handle != across.handle]
    broken = attrs.evolve(schedule, ops=tuple(attrs.evolve(op, index=i) for i, op in enumerate(ops)))
    with pytest.raises(sl.ScheduleError, match=r"never summed over mesh axes \['replicate'\]"):
        sl.verify(broken)


# ---- on 4 ranks ------------------------------------------------------------------------------------


def check(results, reference, buffers=False):
    ref_losses, ref_params, ref_buffers = reference
    for rank, (losses, params, bufs) in enumerate(results):
        assert parity.max_relative_difference(params, ref_params) < TOLERANCE, f"rank {rank}"
        if buffers:  # BatchNorm statistics are synchronised over the whole world
            for name, ref in ref_buffers.items():
                assert parity.max_relative_difference({name: bufs[name].double()}, {name: ref.double()}) < TOLERANCE
    for k in range(STEPS):
        assert sum(r[0][k] for r in results) / len(results) == pytest.approx(ref_losses[k], rel=1e-12)


@pytest.mark.parametrize("strategy", ["zero3", "zero2", "zero1", "ddp"])
def test_each_strategy_on_a_2x2_mesh_trains_like_one_process(run_on, references, strategy):
    spec = {"mesh": HYBRID, "strategies": [{"pattern": "*", "strategy": strategy}]}
    check(run_on(4, w.train_with_spec, "prime", "adamw", spec, STEPS), references("prime", "adamw"))


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_mixed_spec_on_a_2x2_mesh_trains_like_one_process(run_on, references, optimizer):
    """GPT: blocks.0 ZeRO-1, blocks.1 DDP, the root ZeRO-3 with a tied head, LayerNorms replicated."""
    from test_strategies import MIXED

    check(run_on(4, w.train_with_spec, "gpt_tiny", optimizer, {"mesh": HYBRID, **MIXED}, STEPS),
          references("gpt_tiny", optimizer))


@pytest.mark.parametrize("mesh", [{"replicate": 4, "fsdp": 1}, {"a": 2, "b": 1, "fsdp": 2}])
def test_degenerate_and_three_axis_meshes_train_like_one_process(run_on, references, mesh):
    """Shard groups of one rank (collectives there stay identities) and an all-reduce over two axes ("a+b")."""
    spec = {"mesh": mesh, "strategies": [{"pattern": "*", "strategy": "zero1"}]}
    check(run_on(4, w.train_with_spec, "prime", "adamw", spec, STEPS), references("prime", "adamw"))


def test_batch_norm_on_a_2x2_mesh_is_synchronised_over_the_world(run_on, references):
    check(run_on(4, w.train_with_spec, "convnet_bn", "adamw", {"mesh": HYBRID}, STEPS),
          references("convnet_bn", "adamw"), buffers=True)


def test_the_2x2_collectives_move_the_planned_bytes_on_groups_of_two(run_on):
    """Reduce-scatter within each pair of the shard axis, all-reduce across the pair of replicas: measured."""
    results = run_on(4, w.held_bytes_and_traffic, "gpt_tiny", {"mesh": HYBRID})
    model = CASES["gpt_tiny"].build(torch.float64)
    m = sum(math.ceil(p.numel() / 2) * 2 * p.element_size() for p in model.parameters())
    for counts, schedule in results:
        planned: dict[tuple[str, int], int] = {}
        for op in schedule["ops"]:
            if op["kind"] in ("all_gather", "reduce_scatter", "all_reduce"):
                planned[op["kind"], op["group_size"]] = planned.get((op["kind"], op["group_size"]), 0) + op["bytes"]
        assert counts == planned
        assert counts["reduce_scatter", 2] == m and counts["all_reduce", 2] == m // 2
        assert set(counts) == {("all_gather", 2), ("reduce_scatter", 2), ("all_reduce", 2)}
