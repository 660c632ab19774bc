"""The errors shardlang raises on purpose, for users: ``except shardlang.errors.SpecError``.

The hierarchy, shared by the spec language, the compiler and the runtime (this
module imports nothing of shardlang, so every layer can raise them)::

    ShardlangError
    ├── SpecError              a spec is malformed or does not fit the model / world (also a ValueError)
    ├── DataError              prepared data or its inputs are missing, damaged or do not fit (.path)
    ├── TraceError             the training step could not be traced into one graph
    ├── CompileError           a compiler pass failed (.pass_name, .passes_before)
    │   └── ScheduleError      the schedule verifier found a broken invariant
    └── ShardlangRuntimeError  running a compiled step failed (also a RuntimeError)
        ├── CheckpointError    a checkpoint could not be written or read (.path, .key)
        └── NonFiniteError     training stopped on an inf or nan loss or gradient (.step, .count)

Every error carries the offending objects as attributes, so a caller can act
on them without parsing the message, and each message says three things: the
value, where it came from, and what would have been valid.

Example::

    try:
        spec.resolve(model, world_size=3)
    except SpecError as e:
        print(e)   # the value, where it came from, and what would be valid
"""

from __future__ import annotations

__all__ = [
    "CheckpointError", "CompileError", "DataError", "NonFiniteError", "ScheduleError", "ShardlangError",
    "ShardlangRuntimeError", "SpecError", "TraceError", "member_of",
]


class ShardlangError(Exception):
    """Base class of every error that shardlang raises on purpose."""


class SpecError(ShardlangError, ValueError):
    """A spec is malformed, or does not fit the model or the world it meets.

    Example: ``SpecError("parameter 'head.bias' matches no rule; rules are ['blocks.*']")``.
    """


class DataError(ShardlangError, ValueError):
    """Training data could not be prepared or read: a missing index, a damaged shard, an unreadable input.

    ``path`` is the file or directory concerned.

    Example: ``DataError("data/train-00003.npy: checksum ... differs from the index's", path=...)``.
    """

    def __init__(self, message: str, *, path=None):
        super().__init__(message)
        self.path = path


class TraceError(ShardlangError):
    """The training step could not be traced into one graph.

    ``site`` is the user's line and module where it failed (a
    `compiler.ir.provenance.UserSite`), when known. Example:
    ``TraceError("tracing the training step failed at model.py:42 in forward, module 'blocks.0' ...")``.
    """

    def __init__(self, message: str, *, site=None):
        super().__init__(message)
        self.site = site


class CompileError(ShardlangError):
    """A compiler pass failed or produced a graph that breaks an invariant.

    ``pass_name`` names the failing pass and ``passes_before`` the ones that ran;
    ``site`` the user's line and module behind the node it failed on, when known.
    """

    def __init__(self, message: str, *, pass_name: str | None = None, passes_before: tuple[str, ...] = (),
                 site=None):
        super().__init__(message)
        self.pass_name = pass_name
        self.passes_before = passes_before
        self.site = site


class ScheduleError(CompileError):
    """The schedule verifier found a broken invariant (see `compiler.schedule.verify`)."""


class ShardlangRuntimeError(ShardlangError, RuntimeError):
    """Running a compiled step failed: bad batch, mismatched ranks, bad process group."""


class CheckpointError(ShardlangRuntimeError):
    """A checkpoint could not be written or read: another model, a wrong shape, a missing or corrupt file.

    ``path`` is the checkpoint directory (or file) concerned; ``key`` the tensor, when one is to blame.
    """

    def __init__(self, message: str, *, path=None, key: str | None = None):
        super().__init__(message)
        self.path = path
        self.key = key


class NonFiniteError(ShardlangRuntimeError):
    """Training stopped: the loss or gradient norm was inf or nan on more steps than allowed (``--max-nonfinite``).

    ``step`` is the 1-based step at which the run stopped; ``count`` the non-finite steps so far.
    """

    def __init__(self, message: str, *, step: int, count: int):
        super().__init__(message)
        self.step = step
        self.count = count


def member_of(cls, value, where: str, *, error: type[ShardlangError] = SpecError, hint: str = ""):
    """``value`` as a member of the enum ``cls`` (a member, or its value); else ``error`` naming ``where``, the
    value and the valid values. Example: ``member_of(Strategy, "zero2", "Options.strategy")``."""
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        raise error(f"{where} is {value!r}; valid values are {[m.value for m in cls]}{hint}") from None
