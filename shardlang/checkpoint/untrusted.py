"""Reading checkpoints that someone else wrote: nothing in them runs code.

Note [checkpoints run no code]: a checkpoint directory is data from outside.
DCP stores two kinds of pickle in it, and unpickling runs whatever callables
the file names:

- ``.metadata``, DCP's index of keys, shapes and files, which its
  ``FileSystemReader`` reads with plain ``pickle.load``. `SafeReader` reads it
  with `MetadataUnpickler` instead, which admits DCP's metadata classes and the
  few torch types they hold (sizes, dtypes, layouts) and nothing else.
- every non-tensor value (param groups' floats and names, shardlang's JSON
  strings), which DCP's default load planner reads with
  ``torch.load(weights_only=False)``. shardlang's planner reads them with
  `load_value`: ``torch.load(weights_only=True)``, torch's own allowlist of
  primitive types and tensors.
- every tensor item, a ``torch.save`` archive that DCP's reader hands to
  ``torch.load(weights_only=True)``. `SafeReader.read_data` reads each with
  `tensor_records.tensor_of`, the C unpickler restricted to the globals a
  plain tensor names, and ``torch.load(weights_only=True)`` for any other
  (Note [tensor records]).

A refused type is a `CheckpointError` naming the file and the type. shardlang's
own entries are tensors, numbers or JSON strings (Note [checkpoint keys]), so a
checkpoint it wrote never needs more; FSDP2's checkpoints hold only
primitives beside their tensors, so both directions keep working.

Example::

    reader = SafeReader("ckpt/step-3")
    reader.read_metadata().state_dict_metadata     # keys, shapes, dtypes; no code ran
"""

from __future__ import annotations

import bisect
import io
import pickle
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from ..errors import CheckpointError
from .store import DIGEST, SEGMENTS
from .tensor_records import tensor_of

#: What `.metadata` may name: DCP's metadata types, and the torch and Python types their fields hold.
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    *(("torch.distributed.checkpoint.filesystem", name) for name in ("_StorageInfo", "_StoragePrefix")),
    *(("torch.distributed.checkpoint.planner", name) for name in ("WriteItemType", "LoadItemType")),
    ("torch", "Size"), ("torch", "strided"), ("torch", "sparse_coo"),
    ("torch.serialization", "_get_layout"),  # a layout by its name, from torch's own table
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
    *(("torch", str(dtype).removeprefix("torch.")) for dtype in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
        torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128, torch.float8_e4m3fn,
        torch.float8_e5m2)),
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
    ("copyreg", "_reconstructor"), ("builtins", "object"),
})


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that finds only `ALLOWED_GLOBALS` (Note [checkpoints run no code]).

    Example::

        >>> MetadataUnpickler(io.BytesIO(pickle.dumps(torch.Size([2, 3]))), "x").load()
        torch.Size([2, 3])
    """

    def __init__(self, file: Any, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED_GLOBALS:
            raise CheckpointError(
                f"{self.where} asks to load {module}.{name}, which a checkpoint's metadata never holds; it was "
                "refused, not run (a crafted or corrupt file: only DCP's metadata types are read from it)",
                path=self.where)
        return super().find_class(module, name)


class SafeReader(FileSystemReader):
    """DCP's ``FileSystemReader``, with ``.metadata`` read by `MetadataUnpickler`.

    Given the manifest's ``files``, it checks the bytes it reads against their digests: ``.metadata``
    whole, and each item by the file's segments (Note [segment digests] in `checksums`). A file whose
    read ranges its segments do not tile is named in ``unverified``, for its caller to check whole.
    The metadata is read once: its caller checks keys against it before DCP asks for it again.
    """

    def __init__(self, path: str, files: dict | None = None):
        super().__init__(path)
        self.files = files or {}
        self.unverified: set[str] = set()
        self._metadata: dict[Any, Metadata] = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank not in self._metadata:  # unpickling it is a tenth of a 100M load
            self._metadata[rank] = self._read_metadata(rank)
        metadata = self._metadata[rank]
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _read_metadata(self, rank) -> Metadata:
        path = Path(self._get_metadata_path(rank))
        try:
            with open(path, "rb") as file:
                data = file.read()
            expected = self.files.get(path.name, {})
            if DIGEST in expected and xxhash.xxh3_64_intdigest(data) != expected[DIGEST]:
                raise CheckpointError(f"{path} does not match its checksum (corrupt)", path=path)
            metadata = MetadataUnpickler(io.BytesIO(data), str(path)).load()
        except CheckpointError:
            raise
        except OSError as exc:
            raise CheckpointError(f"{path} cannot be read: {exc.strerror or exc}", path=path) from None
        except Exception as exc:
            raise CheckpointError(f"{path} is not DCP metadata: {type(exc).__name__}: {exc}", path=path) from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP's Metadata", path=path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        return metadata


    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's read, each file's items in the order they lie in it, each tensor read as Note [tensor records]
        says; items DCP stored through transforms (compression, extensions) are read by DCP's own loop."""
        if any(getattr(self.storage_data[item.storage_index], "transform_descriptors", None) for item in plan.items):
            return super().read_data(plan, planner)
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative_path, items in per_file.items():
            where = str(Path(self.path) / relative_path)
            with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as stream:
                for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                    data = self._read_item(stream, self.storage_data[item.storage_index])
                    if item.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(item, io.BytesIO(data))
                        continue
                    _copy_into(planner, item, tensor_of(data, where), where)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _slice_file(self, file, sinfo):
        return io.BytesIO(self._read_item(file, sinfo))

    def _read_item(self, file, sinfo) -> bytearray:
        """One item's bytes, checked against the file's segment digests where they tile the item."""
        name = Path(sinfo.relative_path).name
        where = Path(self.path) / name
        file.seek(sinfo.offset)
        data = bytearray(sinfo.length)  # writable: a tensor is a view of it (Note [tensor records])
        if file.readinto(data) != sinfo.length:
            raise CheckpointError(f"{where} ends inside bytes {sinfo.offset}..{sinfo.offset + sinfo.length} "
                                  "(truncated)", path=where)
        segments = _tiling(self.files.get(name, {}).get(SEGMENTS), sinfo.offset, sinfo.offset + sinfo.length)
        if segments is None:
            if name in self.files:
                self.unverified.add(name)
            return data
        _check_segments(data, sinfo.offset, segments, where)
        return data


def _check_segments(data: bytearray, offset: int, segments, where: Path) -> None:
    """``data``, the file's bytes from ``offset``, against the digests of the segments that tile it."""
    view = memoryview(data)
    for start, end, digest in segments:
        if xxhash.xxh3_64_intdigest(view[start - offset:end - offset]) != digest:
            raise CheckpointError(f"{where} does not match its checksum (corrupt): bytes {start}..{end}", path=where)


def _copy_into(planner: LoadPlanner, item, tensor: torch.Tensor, where: str) -> None:
    """The read item's part of ``tensor`` into the tensor the planner loads it to, as DCP's reader does."""
    tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
    target = planner.resolve_tensor(item).detach()
    if target.size() != tensor.size():
        raise CheckpointError(f"{where}: {item.dest_index.fqn} holds {tuple(tensor.size())} where its metadata "
                              f"says {tuple(target.size())}", path=where, key=item.dest_index.fqn)
    target.copy_(tensor)
    planner.commit_tensor(item, target)


def _tiling(segments, start: int, end: int):
    """The segments that cover exactly ``[start, end)``, in order; None when they do not tile it."""
    if not segments:
        return None
    i = bisect.bisect_left(segments, [start])
    out, at = [], start
    while i < len(segments) and segments[i][0] == at and segments[i][1] <= end:
        out.append(segments[i])
        at = segments[i][1]
        i += 1
    return out if at == end and out else None


def load_value(data: io.BytesIO, where: str, key: str) -> Any:
    """A non-tensor value DCP stored (a ``torch.save`` of it), read with torch's ``weights_only`` allowlist."""
    try:
        return torch.load(data, weights_only=True)
    except pickle.UnpicklingError as exc:
        refused = str(exc).split("\n")
        detail = next((line.strip() for line in refused if "GLOBAL" in line or "Unsupported" in line), refused[0])
        raise CheckpointError(f"{where}: the value of {key!r} asks to load a type that is not plain data and was "
                              f"refused, not run ({detail})", path=where, key=key) from None
    except Exception as exc:
        raise CheckpointError(f"{where}: the value of {key!r} cannot be read: {type(exc).__name__}: {exc}",
                              path=where, key=key) from None
