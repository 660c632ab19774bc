"""Processes a rank starts write their standard error through the rank's own ``sys.stderr``, a line at a time.

Note [children's output]: a process started by a rank (DCP's checkpointer
process, which logs INFO lines from its first save to its last) inherits the
rank's file descriptor 2, so it writes straight onto the terminal: past the
``[rank r]`` prefix of ranks other than 0, and into rank 0's progress bar,
glued to its end. `stderr_through_sys_stderr` gives the processes started
inside it a pipe as their descriptor 2; a thread of the rank reads it and
writes each line to ``sys.stderr`` as it is at that moment: the prefixing
stream on other ranks, and on rank 0, while a bar is drawn, the stream that
prints above the bar (`shardlang.cli.progress`). The rank's own descriptor 2
is the pipe only inside the block; what the rank itself writes there
meanwhile is held back until the block ends, so that no line goes round to
the pipe again. The thread ends when the last process holding the pipe does.

Example::

    with stderr_through_sys_stderr():
        dcp.async_save(sd, async_checkpointer_type=AsyncCheckpointerType.PROCESS)   # starts the process
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def stderr_through_sys_stderr() -> Iterator[None]:
    """Processes started inside write their standard error through ``sys.stderr`` (Note [children's output])."""
    with contextlib.suppress(AttributeError, ValueError, OSError):
        sys.stderr.flush()  # what the rank buffered goes out to its own descriptor first
    read_end, write_end = os.pipe()
    saved = os.dup(2)
    os.dup2(write_end, 2)
    os.close(write_end)
    forwarder = _Forwarder(read_end)
    forwarder.start()
    try:
        yield
    finally:
        os.dup2(saved, 2)  # the rank writes to its own descriptor again; its children keep the pipe
        os.close(saved)
        forwarder.release()


class _Forwarder(threading.Thread):
    """Reads the pipe to its end and writes each line to ``sys.stderr``; lines read before `release` wait for it."""

    def __init__(self, read_end: int):
        super().__init__(name="shardlang-child-stderr", daemon=True)
        self._read_end = read_end
        self._lock = threading.Lock()
        self._released = False
        self._held: list[str] = []

    def release(self) -> None:
        with self._lock:
            self._released = True
            self._write_held()

    def run(self) -> None:
        pending = ""
        try:
            while chunk := os.read(self._read_end, 65536):
                *lines, pending = (pending + chunk.decode(errors="replace")).split("\n")
                self._take(lines)
            self._take([pending] if pending else [])
        finally:
            os.close(self._read_end)

    def _take(self, lines: list[str]) -> None:
        with self._lock:
            self._held += lines
            if self._released:
                self._write_held()

    def _write_held(self) -> None:
        lines, self._held = self._held, []
        if lines:
            with contextlib.suppress(AttributeError, ValueError, OSError):
                sys.stderr.write("".join(f"{line}\n" for line in lines))
                sys.stderr.flush()
