"""What every pass may read besides the graph: the plain-data facts of one compilation."""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from ..lower.backend import StepBackend
from ..layout.flat import FlatParam
from ..layout.placement import MeshShape
from shardlang.spec.vocabulary import Recompute
from ..ir.trace import GraphInput
from ..ir.training import Training


@attrs.frozen
class CompileContext:
    """The flat parameters, the abstract mesh, the graph's input signature and the options.

    ``training`` holds the training features (clipping, parameter groups,
    accumulation, random numbers; `compiler.ir.training`). ``recompute`` maps a
    unit's name to its `Recompute` policy (units left out keep everything).

    Example: ``CompileContext(flats, MeshShape((("fsdp", 4),)), traced.inputs)``.
    """

    flats: tuple[FlatParam, ...]
    mesh: MeshShape
    inputs: tuple[GraphInput, ...]
    reshard_after_forward: bool = True
    prefetch: int = 1
    training: Training = Training()
    recompute: Mapping[str, Recompute] = attrs.field(factory=dict)
    backend: StepBackend = StepBackend.EAGER  # what runs the bound graph; the cost model reads it (fusion)
    evaluate: bool = False  # a forward-only evaluation graph (`compiler.evaluate`)
    keep_reduction_buffers: bool = True  # Note [kept reduction buffers] (`passes.keep_reduction_buffers`)

    def flat(self, name: str) -> FlatParam:
        for f in self.flats:
            if f.name == name:
                return f
        raise KeyError(name)
