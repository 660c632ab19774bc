"""The traced logical step made tp-local: what compile_step hands FSDP's passes on a mesh with a tensor axis.

`tensor_parallel_step` places the traced step on the tensor axis
(`propagate`), writes the graph each rank of that axis runs (`localize`), and
returns it as a `TracedStep` with the same inputs: its flats are the tp-local
flats, so every pass after it works as on a mesh of data axes alone, on smaller
parameters, with the tensor axis's collectives already in the graph
(Note [tp-local flats] in `compiler.config`).
"""

from __future__ import annotations

import attrs

from ..ir.trace import TracedStep
from .localize import localize
from .propagate import propagate

__all__ = ["tensor_parallel_step"]


def tensor_parallel_step(traced: TracedStep, axis) -> TracedStep:
    """``traced`` as each rank of ``axis`` (a `compiler.config.TensorAxis`) runs it, with its placement plan.

    Example: ``local = tensor_parallel_step(traced, TensorAxis("tp", 2, 1, {"fc1.weight": Shard(0)}))``.
    """
    plan = propagate(traced, axis.placements, axis.name, axis.size)
    return attrs.evolve(traced, graph_module=localize(traced.graph_module, plan), placements=plan)
