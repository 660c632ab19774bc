"""A tensor DCP wrote, read from its bytes without ``torch.load``: no code runs, no copy of the storage.

Note [tensor records]: DCP writes every tensor item as a ``torch.save``
archive (an uncompressed zip: ``data.pkl``, a pickle that rebuilds the tensor
from a storage, and ``data/0``, the storage's raw bytes). Its reader hands
each item to ``torch.load(weights_only=True)``, whose allowlist unpickler is
written in Python, and which copies the storage out of the archive before the
planner copies it again into the step's own tensor. On a 100M GPT that was
two thirds of a load's read. `tensor_of` reads the same archive with the C
unpickler restricted to the four globals a tensor's ``data.pkl`` names
(``torch._utils._rebuild_tensor_v2``, ``collections.OrderedDict`` and a
storage type, which gives the dtype), and views the storage in place over the
bytes read, with bounds checked before any view is made. Anything else in
the archive (another global, a byte order not this machine's, a record that
does not fit) goes to ``torch.load(weights_only=True)`` as before, so every
archive ``torch.load`` reads is read, to the same values, and what it refuses
is still refused. No callable but the four is ever looked up, and those do
no more than build a tensor over bytes already in memory.

Example::

    data = bytearray(file_bytes)                 # one item's bytes, as DCP's metadata places them
    tensor = tensor_of(data, "ckpt/__0_0.distcp")
"""

from __future__ import annotations

import collections
import io
import pickle
import sys
from typing import Any

import torch

from ..errors import CheckpointError

#: The storage types a ``data.pkl`` names, by their global's name (``torch.FloatStorage``), with their dtype.
_STORAGE_DTYPES: dict[str, torch.dtype] = {
    name: dtype for dtype, name in torch.storage._dtype_to_storage_type_map().items()
    if not name.startswith("Q")}  # quantized storages rebuild through other globals


class _NotPlain(Exception):
    """The archive holds something besides one plain tensor: `tensor_of` hands it to ``torch.load``."""


def tensor_of(data: bytearray, where: str) -> torch.Tensor:
    """The tensor in a ``torch.save`` archive ``data``, a view of its bytes (Note [tensor records]).

    ``where`` names the file in errors. Falls back to ``torch.load(weights_only=True)`` for any archive
    that is not one plain tensor in this machine's byte order.
    """
    try:
        return _plain_tensor(data)
    except _NotPlain:
        return _torch_load(data, where)


def _plain_tensor(data: bytearray) -> torch.Tensor:
    try:
        archive = torch._C.PyTorchFileReader(_ArchiveView(data))
        if archive.has_record("byteorder") and bytes(archive.get_record("byteorder")).decode() != sys.byteorder:
            raise _NotPlain
        pickled = archive.get_record("data.pkl")
    except _NotPlain:
        raise
    except Exception:  # not an archive torch's reader can open: torch.load says what is wrong with it
        raise _NotPlain from None
    try:
        tensor = _TensorUnpickler(io.BytesIO(pickled), data, archive).load()
    except (_NotPlain, pickle.UnpicklingError, AttributeError, RuntimeError, ValueError, TypeError, IndexError,
            EOFError):
        raise _NotPlain from None
    if not isinstance(tensor, torch.Tensor):
        raise _NotPlain
    return tensor


class _ArchiveView:
    """A read-only file over ``data`` for torch's zip reader, which reads only the headers and records it is
    asked for (``io.BytesIO`` would copy a bytearray whole first)."""

    def __init__(self, data: bytearray):
        self._view = memoryview(data)
        self._at = 0

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: len(self._view)}[whence]
        self._at = max(0, base + offset)
        return self._at

    def tell(self) -> int:
        return self._at

    def read(self, size: int = -1) -> bytes:
        end = len(self._view) if size < 0 else min(len(self._view), self._at + size)
        chunk = self._view[self._at:end].tobytes()
        self._at = max(self._at, end)
        return chunk

    def readinto(self, buffer) -> int:
        size = max(0, min(len(buffer), len(self._view) - self._at))
        buffer[:size] = self._view[self._at:self._at + size]
        self._at += size
        return size


class _TensorUnpickler(pickle.Unpickler):
    """The C unpickler, finding only what a plain tensor's ``data.pkl`` names (Note [tensor records])."""

    def __init__(self, file: Any, data: bytearray, archive):
        super().__init__(file)
        self._data = data
        self._archive = archive

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise _NotPlain

    def persistent_load(self, saved_id: Any) -> tuple[torch.UntypedStorage, torch.dtype]:
        if not (isinstance(saved_id, tuple) and len(saved_id) == 5 and saved_id[0] == "storage"):
            raise _NotPlain
        _, dtype, key, _location, numel = saved_id
        if not (isinstance(dtype, torch.dtype) and isinstance(key, str) and isinstance(numel, int) and numel >= 0):
            raise _NotPlain
        record = f"data/{key}"
        if not self._archive.has_record(record):
            raise _NotPlain
        offset, size = self._archive.get_record_offset(record), numel * dtype.itemsize
        if size != self._archive.get_record_size(record) or offset < 0 or offset + size > len(self._data):
            raise _NotPlain  # torch.load names what does not fit
        if size == 0:
            return torch.UntypedStorage(0), dtype
        return torch.frombuffer(self._data, dtype=torch.uint8, count=size, offset=offset).untyped_storage(), dtype


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad, backward_hooks, *_metadata):
    """``torch._utils._rebuild_tensor_v2`` over a storage view: ``set_`` checks the view lies inside it."""
    if not (isinstance(storage, tuple) and len(storage) == 2 and isinstance(storage[0], torch.UntypedStorage)):
        raise _NotPlain
    if backward_hooks:
        raise _NotPlain
    untyped, dtype = storage
    return torch.empty((0,), dtype=dtype).set_(untyped, storage_offset, size, stride)


def _torch_load(data: bytearray, where: str) -> torch.Tensor:
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"{where}: a tensor record asks to load a type that is not plain data and was "
                              f"refused, not run ({str(exc).splitlines()[0]})", path=where) from None
    except Exception as exc:
        raise CheckpointError(f"{where}: a tensor record cannot be read: {type(exc).__name__}: {exc}",
                              path=where) from None
