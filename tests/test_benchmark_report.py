"""benchmarks.report judges runs by what they trained on: a test of its bookkeeping, not of any time."""

from __future__ import annotations

from benchmarks.compare import group_estimate, memory_groups
from benchmarks.reference import Reference
from benchmarks.report import aggregate


def _rank(loss: float) -> dict:
    return {"times": [1.0], "cpu": [1.0], "wire": [0], "payload": {}, "counts": {}, "peak": 1, "state": 1,
            "loss": loss, "build_s": 0.0}


def _results(per_rank_batch: int | None) -> dict:
    config = {"seq_len": 8, "per_rank_batch": per_rank_batch}
    reference = {"floor": 1, "M": 4}
    runs = [{"size": "s", "world": 1, "mode": "single", "backend": "gloo", "ranks": [_rank(2.0)]},
            {"size": "s", "world": 2, "mode": "shardlang", "backend": "gloo",
             "ranks": [{**_rank(2.5), "schedule_payload": {}, "M_padded": 4, "compile_s": 0.0}] * 2}]
    return {"runs": runs, "settings": {"global_batch": 4, "sizes": ["s"], "world_sizes": [1, 2]},
            "sizes": {"s": {"config": config, "reference": {"1": reference, "2": reference}}}}


def test_the_loss_is_compared_with_one_process_only_on_the_same_global_batch():
    same = {r["world"]: r for r in aggregate(_results(per_rank_batch=None))["rows"]}
    assert same[2]["loss_diff"] == 0.25  # the same 4 sequences at N = 1 and 2: a difference is a bug
    # The latency setting: one sequence per rank, so N = 2 trains on twice the batch of one process.
    grown = {r["world"]: r for r in aggregate(_results(per_rank_batch=1))["rows"]}
    assert grown[2]["loss_diff"] is None and grown[1]["loss_diff"] == 0.0


def test_memory_groups_put_the_peer_a_target_compares_with_in_the_first_group():
    ref = Reference(params=100_000_000, largest_unit=0, activations=0, world=4)
    strategies = ("shardlang-zero2", "shardlang-zero1", "shardlang-ddp", "ddp")
    groups = memory_groups(strategies, ref, budget=16 * 2**30)  # not all four: each group holds under 16 GiB
    assert len(groups) == 2 and "ddp" in groups[0] and len(groups[0]) == 3
    assert sorted(m for g in groups for m in g) == sorted(strategies)  # each mode runs once
    assert groups[0] == ("shardlang-zero2", "shardlang-zero1", "ddp")  # in the order asked for
    assert memory_groups(strategies, ref, budget=2**40) == [strategies]


def test_a_group_needs_every_state_but_one_step_at_a_time():
    ref = Reference(params=100_000_000, largest_unit=10_000_000, activations=50_000_000, world=4)
    pair = ("shardlang-ddp", "ddp")
    # per rank: both states (16 + 16 bytes a parameter), and DDP's step (8 a parameter, 2 units, the activations)
    need = 4 * (32 * ref.params + 8 * ref.params + 2 * ref.largest_unit + ref.activations)
    assert group_estimate(pair, ref) == need
    assert memory_groups(pair, ref, budget=need) == [pair]
    assert memory_groups(pair, ref, budget=need - 1) == [("ddp",), ("shardlang-ddp",)]
