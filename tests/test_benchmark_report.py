"""benchmarks.report judges runs by what they trained on: a test of its bookkeeping, not of any time."""

from __future__ import annotations

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
