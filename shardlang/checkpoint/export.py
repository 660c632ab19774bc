"""A checkpoint's model as safetensors: one consolidated file, or Hugging Face's sharded layout with its index.

The model's entries are read one tensor at a time (DCP assembles each from
whatever chunks the ranks wrote) and streamed into the file: the header is
written first, from the checkpoint's metadata (names, shapes, dtypes are all
known before a byte is read), then each tensor's bytes in order. So at most one
tensor is in memory, never the whole model. Every name of a tied parameter and
every persistent buffer is written, which is what ``load_state_dict(strict=True)``
asks for. The file appears only when complete (written under ``.tmp``, renamed).

Example::

    export_safetensors("ckpt/step-00000100", "model.safetensors")
    export_safetensors("ckpt/step-00000100", "out/model.safetensors", max_shard_size="2GB")
    # out/model-00001-of-00003.safetensors ... and out/model.safetensors.index.json
"""

from __future__ import annotations

import json
import math
import re
import struct
import warnings
from pathlib import Path

import attrs
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..errors import CheckpointError
from . import store
from .untrusted import SafeReader

MODEL_PREFIX = "model."
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@attrs.frozen
class Exported:
    """What `export_safetensors` wrote: the files, the index (sharded), tensor count and bytes of tensor data."""

    files: tuple[Path, ...]
    index: Path | None
    tensors: int
    bytes: int


def parse_size(text: str) -> int:
    """``"5GB"`` (10^9), ``"2GiB"`` (2^30), ``"500MB"``, ``"1000"`` -> bytes; `CheckpointError` otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(text), flags=re.I)
    if not m or m.group(2).upper() not in UNITS or float(m.group(1)) <= 0:
        raise CheckpointError(f"max shard size {text!r} is not a size; expected e.g. 5GB, 500MB, 2GiB or a number "
                              "of bytes")
    return int(float(m.group(1)) * UNITS[m.group(2).upper()])


def model_tensors(path: Path) -> dict[str, TensorStorageMetadata]:
    """The checkpoint's model tensors (name without ``model.``) and their metadata, in the checkpoint's order."""
    reader = SafeReader(str(path))  # Note [checkpoints run no code]
    try:
        metadata = reader.read_metadata()
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{path / '.metadata'} cannot be read: {exc}", path=path / ".metadata") from None
    found = {k[len(MODEL_PREFIX):]: md for k, md in metadata.state_dict_metadata.items()
             if k.startswith(MODEL_PREFIX) and isinstance(md, TensorStorageMetadata)}
    if not found:
        raise CheckpointError(f"{path} has no model.* tensors: it is not a model checkpoint", path=path)
    return found


def read_tensor(path: Path, name: str, md: TensorStorageMetadata) -> torch.Tensor:
    """One whole model tensor of the checkpoint at ``path``, assembled from its chunks."""
    target = {MODEL_PREFIX + name: torch.empty(tuple(md.size), dtype=md.properties.dtype)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(target, storage_reader=SafeReader(str(path)), no_dist=True)
    return target[MODEL_PREFIX + name]


def export_safetensors(checkpoint, out, *, max_shard_size=None) -> Exported:
    """Write the model of the checkpoint directory ``checkpoint`` to ``out`` (safetensors), tensor by tensor.

    With ``max_shard_size`` (bytes, or a string such as ``"5GB"``), files of at most that
    many bytes of tensor data (a bigger tensor gets a file of its own) plus
    ``<out>.index.json``, named as Hugging Face names them.
    """
    path, out = Path(checkpoint), Path(out)
    if (path / store.MANIFEST).is_file():
        store.verify(path, store.read_manifest(path), 0, 1, None)
    elif not (path / ".metadata").is_file():
        store.read_manifest(path)  # raises: not a directory, or an unfinished save
    _check_out(out)
    tensors = model_tensors(path)
    for name, md in tensors.items():
        if md.properties.dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: model.{name} is {md.properties.dtype}, which safetensors cannot hold",
                                  path=path, key=f"model.{name}")
    limit = parse_size(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
    groups = _shard(tensors, limit) if limit else [list(tensors)]
    if len(groups) == 1 and not limit:
        files = [out]
    else:
        stem = out.name.removesuffix(".safetensors")
        files = [out.with_name(f"{stem}-{i:05d}-of-{len(groups):05d}.safetensors") for i in range(1, len(groups) + 1)]
    total = 0
    for file, names in zip(files, groups):
        total += _write_file(path, file, {n: tensors[n] for n in names})
    index = None
    if limit:
        index = out.with_name(out.name + ".index.json")
        weight_map = {n: f.name for f, names in zip(files, groups) for n in names}
        _atomic_text(index, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return Exported(tuple(files), index, len(tensors), total)


def _nbytes(md: TensorStorageMetadata) -> int:
    return math.prod(md.size) * torch.empty((), dtype=md.properties.dtype).element_size()


def _shard(tensors: dict[str, TensorStorageMetadata], limit: int) -> list[list[str]]:
    """Consecutive groups of names of at most ``limit`` bytes each (a bigger tensor alone)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, md in tensors.items():
        n = _nbytes(md)
        if groups[-1] and size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    return groups


def _write_file(path: Path, file: Path, tensors: dict[str, TensorStorageMetadata]) -> int:
    """One safetensors file: the header from the metadata, then each tensor's bytes as it is read."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, md in tensors.items():
        n = _nbytes(md)
        header[name] = {"dtype": SAFETENSORS_DTYPES[md.properties.dtype], "shape": list(md.size),
                        "data_offsets": [offset, offset + n]}
        offset += n
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    tmp = file.with_name(file.name + store.TMP_SUFFIX)
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(encoded)))
            f.write(encoded)
            for name, md in tensors.items():
                tensor = read_tensor(path, name, md).contiguous()
                f.write(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
        tmp.replace(file)
    except BaseException as exc:  # no half-written file stays behind
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise CheckpointError(f"writing {file} failed: {exc.strerror or exc}", path=file) from None
        raise
    return offset


def _check_out(out: Path) -> None:
    """``out`` can be written as a file: checked before a byte of the checkpoint is read."""
    if out.is_dir():
        raise CheckpointError(f"--out {out} is a directory; name the .safetensors file to write (e.g. "
                              f"{out / 'model.safetensors'})", path=out)
    parent = next((p for p in (out.parent, *out.parent.parents) if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise CheckpointError(f"--out {out}: {parent} is a file, not a directory", path=out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"--out {out}: its directory cannot be created: {exc.strerror or exc}",
                              path=out) from None


def _atomic_text(file: Path, text: str) -> None:
    tmp = file.with_name(file.name + store.TMP_SUFFIX)
    tmp.write_text(text)
    tmp.replace(file)
