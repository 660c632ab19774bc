"""What a benchmark rank measures about itself: memory in use, collectives, bytes sent.

Note [memory in use]: peak memory is the bytes glibc's allocator has handed out and
not taken back, read with ``mallinfo2()`` (``uordblks``, the arenas' chunks in use,
plus ``hblkhd``, the chunks served by ``mmap``). PyTorch's CPU allocator takes every
tensor from ``malloc``, and ``mallinfo2`` sums every arena, so tensors and the C++
temporaries of any thread (gloo's included) are counted; Python objects are too.
It is sampled after every aten and c10d op of the instrumented step (by a
``TorchDispatchMode`` on the rank's main thread) and, to catch temporaries that live
and die inside one op or on another thread, every ``SAMPLE_INTERVAL_S`` by a
background thread. The report is the peak above the rank's baseline, the bytes in
use before the model was built: everything the mode keeps (parameters, gradients,
optimizer state, buckets) and everything the step allocates.

Note [collectives at the dispatcher]: `StepProbe` sees every op that reaches
PyTorch's dispatcher on the main thread: the ``_c10d_functional`` ops in
shardlang's compiled graph, and the ``c10d`` ops that ``torch.distributed`` calls
issue for FSDP2 and DDP (DDP's C++ reducer reaches the dispatcher on the thread
that runs backward, which on the CPU is the main thread). Each collective is
counted once, with its *payload*: the full buffer it produces or consumes on this
rank (an all-gather's output, a reduce-scatter's input, an all-reduce's or
broadcast's buffer). `probe_sees_collectives` in the smoke test checks that a
shardlang, an FSDP2 and a DDP step each show their collectives.

Note [bytes on the wire]: gloo sends with ``writev`` on TCP sockets, which the
kernel counts in ``wchar`` of ``/proc/self/io``: the bytes this rank's process
wrote, from any thread. Between two reads around a step, nothing else writes, so
the difference is what the rank put on the wire, as gloo implements the
collectives (its reduce-scatter is an all-reduce plus a copy in torch 2.13).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SAMPLE_INTERVAL_S = 0.0005


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc():
    lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not hasattr(lib, "mallinfo2"):
        return None
    lib.mallinfo2.restype = _MallInfo2
    lib.malloc_trim.argtypes = [ctypes.c_size_t]
    return lib


_LIBC = _libc()


def memory_in_use() -> int:
    """Bytes glibc malloc has handed out and not taken back, every thread and arena (Note [memory in use]).

    Returns 0 where ``mallinfo2`` does not exist (not glibc, or glibc before 2.33).

    Example::

        before = memory_in_use(); x = torch.empty(2**20); memory_in_use() - before   # about 4 MiB
    """
    if _LIBC is None:
        return 0
    info = _LIBC.mallinfo2()
    return info.uordblks + info.hblkhd


def give_memory_back() -> None:
    """Return free heap pages to the OS (``malloc_trim``), so idle workers do not hold a past job's peak."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def bytes_written() -> int:
    """This process's ``wchar`` from ``/proc/self/io``: bytes it wrote, sockets included (Note [bytes on the wire])."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


# op name -> (kind, payload): the payload is the full buffer of Note [collectives at the dispatcher].
_FUNCTIONAL = {
    "all_gather_into_tensor": ("all_gather", lambda a: _nbytes(a[0]) * a[1]),
    "all_gather_into_tensor_coalesced": ("all_gather", lambda a: _nbytes(a[0]) * a[1]),
    "all_gather_into_tensor_out": ("all_gather", lambda a: _nbytes(a[0]) * a[1]),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a: _nbytes(a[0])),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", lambda a: _nbytes(a[0])),
    "reduce_scatter_tensor_out": ("reduce_scatter", lambda a: _nbytes(a[0])),
    "all_reduce": ("all_reduce", lambda a: _nbytes(a[0])),
    "all_reduce_coalesced": ("all_reduce", lambda a: _nbytes(a[0])),
    "all_reduce_": ("all_reduce", lambda a: _nbytes(a[0])),
    "broadcast": ("broadcast", lambda a: _nbytes(a[0])),
    "all_to_all_single": ("all_to_all", lambda a: _nbytes(a[0])),
}
_C10D = {
    "_allgather_base_": ("all_gather", lambda a: _nbytes(a[0])),
    "allgather_": ("all_gather", lambda a: _nbytes(a[0])),
    "allgather_into_tensor_coalesced_": ("all_gather", lambda a: _nbytes(a[0])),
    "allgather_coalesced_": ("all_gather", lambda a: _nbytes(a[0])),
    "_reduce_scatter_base_": ("reduce_scatter", lambda a: _nbytes(a[1])),
    "reduce_scatter_": ("reduce_scatter", lambda a: _nbytes(a[1])),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", lambda a: _nbytes(a[1])),
    "allreduce_": ("all_reduce", lambda a: _nbytes(a[0])),
    "allreduce_coalesced_": ("all_reduce", lambda a: _nbytes(a[0])),
    "broadcast_": ("broadcast", lambda a: _nbytes(a[0])),
    "barrier": ("barrier", lambda a: 0),
}
_NOT_COLLECTIVES = {"wait_tensor", "wait"}


def classify(func) -> tuple[str, int] | None:
    """``(kind, payload function)`` for a c10d or functional collective op, None for anything else."""
    namespace = getattr(func, "namespace", "")
    if namespace not in ("c10d", "_c10d_functional"):
        return None
    name = func._schema.name.split("::")[-1]
    if name in _NOT_COLLECTIVES:
        return None
    table = _FUNCTIONAL if namespace == "_c10d_functional" else _C10D
    return table.get(name, (f"other:{name}", lambda a: _nbytes(list(a))))


class StepProbe(TorchDispatchMode):
    """Count collectives and sample memory in use after every op, while active (one step).

    ``counts`` and ``payload`` are per collective kind; ``peak`` is the highest
    `memory_in_use` seen, by the dispatch hook or by the background sampler
    (Note [memory in use]).

    Example::

        with StepProbe() as probe:
            step(batch)
        probe.counts["all_gather"], probe.payload["all_gather"], probe.peak
    """

    def __init__(self, interval_s: float = SAMPLE_INTERVAL_S):
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.payload: Counter[str] = Counter()
        self.peak = memory_in_use()
        self._sampled_peak = self.peak  # the background thread's own maximum: no shared read-modify-write
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="bench-memory-sampler", daemon=True)

    def __enter__(self):
        self._thread.start()
        return super().__enter__()

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._sampled_peak, memory_in_use())
        return result

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._sampled_peak = max(self._sampled_peak, memory_in_use())
            time.sleep(self._interval)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = classify(func)
        if kind is not None:
            self.counts[kind[0]] += 1
            self.payload[kind[0]] += kind[1](args)
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, memory_in_use())
        return out
