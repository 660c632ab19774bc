"""Tensor items read without torch.load (Note [tensor records] in `shardlang.checkpoint.tensor_records`).

Every tensor ``torch.save`` writes reads back to the same values, dtype, shape and
strides as ``torch.load(weights_only=True)`` gives, as a view of the bytes read; an
archive that names any other callable runs nothing and is refused as torch.load
refuses it; an archive whose storage record does not hold what its pickle says is
an error, not a view past the record; another byte order reads through torch.load.
"""

from __future__ import annotations

import io
import os
import zipfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardlang.checkpoint.tensor_records import _plain_tensor, _NotPlain, tensor_of
from shardlang.errors import CheckpointError

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool, torch.complex64]


def _saved(value) -> bytearray:
    data = io.BytesIO()
    torch.save(value, data)
    return bytearray(data.getvalue())


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype, a.shape, a.stride(), a.storage_offset()) == (b.dtype, b.shape, b.stride(), b.storage_offset()) \
        and torch.equal(a, b)


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(DTYPES), shape=st.lists(st.integers(0, 7), min_size=0, max_size=3),
       start=st.integers(0, 3), transpose=st.booleans())
def test_every_saved_tensor_reads_as_torch_load_reads_it(dtype, shape, start, transpose):
    full = (torch.arange(4 * 7 * 7 * 7 + 3) % 5).to(dtype)
    numel = 1
    for size in shape:
        numel *= size
    tensor = full[start:start + numel].reshape(shape)
    if transpose and tensor.dim() >= 2:
        tensor = tensor.transpose(0, 1)
    data = _saved(tensor)
    expected = torch.load(io.BytesIO(bytes(data)), weights_only=True)
    assert _same(_plain_tensor(data), expected)  # the fast path itself, not its fallback
    assert _same(tensor_of(data, "x"), expected)


def test_a_tensor_read_is_a_view_of_the_bytes_read_not_a_copy():
    data = _saved(torch.arange(16, dtype=torch.float32))
    tensor = tensor_of(data, "x")
    base = torch.frombuffer(data, dtype=torch.uint8).data_ptr()
    assert base <= tensor.data_ptr() < base + len(data)


class Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_an_archive_naming_another_callable_runs_nothing_and_is_refused(tmp_path):
    marker = tmp_path / "ran"
    data = _saved(Payload(str(marker)))
    with pytest.raises(_NotPlain):
        _plain_tensor(data)
    with pytest.raises(CheckpointError, match=r"ckpt/__0_0\.distcp: a tensor record asks to load a type that is "
                                              r"not plain data and was refused, not run"):
        tensor_of(data, "ckpt/__0_0.distcp")
    assert not marker.exists()


def _rewritten(data: bytearray, record: str, content: bytes) -> bytearray:
    """The archive with ``record`` (a name under its folder) replaced, written back with torch's own layout."""
    source = zipfile.ZipFile(io.BytesIO(bytes(data)))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
        for info in source.infolist():
            body = content if info.filename.endswith("/" + record) else source.read(info)
            target.writestr(info.filename, body)
    return bytearray(out.getvalue())


def test_a_storage_shorter_than_its_pickle_says_is_an_error_not_a_view_past_it():
    data = _saved(torch.arange(64, dtype=torch.float64))
    short = _rewritten(data, "data/0", bytes(8 * 4))  # 4 of the 64 values
    with pytest.raises(CheckpointError, match=r"ckpt: a tensor record cannot be read"):
        tensor_of(short, "ckpt")


def test_another_byte_order_reads_through_torch_load():
    data = _saved(torch.arange(6, dtype=torch.int32))
    other = "big" if os.sys.byteorder == "little" else "little"
    swapped = _rewritten(data, "byteorder", other.encode())
    with pytest.raises(_NotPlain):
        _plain_tensor(swapped)
    assert torch.equal(tensor_of(swapped, "x"), torch.load(io.BytesIO(bytes(swapped)), weights_only=True))
