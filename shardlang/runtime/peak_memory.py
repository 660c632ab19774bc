"""A rank's resident memory and its peak, as Linux reports them, for ``shardlang run``'s last line.

``run`` prints ``peak memory per rank: init <A> MiB, training <B> MiB``: A is
the peak resident set (VmHWM) at the end of initialisation (model built,
materialised, compiled; before the first step), B the peak at the end of the
run, each minus the resident set just before ``build_model`` and the maximum
over ranks. `PeakMemory.start` resets the kernel's peak to the current
resident set first (``/proc/self/clear_refs``), so what the process did before
(importing torch, spawning) does not count.

RSS counts pages glibc keeps after ``free``: it overstates the live bytes by up
to a few hundred MiB (docs/large_models.md, "Memory"); `malloc_in_use`
(``mallinfo2``) counts only what malloc has handed out.

Example::

    peak = PeakMemory.start()
    model = build_model()
    ...
    peak.mark_init()
    ...
    init_bytes, training_bytes = peak.values()
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

MIB = 1 << 20
_STATUS = Path("/proc/self/status")


def _status_kib(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int:
    """The resident set now (VmRSS), 0 where /proc is unavailable."""
    return (_status_kib("VmRSS") or 0) * 1024


def peak_rss_bytes() -> int:
    """The peak resident set so far (VmHWM), 0 where /proc is unavailable."""
    return (_status_kib("VmHWM") or 0) * 1024


def reset_peak() -> bool:
    """Reset VmHWM to the current resident set (Linux ``clear_refs`` 5); False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def malloc_in_use() -> int | None:
    """Bytes malloc has handed out and not taken back, over every arena (glibc >= 2.33), or None."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    fn.restype = Mallinfo2
    info = fn()
    return info.uordblks + info.hblkhd


class PeakMemory:
    """The peaks of one rank's run, relative to its resident set at the start."""

    def __init__(self, base: int):
        self.base = base
        self.init_peak: int | None = None

    @classmethod
    def start(cls) -> PeakMemory:
        """Reset the peak and remember the resident set: call just before ``build_model``."""
        reset_peak()
        return cls(rss_bytes())

    def mark_init(self) -> None:
        """The end of initialisation: the model built, materialised and compiled."""
        self.init_peak = peak_rss_bytes()

    def values(self) -> tuple[int, int]:
        """(init peak, peak so far) in bytes above the start."""
        end = peak_rss_bytes()
        init = self.init_peak if self.init_peak is not None else end
        return max(0, init - self.base), max(0, end - self.base)


class MallocPeak:
    """The most bytes malloc had in use while it ran, sampled by a thread (``with MallocPeak() as peak``).

    Note [sampled malloc peak]: glibc keeps no peak of bytes in use, so a
    thread reads `malloc_in_use` every ``interval_s`` and keeps the largest. A
    peak shorter than the interval can fall between two samples; a step's
    peak (the start of backward, every kept activation live) lasts many ops.
    The thread takes the GIL to sample, so a step measured this way is not
    also timed. ``peak`` is None where ``mallinfo2`` is unavailable.

    Example::

        with MallocPeak() as sampled:
            step(batch)
        sampled.peak - base   # bytes above a baseline read before building the model
    """

    def __init__(self, interval_s: float = 0.0005):
        self.interval_s = interval_s
        self.peak: int | None = malloc_in_use()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="shardlang-malloc-peak", daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, malloc_in_use())

    def __enter__(self) -> MallocPeak:
        if self.peak is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.peak is not None:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, malloc_in_use())
