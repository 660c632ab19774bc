"""The writer's checksums: computed as DCP writes, equal to reading each file back, never trusted out of order."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
import xxhash
import torch.distributed.checkpoint as dcp

from shardlang.checkpoint import store
from shardlang.checkpoint.checksums import ChecksummingWriter, _ChecksummedStream


def _save(tmp_path, threads: int) -> ChecksummingWriter:
    torch.manual_seed(0)
    state = {"a": torch.randn(1000, 17), "b": torch.arange(5000, dtype=torch.float64), "c": {"d": torch.ones(3)},
             "note": "text"}
    writer = ChecksummingWriter(str(tmp_path), thread_count=threads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP without a process group says it assumes one process
        dcp.save(state, storage_writer=writer, no_dist=True)
    return writer


@pytest.mark.parametrize("threads", [1, 2])
def test_every_file_is_checksummed_as_written_and_matches_a_read_back(tmp_path, threads):
    writer = _save(tmp_path, threads)
    files = sorted(p for p in tmp_path.iterdir() if p.is_file())
    assert {p.name for p in files} == set(writer.checksums)
    assert ".metadata" in writer.checksums  # written as a .tmp and renamed
    for p in files:
        record = writer.checksums[p.name]
        assert {k: record[k] for k in ("bytes", store.DIGEST)} == store.describe([p])[p.name]
        # Note [segment digests]: the segments tile the file, each the digest of its bytes
        data = p.read_bytes()
        assert [s[0] for s in record[store.SEGMENTS]] == [0] + [s[1] for s in record[store.SEGMENTS][:-1]]
        assert record[store.SEGMENTS][-1][1] == len(data)
        assert all(xxhash.xxh3_64_intdigest(data[a:b]) == d for a, b, d in record[store.SEGMENTS])
    if threads == 1:  # one file per rank and thread: an item per tensor, cut where DCP asked for the position
        distcp = next(p for p in files if p.suffix == ".distcp")
        assert len(writer.checksums[distcp.name][store.SEGMENTS]) >= 4


def test_a_file_whose_size_changed_after_writing_is_read_back(tmp_path):
    writer = _save(tmp_path, 1)
    victim = next(p for p in tmp_path.iterdir() if p.suffix == ".distcp")
    with open(victim, "ab") as f:
        f.write(b"tail")
    described = store.describe([victim], writer.checksums)[victim.name]
    assert described == {"bytes": victim.stat().st_size, store.DIGEST: store.digest_of(victim)}


def test_a_stream_written_out_of_order_is_not_trusted():
    raw = io.BytesIO()
    stream = _ChecksummedStream(raw)
    stream.write(b"abcd")
    assert stream.in_order
    stream.seek(0)
    stream.write(b"x")
    assert not stream.in_order


def test_a_manifest_written_with_crc32_is_still_checked_by_it(tmp_path):
    writer = _save(tmp_path, 1)
    victim = next(p for p in tmp_path.iterdir() if p.suffix == ".distcp")
    old_style = {"files": {victim.name: {"bytes": victim.stat().st_size, "crc32": store.crc32_of(victim)}}}
    assert store.damaged_files(tmp_path, old_style, 0, 1) == []
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    assert store.damaged_files(tmp_path, old_style, 0, 1) == [f"{victim} does not match its checksum (corrupt)"]
    assert writer.checksums[victim.name][store.DIGEST] != store.digest_of(victim)
