"""The digests of a checkpoint's files, computed by the writer threads as the bytes go out.

`store.publish` needs every file's size and digest (`store.DIGEST`) for the manifest. Reading
each file back to checksum it costs a second pass over the whole state (at
100M parameters, 600 MB a rank). `ChecksummingWriter` is DCP's
`FileSystemWriter` whose streams update a running digest on every write, so the
digests are ready when the files are closed.

Note [segment digests]: besides each whole file's digest, the stream digests
the file in segments, cut wherever the writer asks for its position (DCP asks
at the start and the end of every item it writes). A load then checks each
item's bytes as DCP reads them (`untrusted.SafeReader`), instead of reading
every file twice. A file written out of order (a
seek back) is not trusted: it is checksummed again from disk, as is any file
the writer did not write itself.

Note [digests across processes]: with DCP's process checkpointer the writer is
pickled into a process of its own, so the digests it computes never reach the
trainer's copy. Given ``digests_file=True``, the writer also leaves them in
``.digests.<rank>.json`` in the checkpoint's temporary directory, for
`store.publish` (in the trainer) to read and remove before the manifest.

Example::

    writer = ChecksummingWriter(tmp, thread_count=2)
    dcp.save(state, storage_writer=writer)
    writer.checksums      # {"__0_0.distcp": {"bytes": ..., "xxh3_64": ...}, ".metadata": {...}}
"""

from __future__ import annotations

import contextlib
import io
import json
import threading
from pathlib import Path

import xxhash
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from .store import DIGEST, SEGMENTS, WRITER_DIGESTS


class _ChecksummedStream(io.RawIOBase):
    """A write stream that passes every write through and folds it into the digest."""

    def __init__(self, raw):
        super().__init__()
        self.raw = raw
        self.digest = xxhash.xxh3_64()
        self.size = 0
        self.in_order = True  # every write appended at the end so far
        self.segments: list[list[int]] = []  # [start, end, digest] (Note [segment digests])
        self._segment = xxhash.xxh3_64()
        self._segment_start = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        written = self.raw.write(view)
        self.digest.update(view[:written])
        self._segment.update(view[:written])
        self.size += written
        return written

    def tell(self) -> int:
        position = self.raw.tell()
        if position == self.size:
            self.cut()
        return position

    def cut(self) -> None:
        """End the current segment here (nothing happens when it is empty)."""
        if self.size > self._segment_start:
            self.segments.append([self._segment_start, self.size, self._segment.intdigest()])
            self._segment = xxhash.xxh3_64()
            self._segment_start = self.size

    def seek(self, offset, whence=io.SEEK_SET) -> int:
        position = self.raw.seek(offset, whence)
        if position != self.size:  # a write here would not append: the running digests no longer hold
            self.in_order = False
        return position

    def seekable(self) -> bool:
        return self.raw.seekable()

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()


class _ChecksummingFileSystem(FileSystem):
    """DCP's local file system, whose write streams digest what they write (file name -> bytes, digest)."""

    def __init__(self):
        super().__init__()
        self.checksums: dict[str, dict[str, int]] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:  # to DCP's checkpointer process (Note [digests across processes])
        return {"checksums": self.checksums}

    def __setstate__(self, state: dict) -> None:
        self.checksums = state["checksums"]
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = _ChecksummedStream(raw)
            yield stream
            raw.flush()
        stream.cut()
        with self._lock:
            if stream.in_order:
                self.checksums[Path(path).name] = {"bytes": stream.size, DIGEST: stream.digest.intdigest(),
                                                   SEGMENTS: stream.segments}
            else:
                self.checksums.pop(Path(path).name, None)

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        with self._lock:
            record = self.checksums.pop(Path(path).name, None)
            if record is not None:
                self.checksums[Path(new_path).name] = record


class ChecksummingWriter(FileSystemWriter):
    """`FileSystemWriter` that knows each file's size and digest once written (`checksums`).

    With ``digests_file``, each rank also writes them to `digests_path` (Note [digests across processes]).
    """

    def __init__(self, path, *, digests_file: bool = False, **kwargs):
        super().__init__(path, **kwargs)
        self.fs = _ChecksummingFileSystem()
        self.digests_file = digests_file

    @property
    def checksums(self) -> dict[str, dict[str, int]]:
        return dict(self.fs.checksums)

    def written_digests(self, rank: int) -> dict[str, dict[str, int]]:
        """Rank ``rank``'s digests: computed here, or left by a checkpointer process (`digests_path`)."""
        return take_digests(Path(self.path), rank) if self.digests_file else self.checksums

    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)  # DCP's writer threads are done when it returns
        if self.digests_file:
            digests_path(Path(self.path), self.rank or 0).write_text(json.dumps(self.checksums))
        return written


def digests_path(directory: Path, rank: int) -> Path:
    """Where rank ``rank``'s writer leaves its digests (Note [digests across processes])."""
    return directory / f"{WRITER_DIGESTS}{rank}.json"


def take_digests(directory: Path, rank: int) -> dict[str, dict[str, int]]:
    """The digests rank ``rank``'s writer left in ``directory``, removing their file; {} when there is none."""
    path = digests_path(directory, rank)
    try:
        digests = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    path.unlink()
    return digests
