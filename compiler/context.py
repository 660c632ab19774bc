"""What every pass, the schedule and the analyses read besides the graph: one compilation's plain-data facts."""

from __future__ import annotations

import operator

import attrs

from .config import StepConfig
from .ir.trace import GraphInput
from .layout.flat import FlatParam


def _of_config(path: str, doc: str = "") -> property:
    """A read-only property of `CompileContext` that reads ``config.<path>``."""
    read = operator.attrgetter(path)
    return property(lambda self: read(self.config), doc=f"``config.{path}``" + (f": {doc}" if doc else ""))


@attrs.frozen
class CompileContext:
    """One compilation's `StepConfig`, its flat parameters and the traced graph's input signature.

    ``evaluate`` marks a forward-only evaluation graph (`compiler.evaluate`).
    The properties read the configuration's records, so a pass writes
    ``ctx.mesh``, ``ctx.prefetch`` or ``ctx.training``.

    Example: ``CompileContext(config, config.flats(), traced.inputs)``.
    """

    config: StepConfig
    flats: tuple[FlatParam, ...]
    inputs: tuple[GraphInput, ...]
    evaluate: bool = False

    mesh = _of_config("mesh", "the data axes: what the passes shard and reduce over")
    world_mesh = _of_config("world_mesh", "every axis, the tensor axis too: what the runtime binds")
    training = _of_config("training")
    backend = _of_config("backend", "what runs the bound graph; the cost model reads it (fusion)")
    reshard_after_forward = _of_config("scheduling.reshard_after_forward")
    prefetch = _of_config("scheduling.prefetch")
    recompute = _of_config("scheduling.recompute", "unit name -> its `Recompute` policy (units left out keep all)")
    keep_reduction_buffers = _of_config("scheduling.keep_reduction_buffers",
                                        "Note [kept reduction buffers] (`passes.keep_reduction_buffers`)")
    buffer_pool = _of_config("scheduling.buffer_pool", "Note [buffer assignment] (`passes.assign_buffers`)")

    def flat(self, name: str) -> FlatParam:
        for f in self.flats:
            if f.name == name:
                return f
        raise KeyError(name)
