"""Checkpoint directories on disk: atomic publication, a manifest of checksums, the latest, pruning.

Note [atomic checkpoints]: a checkpoint is written into a temporary sibling
directory (``<name>.tmp``). When every rank's files are written (DCP's own
finish writes ``.metadata``), each rank checksums its own files, rank 0 writes
``shardlang.json`` (every file's size and CRC-32) and renames the directory
into place; the other ranks wait at a barrier for that. A process killed at any
point before the rename leaves only a ``.tmp`` directory, which no reader
treats as a checkpoint (and the next save of that name removes). A
checkpoint is complete exactly when its directory has its final name and a
manifest; `latest` picks the newest complete one.

On load every file is checked against the manifest before a byte is read into
the state (each rank checks a share of them), so a truncated or corrupt file is
a `CheckpointError` naming the file, and the state is left as it was.

Example::

    store = CheckpointDir("runs/a", keep=3)
    store.path_for(40)       # runs/a/step-00000040
    store.latest()           # runs/a/step-00000040, once complete
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from pathlib import Path

import torch.distributed as dist

from ..errors import CheckpointError

MANIFEST = "shardlang.json"
TMP_SUFFIX = ".tmp"
STEP_DIR = re.compile(r"^step-(\d+)$")
READ_BYTES = 1 << 24


def temporary(path: Path) -> Path:
    return path.with_name(path.name + TMP_SUFFIX)


def crc32_of(file: Path) -> int:
    crc = 0
    with open(file, "rb") as f:
        while block := f.read(READ_BYTES):
            crc = zlib.crc32(block, crc)
    return crc


def own_files(directory: Path, rank: int, world: int) -> list[Path]:
    """The files of ``directory`` this rank checksums: DCP's ``__<rank>_*`` files; rank 0 also the rest."""
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.name != MANIFEST)
    if world == 1:
        return files
    mine = [p for p in files if p.name.startswith(f"__{rank}_")]
    if rank == 0:
        mine += [p for p in files if not re.match(r"^__\d+_", p.name)]
    return mine


def describe(files: list[Path]) -> dict[str, dict[str, int]]:
    return {p.name: {"bytes": p.stat().st_size, "crc32": crc32_of(p)} for p in files}


def prepare(path: Path, rank: int, world: int, group) -> Path:
    """Rank 0 removes a stale temporary directory of ``path`` and makes a fresh one; every rank then has it."""
    tmp = temporary(path)
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier(world, group)
    return tmp


def publish(path: Path, rank: int, world: int, group, record: dict) -> None:
    """Checksum, write the manifest and rename ``path``'s temporary directory into place (Note [atomic checkpoints]).

    Collective over ``group`` (None: no process group, one rank).
    """
    tmp = temporary(path)
    files = describe(own_files(tmp, rank, world))
    if world > 1:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, files, group=group)
    else:
        gathered = [files]
    if rank == 0:
        manifest = {**record, "files": {k: v for part in gathered for k, v in part.items()}}
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        old = None
        if path.exists():  # replace an older checkpoint of the same name only now that the new one is complete
            old = path.with_name(path.name + ".old")
            if old.exists():
                shutil.rmtree(old)
            path.rename(old)
        tmp.rename(path)
        if old is not None:
            shutil.rmtree(old)
    _barrier(world, group)


def read_manifest(path: Path) -> dict:
    """The manifest of a complete checkpoint; a `CheckpointError` naming what is wrong otherwise."""
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {path}: not a directory", path=path)
    file = path / MANIFEST
    if not file.is_file():
        hint = " (an unfinished save: the run stopped before it completed)" if path.name.endswith(TMP_SUFFIX) else ""
        raise CheckpointError(f"{path} is not a complete shardlang checkpoint: it has no {MANIFEST}{hint}", path=path)
    try:
        manifest = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file} is corrupt: {exc}", path=file) from None
    _check_manifest(manifest, file)
    return manifest


def _check_manifest(manifest: object, file: Path) -> None:
    """A manifest names plain files of its own directory, each with a size and a CRC-32: nothing outside it
    is read (Note [checkpoints run no code] in `untrusted`)."""
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise CheckpointError(f"{file} is corrupt: it has no \"files\" object (name -> bytes, crc32)", path=file)
    for name, entry in files.items():
        if not _plain_file_name(name):
            raise CheckpointError(f"{file} names the file {name!r}, which is not a file of its directory; a "
                                  "manifest lists plain file names only", path=file)
        ok = isinstance(entry, dict) and all(isinstance(entry.get(k), int) and not isinstance(entry.get(k), bool)
                                             and entry[k] >= 0 for k in ("bytes", "crc32"))
        if not ok:
            raise CheckpointError(f"{file} is corrupt: the entry of {name!r} is {entry!r}; expected "
                                  "{\"bytes\": <int>, \"crc32\": <int>}", path=file)


def _plain_file_name(name: object) -> bool:
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name)


def verify(path: Path, manifest: dict, rank: int, world: int, group) -> None:
    """Check every file of the manifest (size, CRC-32), each rank a share; raise on every rank if any is bad."""
    names = sorted(manifest["files"])
    problems = [p for i, name in enumerate(names) if i % world == rank
                for p in [_check_file(path / name, manifest["files"][name])] if p]
    if world > 1:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, problems, group=group)
        problems = [p for part in gathered for p in part]
    if problems:
        raise CheckpointError(f"checkpoint {path} is damaged: " + "; ".join(problems), path=path)


def _check_file(file: Path, expected: dict) -> str | None:
    if not file.is_file():
        return f"{file} is missing"
    size = file.stat().st_size
    if size != expected["bytes"]:
        return f"{file} has {size} bytes, the manifest says {expected['bytes']} (truncated or overwritten)"
    if crc32_of(file) != expected["crc32"]:
        return f"{file} does not match its checksum (corrupt)"
    return None


class CheckpointDir:
    """A directory of checkpoints ``step-<k>``, the newest ``keep`` kept (None: all).

    Example: ``CheckpointDir("runs/a", keep=2).latest()`` is the newest complete checkpoint, or None.
    """

    def __init__(self, root, keep: int | None = None):
        self.root = Path(root)
        self.keep = keep

    def path_for(self, steps: int) -> Path:
        return self.root / f"step-{steps:08d}"

    def complete(self) -> list[tuple[int, Path]]:
        """Every complete checkpoint, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            m = STEP_DIR.match(p.name)
            if m and (p / MANIFEST).is_file():
                found.append((int(m.group(1)), p))
        return sorted(found)

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1][1] if done else None

    def prune(self) -> list[Path]:
        """Remove all but the newest ``keep`` complete checkpoints (rank 0 calls it)."""
        if self.keep is None:
            return []
        done = self.complete()
        removed = [p for _, p in done[: max(0, len(done) - self.keep)]]
        for p in removed:
            shutil.rmtree(p, ignore_errors=True)
        return removed


def _barrier(world: int, group) -> None:
    if world > 1:
        dist.barrier(group=group)
