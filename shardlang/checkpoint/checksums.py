"""The digests of a checkpoint's files, computed by the writer threads as the bytes go out.

`store.publish` needs every file's size and digest (`store.DIGEST`) for the manifest. Reading
each file back to checksum it costs a second pass over the whole state (at
100M parameters, 600 MB a rank). `ChecksummingWriter` is DCP's
`FileSystemWriter` whose streams update a running digest on every write, so the
digests are ready when the files are closed. A file written out of order (a
seek back) is not trusted: it is checksummed again from disk, as is any file
the writer did not write itself.

Example::

    writer = ChecksummingWriter(tmp, thread_count=2)
    dcp.save(state, storage_writer=writer)
    writer.checksums      # {"__0_0.distcp": {"bytes": ..., "xxh3_64": ...}, ".metadata": {...}}
"""

from __future__ import annotations

import contextlib
import io
import threading
from pathlib import Path

import xxhash
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from .store import DIGEST


class _ChecksummedStream(io.RawIOBase):
    """A write stream that passes every write through and folds it into the digest."""

    def __init__(self, raw):
        super().__init__()
        self.raw = raw
        self.digest = xxhash.xxh3_64()
        self.size = 0
        self.in_order = True  # every write appended at the end so far

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        if self.raw.tell() != self.size:
            self.in_order = False
        view = memoryview(data).cast("B")
        written = self.raw.write(view)
        self.digest.update(view[:written])
        self.size += written
        return written

    def tell(self) -> int:
        return self.raw.tell()

    def seek(self, offset, whence=io.SEEK_SET) -> int:
        return self.raw.seek(offset, whence)

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
        with self._lock:
            if stream.in_order:
                self.checksums[Path(path).name] = {"bytes": stream.size, DIGEST: stream.digest.intdigest()}
            else:
                self.checksums.pop(Path(path).name, None)

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        with self._lock:
            record = self.checksums.pop(Path(path).name, None)
            if record is not None:
                self.checksums[Path(new_path).name] = record


class ChecksummingWriter(FileSystemWriter):
    """`FileSystemWriter` that knows each file's size and digest once written (`checksums`)."""

    def __init__(self, path, **kwargs):
        super().__init__(path, **kwargs)
        self.fs = _ChecksummingFileSystem()

    @property
    def checksums(self) -> dict[str, dict[str, int]]:
        return dict(self.fs.checksums)
