"""The inputs of ``shardlang data prepare``: files and folders of text, JSON lines and Parquet, as documents.

A *source* is one input file; its kind comes from its suffix:

- ``.jsonl`` / ``.json``: JSON lines, one document per line, the text in
  ``--text-field`` (default ``text``); blank lines are skipped.
- ``.parquet``: one document per row, the text in the ``--text-field`` column
  (needs ``pyarrow``: ``pip install 'shardlang[data]'``).
- anything else: a text file, one document.

Folders are walked recursively in sorted order, hidden files and folders left
out; ``--glob`` keeps only the files whose name matches (``*.py``). Text is
UTF-8; an invalid byte sequence is replaced by U+FFFD (and the file counted in
the report), never an error, so a corpus with a stray Latin-1 file still
prepares. An empty file is a source with no documents.

Each source has a stable ``name`` (its path relative to the input it was found
under, prefixed by that input's own name) that decides the train/validation
split of its documents, so the split does not depend on where the corpus lies.

Example::

    sources = find_sources(["corpus/", "extra.jsonl"], glob=None)
    for text in documents(sources[0], "text"): ...
"""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Iterator
from pathlib import Path

import attrs

from ..errors import DataError
from .tokenizer import DATA_EXTRA

JSON_LINES = (".jsonl", ".json")
PARQUET = (".parquet",)


@attrs.frozen
class Source:
    """One input file: where it is, its stable name, its kind, and what a second run compares (size, mtime)."""

    path: Path
    name: str
    kind: str  # "text", "jsonl" or "parquet"
    size: int
    mtime_ns: int

    def fingerprint(self) -> list:
        return [self.name, self.kind, self.size, self.mtime_ns]


def find_sources(inputs: list[str], glob: str | None = None) -> list[Source]:
    """Every source under ``inputs`` (files, folders walked recursively), in order; a `DataError` names a missing
    input or an input with no files."""
    sources: list[Source] = []
    for given in inputs:
        root = Path(given).expanduser()
        if not root.exists():
            raise DataError(f"input {given!r} does not exist (looked at {root.resolve()}); give text, JSON lines "
                            "or Parquet files, or folders of them", path=root)
        if root.is_file():
            sources.append(_source(root, root.name))
            continue
        found = [_source(path, f"{root.resolve().name}/{path.relative_to(root).as_posix()}")
                 for path in _walk(root) if glob is None or fnmatch.fnmatch(path.name, glob)]
        if not found:
            raise DataError(f"input folder {given!r} holds no {'files' if glob is None else repr(glob) + ' files'} "
                            "(hidden ones are left out)", path=root)
        sources.extend(found)
    return sources


def documents(source: Source, text_field: str = "text") -> Iterator[tuple[str, bool]]:
    """The documents of ``source`` in order, each with whether invalid UTF-8 was replaced in it."""
    if source.kind == "jsonl":
        yield from _json_lines(source, text_field)
    elif source.kind == "parquet":
        yield from _parquet(source, text_field)
    else:
        data = source.path.read_bytes()
        if data:
            yield _decode(data)


def _walk(root: Path) -> Iterator[Path]:
    for directory, folders, files in os.walk(root):
        folders[:] = sorted(f for f in folders if not f.startswith("."))
        for name in sorted(files):
            if not name.startswith("."):
                path = Path(directory) / name
                if path.is_file():
                    yield path


def _source(path: Path, name: str) -> Source:
    suffix = path.suffix.lower()
    kind = "jsonl" if suffix in JSON_LINES else "parquet" if suffix in PARQUET else "text"
    stat = path.stat()
    return Source(path.resolve(), name, kind, stat.st_size, stat.st_mtime_ns)


def _decode(data: bytes) -> tuple[str, bool]:
    try:
        return data.decode("utf-8"), False
    except UnicodeDecodeError:
        return data.decode("utf-8", errors="replace"), True


def _json_lines(source: Source, field: str) -> Iterator[tuple[str, bool]]:
    with open(source.path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            line, replaced = _decode(raw)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{source.path}:{number}: not a JSON line ({exc.msg} at column {exc.colno}); each "
                                f"line of a .jsonl input is one JSON object with a {field!r} field",
                                path=source.path) from None
            if not isinstance(record, dict) or field not in record:
                keys = sorted(record)[:8] if isinstance(record, dict) else type(record).__name__
                raise DataError(f"{source.path}:{number}: no {field!r} field (it has {keys}); name the text field "
                                "with --text-field", path=source.path)
            text = record[field]
            if not isinstance(text, str):
                raise DataError(f"{source.path}:{number}: field {field!r} is {type(text).__name__}, not a string",
                                path=source.path)
            if text:
                yield text, replaced


def _parquet(source: Source, field: str) -> Iterator[tuple[str, bool]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{source.path}: reading Parquet needs pyarrow, which is not installed; {DATA_EXTRA}",
                        path=source.path) from None
    try:
        table = pq.ParquetFile(source.path)
    except Exception as exc:  # pyarrow's ArrowInvalid for a file that is not Parquet
        raise DataError(f"{source.path}: not a Parquet file ({exc})", path=source.path) from exc
    columns = table.schema_arrow.names
    if field not in columns:
        raise DataError(f"{source.path}: no column {field!r} (columns: {columns[:8]}); name the text column with "
                        "--text-field", path=source.path)
    for batch in table.iter_batches(columns=[field]):
        for text in batch.column(0).to_pylist():
            if text is not None and not isinstance(text, str):
                raise DataError(f"{source.path}: column {field!r} holds {type(text).__name__} values, not strings; "
                                "name the text column with --text-field", path=source.path)
            if text:
                yield text, False
