"""Bucketing merges runs of small, alike flat parameters and leaves large ones alone."""

from __future__ import annotations

import torch

from shardlang.compiler.layout.bucket import bucket_flat_params
from shardlang.compiler.layout.flat import build_flat_params
from shardlang.compiler.layout.placement import LayoutKind, MeshShape, ParamInfo, Placement

MESH = MeshShape((("fsdp", 2),))
SHARD = Placement(LayoutKind.SHARD_FLAT, "fsdp")


def param(name, numel, unit, trainable=True, placement=SHARD):
    return ParamInfo(name, (numel,), torch.float32, trainable, unit, placement)


def test_small_alike_flats_merge_until_the_bucket_is_full():
    params = (param("a.w", 10, "a"), param("b.w", 10, "b"), param("c.w", 1000, "c"), param("d.w", 10, "d"),
              param("e.w", 10, "e"), param("f.w", 10, "f"))
    flats = bucket_flat_params(build_flat_params(params, MESH), bucket_bytes=80)
    # 40 bytes each: a+b fills a bucket; c (4000 bytes) stays alone; d+e fill the next; f is left over.
    assert [f.unit for f in flats] == ["a+b", "c", "d+e", "f"]
    merged = flats[0]
    assert [m.name for m in merged.members] == ["a.w", "b.w"]
    assert [m.offset for m in merged.members] == [0, 10]  # whole members (Note [whole-flat shards])
    assert merged.shard_numel == 10  # each rank's slice of the 20
    dim = Placement(LayoutKind.SHARD_DIM, "fsdp", 0)
    (pieces,) = bucket_flat_params(build_flat_params((param("a.w", 10, "a", placement=dim),
                                                      param("b.w", 10, "b", placement=dim)), MESH), bucket_bytes=80)
    assert [m.offset for m in pieces.members] == [0, 5]  # sharded along a dim: pieces of 5 on each rank


def test_unlike_flats_do_not_merge():
    params = (param("a.w", 10, "a"), param("b.w", 10, "b", trainable=False),
              param("c.b", 10, "c", placement=Placement(LayoutKind.REPLICATE)))
    flats = bucket_flat_params(build_flat_params(params, MESH), bucket_bytes=1 << 20)
    assert len(flats) == 3


def test_zero_turns_bucketing_off():
    params = tuple(param(f"u{i}.w", 4, f"u{i}") for i in range(5))
    flats = build_flat_params(params, MESH)
    assert bucket_flat_params(flats, 0) == flats


def test_bucketed_gpt_trains_like_one_process_and_gathers_less_often(run_on):
    import parity

    results = run_on(2, parity.train_sharded, "gpt_tiny", "adamw", "float64", 3, {"bucket_bytes": 1 << 20})
    _, ref_params, _ = parity.train_reference("gpt_tiny", "adamw", "float64", 3)
    assert parity.max_relative_difference(results[0][1], ref_params) < 1e-9
    schedule = results[0][3]
    assert [f["unit"] for f in schedule["flats"]] == ["<root>+blocks.0+blocks.1"]  # one bucket
    assert schedule["collectives"]["all_gather"] == 1 and schedule["collectives"]["reduce_scatter"] == 1


def test_bucket_bytes_is_validated():
    import pytest

    import shardlang as sl

    with pytest.raises(sl.SpecError, match="bucket_bytes is -1"):
        sl.Options(bucket_bytes=-1)
