"""A prepared data directory's index, and its token shards, read as untrusted input.

Note [prepared token data]: ``shardlang data prepare`` writes a directory::

    index.json            what follows, written last (atomically): the directory is complete when it exists
    tokenizer.json        the Hugging Face tokenizer, when one was used (the index holds its checksum)
    train-00000.npy ...   token shards: 1-D NumPy arrays of the smallest unsigned dtype holding the vocabulary
    val-00000.npy ...     the validation split's shards
    part-00000.json ...   one record per group of inputs, so a killed run resumes where it stopped

Each split is one stream of tokens: its shards in index order, each document's
tokens followed by the end-of-document token (documents are packed, as
torchtitan and nanoGPT pack them). The index records the tokenizer, the
vocabulary size, the end-of-document id, the dtype, and every shard's file,
token count and xxh3-64 checksum.

Nothing in the directory is trusted (a data folder is often someone else's):
the index is JSON whose every field is checked for type and range, shard names
must be plain file names of this directory, shards are opened by NumPy with
``allow_pickle=False`` and checked against the index's dtype, length and
checksum. A mismatch is a `DataError` that names the file and the value.

Example::

    index = read_index("data/python")
    index.vocab_size, index.eod, index.tokens("train")
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import attrs
import numpy as np

from ..checkpoint.store import digest_of
from ..errors import DataError

INDEX_FILE = "index.json"
FORMAT = "shardlang.tokens"
VERSION = 1
SPLITS = ("train", "val")
DTYPES = ("uint8", "uint16", "uint32")
SHARD_NAME = re.compile(r"(train|val)-\d{5}\.npy")


@attrs.frozen
class Shard:
    """One token shard: its file name in the directory, its number of tokens and documents, its checksum."""

    file: str
    tokens: int
    documents: int
    xxh3: str

    def to_json(self) -> dict:
        return attrs.asdict(self)


@attrs.frozen
class TokenIndex:
    """A prepared directory's index (Note [prepared token data])."""

    directory: Path
    tokenizer: dict  # {"kind": "byte"} or {"kind": "huggingface", "file": "tokenizer.json", "xxh3": ..., "eod": ...}
    vocab_size: int
    eod: int
    dtype: str
    splits: dict[str, tuple[Shard, ...]]
    fingerprint: str = ""
    val_fraction: float = 0.0
    input_bytes: int = 0

    @property
    def path(self) -> Path:
        return self.directory / INDEX_FILE

    def tokens(self, split: str) -> int:
        return sum(s.tokens for s in self.splits.get(split, ()))

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "tokenizer": self.tokenizer, "vocab_size": self.vocab_size,
                "eod": self.eod, "dtype": self.dtype, "val_fraction": self.val_fraction,
                "fingerprint": self.fingerprint, "input_bytes": self.input_bytes,
                "splits": {name: [s.to_json() for s in shards] for name, shards in self.splits.items()}}

    def write(self) -> None:
        """Write ``index.json`` atomically (a reader sees the old index or the new, whole)."""
        tmp = self.path.with_name(INDEX_FILE + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        tmp.replace(self.path)

    def open_split(self, split: str, verify: bool = True) -> list[np.ndarray]:
        """The split's shards, memory-mapped in index order; with ``verify``, each checked against its checksum."""
        if split not in SPLITS:
            raise DataError(f"split {split!r} is not one of {list(SPLITS)}", path=self.path)
        arrays = []
        for shard in self.splits.get(split, ()):
            path = self.directory / shard.file
            if not path.is_file():
                raise DataError(f"{path}: token shard named by {self.path} is missing; prepare the data again "
                                "(shardlang data prepare resumes and rewrites it)", path=path)
            if verify:
                got = file_checksum(path)
                if got != shard.xxh3:
                    raise DataError(f"{path}: checksum {got} differs from {shard.xxh3} in {self.path}: the shard "
                                    "changed after it was prepared, or is damaged; prepare the data again",
                                    path=path)
            try:
                array = np.load(path, mmap_mode="r", allow_pickle=False)
            except (ValueError, OSError) as exc:
                raise DataError(f"{path}: not a NumPy token shard ({exc})", path=path) from exc
            if array.dtype != np.dtype(self.dtype) or array.shape != (shard.tokens,):
                raise DataError(f"{path}: holds {array.dtype} of shape {array.shape}; {self.path} says "
                                f"{self.dtype} of shape ({shard.tokens},)", path=path)
            arrays.append(array)
        return arrays


def file_checksum(path: Path) -> str:
    """The xxh3-64 of a file's bytes (as a checkpoint's manifest digests its files), as 16 hex digits."""
    return f"{digest_of(path):016x}"


def read_index(directory: str | Path) -> TokenIndex:
    """The index of the prepared directory ``directory``, every field checked; a `DataError` names what is wrong."""
    root = Path(directory).expanduser()
    path = root / INDEX_FILE
    if not path.is_file():
        what = "does not exist" if not root.exists() else "has no index.json"
        raise DataError(f"prepared data {str(directory)!r} {what} (looked at {path.resolve()}); prepare it with "
                        f"`shardlang data prepare INPUT... --out {directory}`", path=path)
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: not a JSON index ({exc}); prepare the data again", path=path) from None
    field = _Fields(raw, path)
    if field.get("format", str) != FORMAT or field.get("version", int) != VERSION:
        raise DataError(f"{path}: format {raw.get('format')!r} version {raw.get('version')!r} is not "
                        f"{FORMAT!r} version {VERSION}; prepare the data with this shardlang", path=path)
    dtype = field.get("dtype", str)
    if dtype not in DTYPES:
        raise DataError(f"{path}: dtype {dtype!r} is not one of {list(DTYPES)}", path=path)
    vocab = field.get("vocab_size", int)
    if not 1 <= vocab <= np.iinfo(dtype).max + 1:
        raise DataError(f"{path}: vocab_size {vocab} does not fit dtype {dtype}", path=path)
    eod = field.get("eod", int)
    if not 0 <= eod < vocab:
        raise DataError(f"{path}: eod {eod} is not an id of the vocabulary (0 to {vocab - 1})", path=path)
    tokenizer = field.get("tokenizer", dict)
    splits_raw = field.get("splits", dict)
    splits = {}
    for name, shards in splits_raw.items():
        if name not in SPLITS or not isinstance(shards, list):
            raise DataError(f"{path}: split {name!r} is not one of {list(SPLITS)} with a list of shards", path=path)
        splits[name] = tuple(_shard(entry, name, path) for entry in shards)
    return TokenIndex(root.resolve(), tokenizer, vocab, eod, dtype, splits, str(raw.get("fingerprint", "")),
                      float(raw.get("val_fraction", 0.0)), int(raw.get("input_bytes", 0)))


class _Fields:
    """Typed access to the index's top-level fields; a missing or mistyped one is a `DataError`."""

    def __init__(self, raw, path: Path):
        if not isinstance(raw, dict):
            raise DataError(f"{path}: the index is a JSON {type(raw).__name__}, not an object", path=path)
        self.raw, self.path = raw, path

    def get(self, name: str, kind: type):
        value = self.raw.get(name)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise DataError(f"{self.path}: field {name!r} is {value!r}; expected a {kind.__name__}", path=self.path)
        return value


def _shard(entry, split: str, path: Path) -> Shard:
    if not isinstance(entry, dict):
        raise DataError(f"{path}: a shard of split {split!r} is {entry!r}, not an object", path=path)
    file, tokens, documents, digest = (entry.get(k) for k in ("file", "tokens", "documents", "xxh3"))
    if not (isinstance(file, str) and SHARD_NAME.fullmatch(file) and file.startswith(split + "-")):
        raise DataError(f"{path}: shard file {file!r} of split {split!r} is not a name like "
                        f"{split}-00000.npy in the data directory", path=path)
    for name, value in (("tokens", tokens), ("documents", documents)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise DataError(f"{path}: shard {file}: {name} is {value!r}; expected an integer >= 0", path=path)
    if not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{16}", digest)):
        raise DataError(f"{path}: shard {file}: xxh3 {digest!r} is not 16 hex digits", path=path)
    return Shard(file, tokens, documents, digest)
