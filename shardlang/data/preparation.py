"""``shardlang data prepare``: tokenize text once into token shards on disk (Note [prepared token data]).

The inputs (`shardlang.data.inputs`) are cut into groups of about `GROUP_BYTES`
of input, in order; each group is tokenized by a worker process into one
shard per split and a ``part-<g>.json`` record, each written atomically. A
document goes to the validation split when a hash of its source's name and its
number falls below ``val_fraction``, so the split depends on neither the
workers nor where the corpus lies.

Note [resuming a preparation]: a group's record holds a fingerprint of
everything its shards depend on (the format, the tokenizer and its checksum,
the end-of-document id, the dtype, the split fraction, the text field, and each
source's name, size and modification time). A run skips every group whose
record and shards are there with the same fingerprint, so a killed run resumes
where it stopped, and a second run over unchanged inputs is a no-op (the index
holds the fingerprint of the whole). The index is written last; the stream of
each split is its groups' shards in order, so it does not depend on how many
workers wrote them.

Example::

    report = prepare(["corpus/"], "data/corpus", tokenizer="byte", workers=2)
    report.tokens["train"], report.megabytes_per_second
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import attrs
import numpy as np
import tqdm
import xxhash

from ..errors import DataError
from .index import FORMAT, INDEX_FILE, SPLITS, VERSION, Shard, TokenIndex, file_checksum, read_index
from .inputs import Source, documents, find_sources
from .tokenizer import (TOKENIZER_FILE, TRAINED_EOD, ByteTokenizer, HFTokenizer, TokenizerChoice, load_tokenizer,
                        token_dtype, train_bpe)

GROUP_BYTES = 8 << 20  # input bytes per group: a shard per split, the unit of work and of resuming
DOCS_PER_BATCH = 512  # documents handed to the tokenizer at once
TRAINED_MARKER = "tokenizer.trained.json"  # what a trained tokenizer was trained on (a rerun reuses it)
OWN_FILE = re.compile(r"(part-\d{5}\.json|(train|val)-\d{5}\.npy|index\.json|tokenizer(\.trained)?\.json)(\.tmp)?")


@attrs.frozen
class Settings:
    """What every group's shards depend on besides its sources (sent to the workers)."""

    tokenizer_kind: str  # "byte" or "huggingface"
    tokenizer_path: str | None
    tokenizer_xxh3: str | None
    eod_token: str | None
    eod: int
    vocab_size: int
    dtype: str
    val_fraction: float
    text_field: str

    def fingerprint(self, sources: list[Source]) -> str:
        described = [FORMAT, VERSION, self.tokenizer_kind, self.tokenizer_xxh3, self.eod, self.vocab_size, self.dtype,
                     self.val_fraction, self.text_field, [s.fingerprint() for s in sources]]
        return xxhash.xxh3_64_hexdigest(json.dumps(described).encode())

    def tokenizer_record(self) -> dict:
        if self.tokenizer_kind == "byte":
            return {"kind": "byte"}
        return {"kind": "huggingface", "file": TOKENIZER_FILE, "xxh3": self.tokenizer_xxh3, "eod": self.eod_token}


@attrs.frozen
class Group:
    """Sources tokenized together into ``train-<number>.npy`` and ``val-<number>.npy``."""

    number: int
    sources: tuple[Source, ...]

    @property
    def input_bytes(self) -> int:
        return sum(s.size for s in self.sources)


@attrs.frozen
class Report:
    """What a preparation did: the directory, its tokens and documents per split, and how fast it went."""

    directory: Path
    input_bytes: int
    groups: int
    groups_done_before: int
    seconds: float
    tokens: dict[str, int]
    documents: dict[str, int]
    replaced_files: int  # sources with invalid UTF-8, replaced by U+FFFD
    dropped_nul: int  # NUL characters the byte tokenizer dropped (its end-of-document byte)
    up_to_date: bool  # nothing to do: the index matched the inputs
    tokenizer_s: float = 0.0  # of ``seconds``, training the BPE (train-bpe)

    @property
    def megabytes_per_second(self) -> float:
        """Input tokenized per second (the groups this run did; a BPE's training not counted)."""
        done = self.input_bytes * (self.groups - self.groups_done_before) / max(self.groups, 1)
        seconds = self.seconds - self.tokenizer_s
        return done / 1e6 / seconds if seconds > 0 else 0.0

    def summary(self) -> str:
        if self.up_to_date:
            return (f"{self.directory}: up to date ({self.tokens.get('train', 0):,} train and "
                    f"{self.tokens.get('val', 0):,} validation tokens); nothing to do")
        lines = [f"{self.directory}: {self.input_bytes / 1e6:.1f} MB of input in {self.groups} group"
                 f"{'s' if self.groups != 1 else ''}"
                 + (f" ({self.groups_done_before} done before, resumed)" if self.groups_done_before else "")
                 + f", {self.seconds:.1f} s"
                 + (f" ({self.tokenizer_s:.1f} s training the tokenizer)" if self.tokenizer_s else "")
                 + f", tokenized at {self.megabytes_per_second:.1f} MB/s"]
        for split in SPLITS:
            lines.append(f"  {split}: {self.tokens.get(split, 0):,} tokens in {self.documents.get(split, 0):,} "
                         "documents")
        if self.replaced_files:
            lines.append(f"  {self.replaced_files} input file(s) held invalid UTF-8, replaced by U+FFFD")
        if self.dropped_nul:
            lines.append(f"  {self.dropped_nul} NUL character(s) dropped (byte 0 is the end-of-document token)")
        return "\n".join(lines)


def prepare(inputs: list[str], out: str | Path, tokenizer: str = "byte", *, val_fraction: float = 0.01,
            workers: int | None = None, glob: str | None = None, text_field: str = "text", eod: str | None = None,
            progress: bool | None = None) -> Report:
    """Tokenize ``inputs`` into the directory ``out`` (Note [prepared token data]); resumable, a no-op when done.

    ``tokenizer``: "byte", "train-bpe:VOCAB" or a tokenizer.json path (`TokenizerChoice`). ``workers``: processes
    (default: the cores). ``progress``: a bar on stderr (default: when stderr is a terminal).
    """
    started = time.perf_counter()
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"--val-fraction {val_fraction} is not in [0, 1); e.g. 0.01 keeps 1% of the documents for "
                        "validation")
    directory = _output_directory(out)
    sources = find_sources(inputs, glob)
    choice = TokenizerChoice.parse(tokenizer)
    before = time.perf_counter()
    settings = _settings(choice, directory, sources, val_fraction, text_field, eod)
    tokenizer_s = time.perf_counter() - before if choice.kind == "train-bpe" else 0.0
    groups = _groups(sources)
    fingerprint = settings.fingerprint(sources)
    current = _current_index(directory, fingerprint)
    if current is not None:
        return Report(directory, current.input_bytes, len(groups), len(groups), time.perf_counter() - started,
                      {s: current.tokens(s) for s in SPLITS},
                      {s: sum(x.documents for x in current.splits.get(s, ())) for s in SPLITS}, 0, 0, True)
    todo, records = [], {}
    for group in groups:
        record = _finished(directory, group, settings)
        if record is None:
            todo.append(group)
        else:
            records[group.number] = record
    done_before = len(records)
    workers = max(1, min(workers or os.cpu_count() or 1, len(todo) or 1))
    show = progress if progress is not None else _stderr_is_terminal()
    with tqdm.tqdm(total=sum(g.input_bytes for g in groups), initial=sum(g.input_bytes for g in groups
                                                                          if g.number in records),
                   unit="B", unit_scale=True, desc=f"prepare {directory.name}", disable=not show) as bar:
        for record, group in _run(todo, directory, settings, workers):
            records[group.number] = record
            bar.update(group.input_bytes)
    index = _write_index(directory, groups, records, settings, fingerprint, sum(s.size for s in sources))
    _remove_stale(directory, len(groups))
    return Report(directory, index.input_bytes, len(groups), done_before, time.perf_counter() - started,
                  {s: index.tokens(s) for s in SPLITS},
                  {s: sum(x.documents for x in index.splits.get(s, ())) for s in SPLITS},
                  sum(r["replaced_files"] for r in records.values()), sum(r["dropped_nul"] for r in records.values()),
                  False, tokenizer_s)


def in_validation(source_name: str, number: int, fraction: float) -> bool:
    """Whether document ``number`` of the source named ``source_name`` belongs to the validation split.

    >>> in_validation("corpus/a.txt", 0, 0.0), in_validation("corpus/a.txt", 0, 0.999999)
    (False, True)
    """
    return xxhash.xxh3_64_intdigest(f"{source_name}\0{number}".encode()) / 2.0**64 < fraction


def tokenize_group(directory: str, group: Group, settings: Settings) -> dict:
    """Tokenize one group into its shards and its record (a worker's job; module level for pickling)."""
    tokenizer = _worker_tokenizer(settings)
    dtype = np.dtype(settings.dtype)
    ids: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    counts = {s: 0 for s in SPLITS}
    replaced_files, dropped = 0, 0
    eod = np.array([settings.eod], dtype=np.int64)
    for source in group.sources:
        pending: list[tuple[str, str]] = []
        replaced = False
        for number, (text, bad) in enumerate(documents(source, settings.text_field)):
            replaced |= bad
            pending.append((text, "val" if in_validation(source.name, number, settings.val_fraction) else "train"))
            if len(pending) >= DOCS_PER_BATCH:
                dropped += _encode(tokenizer, pending, ids, counts, eod)
                pending = []
        dropped += _encode(tokenizer, pending, ids, counts, eod)
        replaced_files += replaced
    out = Path(directory)
    record = {"fingerprint": settings.fingerprint(list(group.sources)), "replaced_files": replaced_files,
              "dropped_nul": dropped, "shards": {}}
    for split in SPLITS:
        if not counts[split]:
            continue
        tokens = np.concatenate(ids[split])
        if tokens.size and int(tokens.max()) >= settings.vocab_size:
            raise DataError(f"the tokenizer gave id {int(tokens.max())}, outside its vocabulary of "
                            f"{settings.vocab_size}")
        name = f"{split}-{group.number:05d}.npy"
        _save_array(out / name, tokens.astype(dtype, copy=False))
        record["shards"][split] = Shard(name, int(tokens.size), counts[split], file_checksum(out / name)).to_json()
    _write_json(out / _part_name(group.number), record)
    return record


def _encode(tokenizer, pending: list[tuple[str, str]], ids: dict, counts: dict, eod: np.ndarray) -> int:
    if not pending:
        return 0
    encoded, dropped = tokenizer.encode_batch([text for text, _ in pending])
    for (_, split), tokens in zip(pending, encoded):
        ids[split].append(tokens.astype(np.int64, copy=False))
        ids[split].append(eod)
        counts[split] += 1
    return dropped


_TOKENIZERS: dict = {}


def _worker_tokenizer(settings: Settings):
    key = (settings.tokenizer_kind, settings.tokenizer_path, settings.eod_token)
    if key not in _TOKENIZERS:
        path = Path(settings.tokenizer_path) if settings.tokenizer_path else None
        _TOKENIZERS[key] = load_tokenizer(settings.tokenizer_kind, path, settings.eod_token)
    return _TOKENIZERS[key]


def _run(todo: list[Group], directory: Path, settings: Settings, workers: int):
    """Tokenize ``todo``, yielding (record, group) as each finishes: in this process, or in ``workers`` processes."""
    if workers == 1:
        for group in todo:
            yield tokenize_group(str(directory), group, settings), group
        return
    context = multiprocessing.get_context("spawn")  # no fork of a process holding threads (tokenizers, torch)
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_quiet_tokenizers) as pool:
        futures = {pool.submit(tokenize_group, str(directory), g, settings): g for g in todo}
        try:
            for future in as_completed(futures):
                yield future.result(), futures[future]
        except BaseException:
            for future in futures:
                future.cancel()
            raise


def _quiet_tokenizers() -> None:
    # One worker per core already: the library's own thread pool per worker would oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _settings(choice: TokenizerChoice, directory: Path, sources: list[Source], val_fraction: float,
              text_field: str, eod: str | None) -> Settings:
    """The tokenizer made ready (a file copied in, a BPE trained), and the settings every group shares."""
    if choice.kind == "byte":
        if eod is not None:
            raise DataError(f"--eod {eod!r}: the byte tokenizer's end-of-document token is byte 0; --eod is for a "
                            "tokenizer.json")
        tok = ByteTokenizer()
        return Settings("byte", None, None, None, tok.eod, tok.vocab_size, token_dtype(tok.vocab_size).name,
                        val_fraction, text_field)
    path = directory / TOKENIZER_FILE
    if choice.kind == "train-bpe":
        _train_once(path, choice.vocab_size, sources, val_fraction, text_field)
        eod = TRAINED_EOD
    else:
        tmp = path.with_name(TOKENIZER_FILE + ".tmp")
        tmp.write_bytes(choice.path.read_bytes())
        tmp.replace(path)
    tok = HFTokenizer(path, eod)
    return Settings("huggingface", str(path), file_checksum(path), tok.eod_token, tok.eod, tok.vocab_size,
                    token_dtype(tok.vocab_size).name, val_fraction, text_field)


def _train_once(path: Path, vocab_size: int, sources: list[Source], val_fraction: float, text_field: str) -> None:
    """Train the BPE on the training documents, unless the one in the directory was trained on the same."""
    marker = path.with_name(TRAINED_MARKER)
    trained_on = xxhash.xxh3_64_hexdigest(json.dumps([vocab_size, val_fraction, text_field,
                                                      [s.fingerprint() for s in sources]]).encode())
    if path.is_file() and marker.is_file():
        try:
            if json.loads(marker.read_text()).get("trained_on") == trained_on:
                return
        except json.JSONDecodeError:
            pass

    def texts():
        for source in sources:
            for number, (text, _) in enumerate(documents(source, text_field)):
                if not in_validation(source.name, number, val_fraction):
                    yield text

    train_bpe(texts(), vocab_size, path)
    _write_json(marker, {"trained_on": trained_on, "vocab_size": vocab_size})


def _groups(sources: list[Source]) -> list[Group]:
    groups, current, size = [], [], 0
    for source in sources:
        if current and size + source.size > GROUP_BYTES:
            groups.append(Group(len(groups), tuple(current)))
            current, size = [], 0
        current.append(source)
        size += source.size
    if current:
        groups.append(Group(len(groups), tuple(current)))
    return groups


def _output_directory(out: str | Path) -> Path:
    directory = Path(out).expanduser()
    if directory.exists() and not directory.is_dir():
        raise DataError(f"--out {str(out)!r} is a file; give a directory for the prepared data", path=directory)
    if directory.is_dir():
        foreign = sorted(p.name for p in directory.iterdir() if not OWN_FILE.fullmatch(p.name))
        if foreign:
            raise DataError(f"--out {str(out)!r} holds files that are not prepared data ({foreign[:3]}); give an "
                            "empty or new directory, or one an earlier `shardlang data prepare` wrote",
                            path=directory)
    directory.mkdir(parents=True, exist_ok=True)
    return directory.resolve()


def _current_index(directory: Path, fingerprint: str) -> TokenIndex | None:
    """The directory's index when it was written for exactly these inputs and settings (a second run: no-op)."""
    if not (directory / INDEX_FILE).is_file():
        return None
    try:
        index = read_index(directory)
    except DataError:
        return None
    files = [directory / s.file for shards in index.splits.values() for s in shards]
    return index if index.fingerprint == fingerprint and all(f.is_file() for f in files) else None


def _finished(directory: Path, group: Group, settings: Settings) -> dict | None:
    """A group's record when an earlier run finished it with the same fingerprint (Note [resuming a preparation])."""
    path = directory / _part_name(group.number)
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or record.get("fingerprint") != settings.fingerprint(list(group.sources)):
        return None
    shards = record.get("shards")
    if not isinstance(shards, dict) or not all(isinstance(s, dict) and (directory / str(s.get("file"))).is_file()
                                               for s in shards.values()):
        return None
    return record


def _write_index(directory: Path, groups: list[Group], records: dict[int, dict], settings: Settings,
                 fingerprint: str, input_bytes: int) -> TokenIndex:
    splits = {s: tuple(Shard(**records[g.number]["shards"][s]) for g in groups if s in records[g.number]["shards"])
              for s in SPLITS}
    if not splits["train"]:
        raise DataError(f"the inputs hold no training documents (every file empty, or every document in the "
                        f"validation split); nothing to write to {directory}", path=directory)
    index = TokenIndex(directory, settings.tokenizer_record(), settings.vocab_size, settings.eod, settings.dtype,
                       splits, fingerprint, settings.val_fraction, input_bytes)
    index.write()
    return index


def _remove_stale(directory: Path, groups: int) -> None:
    """Remove shards and records of groups an earlier, larger preparation left (this run's index names none)."""
    for path in directory.iterdir():
        match = re.fullmatch(r"(?:part|train|val)-(\d{5})\.(?:json|npy)", path.name)
        if match and int(match.group(1)) >= groups:
            path.unlink()


def _part_name(number: int) -> str:
    return f"part-{number:05d}.json"


def _save_array(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.lib.format.write_array(f, array, allow_pickle=False)
    tmp.replace(path)


def _write_json(path: Path, value) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1) + "\n")
    tmp.replace(path)


def _stderr_is_terminal() -> bool:
    import sys

    return sys.stderr.isatty()
