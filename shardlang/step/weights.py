"""Pretrained weights in safetensors files, read one rank's slices at a time.

A path names one ``.safetensors`` file, or the Hugging Face layout: a
directory (or its ``model.safetensors.index.json``) whose index maps each
tensor name to the file that holds it. `WeightFiles.open` reads only the
headers; `WeightFiles.match` checks the names and shapes against the model
before a byte of data is read, and `read_piece` reads the part of one
parameter a rank holds, through safetensors' lazy ``get_slice``.

Note [reading shards]: `read_piece` returns exactly what `compiler.layout.flat.member_piece`
cuts from the full tensor (Note [shard layout]), reading only the rows it
needs: a flat piece is a range of the flattened tensor, read as the few rows of
dim 0 that cover it; a piece along dim d is a slice on d; a replicated member,
or any member of a strategy that holds the whole (ZeRO-1, DDP), is read whole.
Padding is zeros added after reading, never read. On a mesh with a tensor axis
a member is a rank's tp block of the tensor (a `Block`: a slice on one dim), and
every read above is of that block: its slices are moved by the block's start,
so a rank reads its FSDP piece of its tp block and nothing more.

Names: the file may name a tied parameter by any of its names
(``model.named_parameters(remove_duplicate=False)``): GPT-2 checkpoints keep
``lm_head.weight`` or ``wte.weight``, not both. Buffers are loaded when the
file has them (BatchNorm statistics); a buffer it lacks keeps the model's value
or, on the meta device, is initialised (`shardlang.step.materialize`).

Example::

    files = WeightFiles.open("checkpoints/gpt")           # a directory with model.safetensors.index.json
    keys = files.match(model)                              # canonical parameter name -> name in the file
    piece = files.read_piece(keys["tok_emb.weight"], member, rank=1)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import attrs
import torch

from ..compiler import LayoutKind, Member
from ..errors import SpecError


@attrs.frozen
class Block:
    """The part of a tensor a rank of a tensor axis holds: ``size`` entries of ``dim`` from ``start``.

    Example: tp rank 1 of 2 of an ``(8, 4)`` weight split on dim 0 holds ``Block(dim=0, start=4, size=4)``.
    """

    dim: int
    start: int
    size: int

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

class WeightFiles:
    """The tensors of one safetensors file or of a Hugging Face sharded checkpoint, by name.

    Example::

        files = WeightFiles.open("model.safetensors")
        files.shape("tok_emb.weight")    # (64, 64), from the header only
    """

    def __init__(self, path: Path, file_of: dict[str, Path]):
        self.path = path
        self.file_of = file_of
        self._handles: dict[Path, object] = {}

    @classmethod
    def open(cls, path: str | Path) -> WeightFiles:
        """Read the index (or the one file's header) at ``path``; a missing or malformed path is a `SpecError`."""
        path = Path(path)
        if path.is_dir():
            if (path / INDEX_NAME).is_file():
                return cls._from_index(path / INDEX_NAME)
            if (path / SINGLE_NAME).is_file():
                return cls._from_file(path / SINGLE_NAME)
            found = sorted(p.name for p in path.glob("*.safetensors"))
            if len(found) == 1:
                return cls._from_file(path / found[0])
            raise SpecError(f"weights directory {str(path)!r} has no {INDEX_NAME} and "
                            + (f"{len(found)} .safetensors files ({', '.join(found[:4])}...); give the index or "
                               "one file" if found else "no .safetensors file"))
        if not path.is_file():
            raise SpecError(f"weights {str(path)!r} does not exist; give a .safetensors file or a directory with "
                            f"{INDEX_NAME}")
        if path.name.endswith(".json"):
            return cls._from_index(path)
        return cls._from_file(path)

    @classmethod
    def _from_file(cls, file: Path) -> WeightFiles:
        return cls(file, {name: file for name in _open(file).keys()})

    @classmethod
    def _from_index(cls, index: Path) -> WeightFiles:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise SpecError(f"weights index {str(index)!r} is not a safetensors index (a JSON object with a "
                            f"'weight_map' from tensor names to file names): {exc}") from None
        file_of = _files_of(weight_map, index)
        for file in sorted(set(file_of.values())):
            if not file.is_file():
                names = [n for n, f in file_of.items() if f == file]
                raise SpecError(f"weights index {str(index)!r} maps {names[0]!r} (and {len(names) - 1} more) to "
                                f"{file.name}, which does not exist in {str(index.parent)!r}")
            present = set(_open(file).keys())
            absent = [n for n, f in file_of.items() if f == file and n not in present]
            if absent:
                raise SpecError(f"weights index {str(index)!r} maps {absent[0]!r} to {file.name}, which has no "
                                "tensor of that name")
        return cls(index, file_of)

    def _handle(self, name: str):
        file = self.file_of[name]
        if file not in self._handles:
            self._handles[file] = _open(file)
        return self._handles[file]

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name``, from the file's header."""
        return tuple(self._handle(name).get_slice(name).get_shape())

    def where(self, name: str) -> str:
        """The file that holds ``name``, for messages."""
        return str(self.file_of[name])

    def match(self, model: torch.nn.Module) -> tuple[dict[str, str], dict[str, str]]:
        """Check the files against ``model``: (parameter name -> file name, buffer name -> file name).

        Keys are canonical names (``model.named_parameters()``); the file may use
        any alias of a tied parameter. A parameter the files lack, a name that is
        neither a parameter nor a buffer, or a tensor whose shape differs from the
        model's is a `SpecError` that names it and its file.
        """
        canonical = _canonical_names(model.named_parameters(remove_duplicate=False))
        canonical_buffers = _canonical_names(model.named_buffers(remove_duplicate=False))
        params, buffers = {}, {}
        for name in self.file_of:
            if name in canonical:
                params.setdefault(canonical[name], name)
            elif name in canonical_buffers:
                buffers.setdefault(canonical_buffers[name], name)
            else:
                raise SpecError(f"weights: tensor {name!r} in {self.where(name)} is not a parameter or buffer of "
                                f"{type(model).__name__}; its parameters are named like "
                                f"{_some(list(dict(model.named_parameters())))}")
        missing = [n for n, _ in model.named_parameters() if n not in params]
        if missing:
            raise SpecError(f"weights: parameter {missing[0]!r} is not in {self.path}"
                            + (f" (nor are {len(missing) - 1} more: {_some(missing[1:])})" if len(missing) > 1 else "")
                            + "; every parameter needs a tensor, under its name or the name of a parameter tied to it")
        shapes = {**{n: tuple(p.shape) for n, p in model.named_parameters()},
                  **{n: tuple(b.shape) for n, b in model.named_buffers()}}
        dtypes = {**{n: p.dtype for n, p in model.named_parameters()},
                  **{n: b.dtype for n, b in model.named_buffers()}}
        for canonical_name, key in [*params.items(), *buffers.items()]:
            if self.shape(key) != shapes[canonical_name]:
                raise SpecError(f"weights: tensor {key!r} in {self.where(key)} has shape {list(self.shape(key))}; "
                                f"the model's {canonical_name!r} has shape {list(shapes[canonical_name])}")
            self._check_kind(key, canonical_name, dtypes[canonical_name])
        return params, buffers

    def _check_kind(self, key: str, canonical_name: str, dtype: torch.dtype) -> None:
        """Note [weights dtypes]: a float of another width converts (bfloat16 weights into a float32 model); a
        value of another kind (integers for a float parameter, floats for an integer buffer) is an error."""
        code = self._handle(key).get_slice(key).get_dtype()
        have, want = _kind_of_code(code), _kind_of_dtype(dtype)
        if have != want:
            raise SpecError(f"weights: tensor {key!r} in {self.where(key)} holds {have} values ({code}); the "
                            f"model's {canonical_name!r} is {str(dtype).removeprefix('torch.')} ({want}). Weights "
                            f"of another float width convert; {have} values are never cast to {want}")

    def read(self, name: str, dtype: torch.dtype, block: Block | None = None) -> torch.Tensor:
        """Tensor ``name`` whole (or its ``block``), in ``dtype``."""
        if block is None:
            return self._handle(name).get_tensor(name).to(dtype)
        return self._get(name, (), block).to(dtype)

    def _get(self, name: str, index: tuple[slice, ...], block: Block | None) -> torch.Tensor:
        """``tensor[index]`` read lazily; with a ``block``, ``index`` is into the block (Note [reading shards])."""
        if block is not None:
            index = list(index) + [slice(None)] * (block.dim + 1 - len(index))
            within = index[block.dim]
            lo, hi = within.start or 0, block.size if within.stop is None else within.stop
            index[block.dim] = slice(block.start + lo, block.start + hi)
        return self._handle(name).get_slice(name)[tuple(index)]

    def read_piece(self, name: str, member: Member, rank: int, block: Block | None = None) -> torch.Tensor:
        """Rank ``rank``'s piece of ``member`` from tensor ``name`` (or from its tp ``block``, which ``member``
        is), flattened and padded (Note [reading shards])."""
        dtype = member.info.dtype
        if member.kind is LayoutKind.REPLICATE or member.world == 1:
            return self.read(name, dtype, block).reshape(-1)
        shape = member.info.shape
        if member.kind is LayoutKind.SHARD_FLAT:
            c = member.piece_numel
            lo, hi = min(rank * c, member.info.numel), min((rank + 1) * c, member.info.numel)
            return _pad(self._read_range(name, shape, lo, hi, block).to(dtype), c)
        d, k = member.dim, member.local_shape[member.dim]
        lo, hi = min(rank * k, shape[d]), min((rank + 1) * k, shape[d])
        index = (slice(None),) * d + (slice(lo, hi),)
        slab = self._get(name, index, block).to(dtype)
        if hi - lo < k:
            pad = [0, 0] * (len(shape) - d - 1) + [0, k - (hi - lo)]
            slab = torch.nn.functional.pad(slab, pad)
        return slab.reshape(-1)

    def read_range(self, name: str, info, lo: int, hi: int, block: Block | None = None) -> torch.Tensor:
        """Elements ``[lo, hi)`` of tensor ``name`` (or of its ``block``) flattened, in the dtype of parameter
        ``info`` (`ParamInfo`, at the block's shape).

        A rank's part of a member in a whole flat (Note [whole-flat shards] in `compiler.layout.flat`).
        """
        return self._read_range(name, tuple(info.shape), lo, hi, block).to(info.dtype)

    def _read_range(self, name: str, shape: tuple[int, ...], lo: int, hi: int,
                    block: Block | None = None) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the flattened tensor (or ``block``, of ``shape``), reading only the rows of
        dim 0 that hold them."""
        if hi <= lo:  # this rank's piece is all padding
            return torch.empty(0)
        if len(shape) == 0:
            return self._handle(name).get_tensor(name).reshape(-1)[lo:hi]
        row = math.prod(shape[1:])
        first, last = lo // row, -(-hi // row)
        rows = self._get(name, (slice(first, last),), block).reshape(-1)
        return rows[lo - first * row : hi - first * row]


def _files_of(weight_map: object, index: Path) -> dict[str, Path]:
    """The index's tensor name -> file, each file inside the index's directory (a file from others names
    nothing outside it)."""
    if not isinstance(weight_map, dict):
        raise SpecError(f"weights index {str(index)!r}: 'weight_map' is a {type(weight_map).__name__}; expected a "
                        "JSON object from tensor names to file names")
    root = index.parent.resolve()
    files = {}
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file:
            raise SpecError(f"weights index {str(index)!r} maps {name!r} to {file!r}; expected the name of a "
                            ".safetensors file in {str(index.parent)!r}")
        path = (index.parent / file).resolve()
        if Path(file).is_absolute() or not path.is_relative_to(root):
            raise SpecError(f"weights index {str(index)!r} maps {name!r} to {file!r}, which is outside "
                            f"{str(index.parent)!r}; an index names files of its own directory only")
        files[name] = index.parent / file
    return files


def _kind_of_code(code: str) -> str:
    """safetensors' dtype code as a kind: 'floating-point', 'integer', 'boolean' or 'complex'."""
    if code == "BOOL":
        return "boolean"
    if code.startswith(("F", "BF")):
        return "floating-point"
    if code.startswith("C"):
        return "complex"
    return "integer"


def _kind_of_dtype(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "boolean"
    if dtype.is_complex:
        return "complex"
    return "floating-point" if dtype.is_floating_point else "integer"


def _open(file: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error types for a bad header
        raise SpecError(f"weights file {str(file)!r} is not a safetensors file: {exc}") from None


def _canonical_names(named) -> dict[str, str]:
    """Every name of a tensor (tied aliases included) -> its first name, as ``named_parameters()`` gives it."""
    first: dict[int, str] = {}
    out = {}
    for name, t in named:
        out[name] = first.setdefault(id(t), name)
    return out


def _pad(flat: torch.Tensor, numel: int) -> torch.Tensor:
    return flat if flat.numel() == numel else torch.nn.functional.pad(flat, (0, numel - flat.numel()))


def _some(names: list[str], shown: int = 4) -> str:
    return ", ".join(repr(n) for n in names[:shown]) + (", ..." if len(names) > shown else "")
