"""The errors shardlang raises on purpose, for users: ``except shardlang.errors.SpecError``.

Re-exported from `shardlang.compiler.errors`, where the hierarchy lives (the
compiler is the lowest layer)::

    ShardlangError
    ├── SpecError              a spec is malformed or does not fit the model / world (also a ValueError)
    ├── TraceError             the training step could not be traced into one graph
    ├── CompileError           a compiler pass failed (.pass_name, .passes_before)
    │   └── ScheduleError      the schedule verifier found a broken invariant
    └── ShardlangRuntimeError  running a compiled step failed (also a RuntimeError)
        ├── CheckpointError    a checkpoint could not be written or read (.path, .key)
        └── NonFiniteError     training stopped on an inf or nan loss or gradient (.step, .count)

Example::

    try:
        spec.resolve(model, world_size=3)
    except SpecError as e:
        print(e)   # the value, where it came from, and what would be valid
"""

from __future__ import annotations

from shardlang.compiler.errors import (
    CheckpointError,
    CompileError,
    NonFiniteError,
    ScheduleError,
    ShardlangError,
    ShardlangRuntimeError,
    SpecError,
    TraceError,
)

__all__ = [
    "CheckpointError",
    "CompileError",
    "NonFiniteError",
    "ScheduleError",
    "ShardlangError",
    "ShardlangRuntimeError",
    "SpecError",
    "TraceError",
]
