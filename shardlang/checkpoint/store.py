"""Checkpoint directories on disk: atomic publication, a manifest of checksums, the latest, pruning.

Note [atomic checkpoints]: a checkpoint is written into a temporary sibling
directory (``<name>.tmp``). When every rank's files are written (DCP's own
finish writes ``.metadata``), each rank has its own files' checksums, rank 0 writes
``shardlang.json`` (every file's size and XXH3-64 digest) and renames the directory
into place; the other ranks wait at a barrier for that. A process killed at any
point before the rename leaves only a ``.tmp`` directory, which no reader
treats as a checkpoint (and the next save of that name removes). A
checkpoint is complete exactly when its directory has its final name and a
manifest; `latest` picks the newest complete one.

Note [replacing a checkpoint]: saving again under an existing name (a rerun
with ``--overwrite``) must keep a complete checkpoint findable at every
instant. The old directory is renamed to ``<name>.old`` only once the new one
is complete, the new one is renamed into place, and only then is ``.old``
removed; the parent directory is fsynced after each rename. A crash between the
renames leaves ``<name>.old`` alone, and `CheckpointDir.complete` takes it for
``<name>``, so ``--resume`` finds it.

The manifest also names the run that wrote the checkpoint (a random id per
``shardlang run``, kept across ``--resume``): ``--keep`` prunes only that run's
checkpoints, and never the one it has just saved.

On load every file is checked against the manifest (each rank checks a share
of the digests), so a truncated or corrupt file is a `CheckpointError` naming the
file. Sizes are checked before a byte is read into the state; the digests while
DCP reads (Note [checksums while loading] in `saving`). The digest is XXH3-64
(the `xxhash` library: 13 GB/s on this machine against zlib's CRC-32 at 2.2, so
checking a 600 MB share takes 0.05 s instead of 0.3); manifests written with
CRC-32 (``"crc32"``) are still checked by it.

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
import xxhash

from ..errors import CheckpointError

MANIFEST = "shardlang.json"
TMP_SUFFIX = ".tmp"
OLD_SUFFIX = ".old"
STEP_DIR = re.compile(r"^step-(\d+)$")
READ_BYTES = 1 << 24


def temporary(path: Path) -> Path:
    return path.with_name(path.name + TMP_SUFFIX)


#: The manifest's digest of each file (XXH3-64, as an int); older manifests have "crc32".
DIGEST = "xxh3_64"
#: The manifest's digests of a file's segments, ``[start, end, digest]`` (Note [segment digests] in `checksums`).
SEGMENTS = "segments"


def digest_of(file: Path) -> int:
    digest = xxhash.xxh3_64()
    with open(file, "rb") as f:
        while block := f.read(READ_BYTES):
            digest.update(block)
    return digest.intdigest()


def crc32_of(file: Path) -> int:
    crc = 0
    with open(file, "rb") as f:
        while block := f.read(READ_BYTES):
            crc = zlib.crc32(block, crc)
    return crc


#: The files a checkpointer process leaves its digests in (Note [digests across processes] in `checksums`):
#: read and removed before the manifest is written, never part of a checkpoint.
WRITER_DIGESTS = ".digests."


def own_files(directory: Path, rank: int, world: int) -> list[Path]:
    """The files of ``directory`` this rank checksums: DCP's ``__<rank>_*`` files; rank 0 also the rest."""
    files = sorted(p for p in directory.iterdir()
                   if p.is_file() and p.name != MANIFEST and not p.name.startswith(WRITER_DIGESTS))
    if world == 1:
        return files
    mine = [p for p in files if p.name.startswith(f"__{rank}_")]
    if rank == 0:
        mine += [p for p in files if not re.match(r"^__\d+_", p.name)]
    return mine


def describe(files: list[Path], known: dict[str, dict[str, int]] | None = None) -> dict[str, dict[str, int]]:
    """Each file's size and digest: from ``known`` (what the writer digested as it wrote) when the size on disk
    agrees, else read from disk."""
    known = known or {}
    out = {}
    for p in files:
        size = p.stat().st_size
        record = known.get(p.name)
        out[p.name] = record if record is not None and record["bytes"] == size else {"bytes": size,
                                                                                        DIGEST: digest_of(p)}
    return out


def prepare(path: Path, rank: int, world: int, group) -> Path:
    """Rank 0 removes a stale temporary directory of ``path`` and makes a fresh one; every rank then has it."""
    tmp = temporary(path)
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier(world, group)
    return tmp


def publish(path: Path, rank: int, world: int, group, record: dict,
            known: dict[str, dict[str, int]] | None = None) -> None:
    """Checksum, write the manifest and rename ``path``'s temporary directory into place (Note [atomic checkpoints]).

    Collective over ``group`` (None: no process group, one rank). ``known`` holds the checksums the writer
    computed as it wrote (`checksums.ChecksummingWriter`); other files are read back.
    """
    tmp = temporary(path)
    files = describe(own_files(tmp, rank, world), known)
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
        _fsync_directory(tmp)
        # Note [replacing a checkpoint]: an older checkpoint of the same name steps aside to <name>.old only
        # now that the new one is complete, and is removed only once the new one has its name.
        old = replaced(path)
        if path.exists():
            if old.exists():  # a stale copy: `path` itself is complete
                shutil.rmtree(old)
            path.rename(old)
            _fsync_directory(path.parent)
        tmp.rename(path)
        _fsync_directory(path.parent)
        if old.exists():
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
    """A manifest names plain files of its own directory, each with a size and a digest (XXH3-64, or CRC-32
    in older ones): nothing outside it is read (Note [checkpoints run no code] in `untrusted`)."""
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise CheckpointError(f"{file} is corrupt: it has no \"files\" object (name -> bytes, {DIGEST})", path=file)
    for name, entry in files.items():
        if not _plain_file_name(name):
            raise CheckpointError(f"{file} names the file {name!r}, which is not a file of its directory; a "
                                  "manifest lists plain file names only", path=file)
        digest = DIGEST if isinstance(entry, dict) and DIGEST in entry else "crc32"
        ok = isinstance(entry, dict) and all(isinstance(entry.get(k), int) and not isinstance(entry.get(k), bool)
                                             and entry[k] >= 0 for k in ("bytes", digest))
        if not ok:
            raise CheckpointError(f"{file} is corrupt: the entry of {name!r} is {entry!r}; expected "
                                  f"{{\"bytes\": <int>, \"{DIGEST}\": <int>}}", path=file)
        if SEGMENTS in entry and not _segments_ok(entry[SEGMENTS], entry["bytes"]):
            raise CheckpointError(f"{file} is corrupt: the segments of {name!r} are not [start, end, digest] "
                                  f"triples of increasing, non-overlapping ranges within its {entry['bytes']} bytes",
                                  path=file)


def _segments_ok(segments: object, size: int) -> bool:
    if not isinstance(segments, list):
        return False
    end = 0
    for seg in segments:
        if not (isinstance(seg, list) and len(seg) == 3 and all(isinstance(v, int) and not isinstance(v, bool)
                                                                   and v >= 0 for v in seg)):
            return False
        if not end <= seg[0] < seg[1] <= size:
            return False
        end = seg[1]
    return True


def _plain_file_name(name: object) -> bool:
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name)


def verify(path: Path, manifest: dict, rank: int, world: int, group) -> None:
    """Check every file of the manifest (size, digest), each rank a share; raise on every rank if any is bad."""
    agree_on_damage(path, damaged_files(path, manifest, rank, world), world, group)


def check_sizes(path: Path, manifest: dict) -> None:
    """Every file of the manifest is there with its size (no reading): what a load checks before it writes."""
    problems = [p for name, expected in sorted(manifest["files"].items())
                for p in [_check_file(path / name, expected, read=False)] if p]
    if problems:
        raise CheckpointError(f"checkpoint {path} is damaged: " + "; ".join(problems), path=path)


def damaged_files(path: Path, manifest: dict, rank: int, world: int) -> list[str]:
    """What is wrong with this rank's share of the manifest's files (size, digest); no collective."""
    names = sorted(manifest["files"])
    return [p for i, name in enumerate(names) if i % world == rank
            for p in [_check_file(path / name, manifest["files"][name])] if p]


def agree_on_damage(path: Path, problems: list[str], world: int, group) -> None:
    """Every rank's problems, gathered (a collective over ``group``); raise on every rank if any rank found one."""
    if world > 1:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, problems, group=group)
        problems = [p for part in gathered for p in part]
    if problems:
        raise CheckpointError(f"checkpoint {path} is damaged: " + "; ".join(problems), path=path)


def _check_file(file: Path, expected: dict, read: bool = True) -> str | None:
    if not file.is_file():
        return f"{file} is missing"
    size = file.stat().st_size
    if size != expected["bytes"]:
        return f"{file} has {size} bytes, the manifest says {expected['bytes']} (truncated or overwritten)"
    if read and not _digest_matches(file, expected):
        return f"{file} does not match its checksum (corrupt)"
    return None


def _digest_matches(file: Path, expected: dict) -> bool:
    if DIGEST in expected:
        return digest_of(file) == expected[DIGEST]
    return crc32_of(file) == expected["crc32"]  # a manifest written before XXH3


class CheckpointDir:
    """A directory of checkpoints ``step-<k>`` of one run, the newest ``keep`` of that run kept (None: all).

    ``run_id`` (recorded in each manifest this run publishes) is what `prune` goes by: it removes
    only this run's checkpoints, never another run's, and never the one just saved.

    Example: ``CheckpointDir("runs/a", keep=2).latest()`` is the newest complete checkpoint, or None.
    """

    def __init__(self, root, keep: int | None = None, run_id: str | None = None):
        self.root = Path(root)
        self.keep = keep
        self.run_id = run_id

    def path_for(self, steps: int) -> Path:
        return self.root / f"step-{steps:08d}"

    def complete(self) -> list[tuple[int, Path]]:
        """Every complete checkpoint, oldest first (Note [replacing a checkpoint]: a ``step-<k>.old`` stands
        for ``step-<k>`` when a crash between the two renames left it alone)."""
        if not self.root.is_dir():
            return []
        found: dict[int, Path] = {}
        for p in sorted(self.root.iterdir(), key=lambda p: p.name.endswith(OLD_SUFFIX)):  # step-<k> first
            m = STEP_DIR.match(p.name.removesuffix(OLD_SUFFIX))
            if m and int(m.group(1)) not in found and (p / MANIFEST).is_file():
                found[int(m.group(1))] = p
        return sorted(found.items())

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1][1] if done else None

    def runs(self) -> dict[Path, str | None]:
        """The run that wrote each complete checkpoint (None: written before runs were recorded)."""
        return {path: run_of(path) for _, path in self.complete()}

    def prune(self, just_saved: Path | None = None) -> list[Path]:
        """Remove all but the newest ``keep`` complete checkpoints of this run, never ``just_saved`` (rank 0)."""
        if self.keep is None:
            return []
        mine = [(k, p) for k, p in self.complete() if self.run_id is None or run_of(p) == self.run_id]
        removed = [p for _, p in mine[: max(0, len(mine) - self.keep)] if p != just_saved]
        for p in removed:
            shutil.rmtree(p, ignore_errors=True)
        return removed

    def remove_other_runs(self) -> list[Path]:
        """Remove the complete checkpoints that another run wrote (``--overwrite``, once this run has one)."""
        removed = [p for p, run in self.runs().items() if run != self.run_id]
        for p in removed:
            shutil.rmtree(p, ignore_errors=True)
        return removed

    def remove_unfinished(self) -> list[Path]:
        """Remove the ``.tmp`` directories that saves killed before they completed left behind (rank 0, with no
        save in flight)."""
        if not self.root.is_dir():
            return []
        stale = [p for p in self.root.iterdir()
                 if p.name.endswith(TMP_SUFFIX) and STEP_DIR.match(p.name.removesuffix(TMP_SUFFIX)) and p.is_dir()]
        for p in stale:
            shutil.rmtree(p, ignore_errors=True)
        return stale


def replaced(path: Path) -> Path:
    """Where the checkpoint ``path`` steps aside while a new one of its name takes its place."""
    return path.with_name(path.name + OLD_SUFFIX)


def steps_of(path: Path) -> int | None:
    """The steps done that ``path``'s manifest records (None when it records none, or cannot be read)."""
    steps = _recorded(path, "steps")
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else None


def run_of(path: Path) -> str | None:
    """The run id in ``path``'s manifest (None when it has none, or it cannot be read)."""
    run = _recorded(path, "run")
    return run if isinstance(run, str) else None


def _recorded(path: Path, key: str) -> object:
    """``key`` of ``path``'s manifest, unchecked; None when the manifest cannot be read."""
    try:
        return json.loads((path / MANIFEST).read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def check_directory(root: Path, flag: str = "--checkpoint-dir") -> None:
    """``root`` can hold checkpoints: it is a directory, or one can be made there, and it is writable.

    Called before compiling, so that a bad directory is an error in a second, not after training.
    """
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"{flag} {root} is a file, not a directory; name a directory (it is created if "
                              "missing)", path=root)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"{flag} {root} cannot be created: {exc.strerror or exc}", path=root) from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise CheckpointError(f"{flag} {root} is not writable by this user; name a directory you can write",
                              path=root)


def _fsync_directory(path: Path) -> None:
    """Make a rename in ``path`` durable (POSIX; a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _barrier(world: int, group) -> None:
    if world > 1:
        dist.barrier(group=group)
