"""`benchmarks.interleave`'s variants train the same model: the what-ifs change where bytes live, not values.

A diagnostic's test, not a benchmark: it asserts no time. ``+freed`` makes the
all-reduce buffers anew every step (``Options(keep_reduction_buffers=False)``;
shardlang-DDP keeps them by default), ``+fresh`` makes gathered buffers and packs
anew (``Options(buffer_pool=False)``), and ``:MIB`` buckets the flat parameters;
each must give its mode's losses to the bit.
"""

from __future__ import annotations

from benchmarks.interleave import interleave

VARIANTS = ["shardlang-ddp", "shardlang-ddp+freed:1", "shardlang-zero2", "shardlang-zero2+fresh", "ddp"]


def test_variants_keep_the_losses(run_on):
    per_rank = run_on(2, interleave, "tiny", VARIANTS, 1, 2)
    for rows in per_rank:
        losses = {v: row[5] for v, row in rows.items()}
        assert losses["shardlang-ddp+freed:1"] == losses["shardlang-ddp"]  # +freed:1: both options at once
        assert losses["shardlang-zero2+fresh"] == losses["shardlang-zero2"]
        assert abs(losses["ddp"] - losses["shardlang-ddp"]) < 1e-5
        assert all(row[0] > 0 and row[4] > 0 for row in rows.values())  # CPU and wall time were read
    assert per_rank[0]["shardlang-ddp"][5] != per_rank[1]["shardlang-ddp"][5]  # each rank its own batch
