"""Compiling with Python's cyclic garbage collector paused: `collection_paused`."""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable


def collection_paused(fn: Callable) -> Callable:
    """``fn`` run with Python's cyclic garbage collector off (Note [no collection while compiling]).

    Note [no collection while compiling]: a compile makes, and keeps, hundreds
    of thousands of objects (fx nodes, their meta, fake tensors). The cyclic
    collector's full collection walks every one of them, and a heap that grows
    by a quarter starts another, so on the 80-layer 70B plan the collector took
    12 of the memory budget search's 64 s. While a step compiles the collector
    is off; what the compile dropped (the budget's discarded configurations) is
    collected once it is back on. Nested calls leave it to the outermost.
    """

    @functools.wraps(fn)
    def paused(*args, **kwargs):
        with _collector_off():
            return fn(*args, **kwargs)

    return paused


@contextlib.contextmanager
def _collector_off():
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
