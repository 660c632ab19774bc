"""What every pass may read besides the graph: the plain-data facts of one compilation."""

from __future__ import annotations

import attrs

from .flat import FlatParam
from .placement import MeshShape
from .trace import GraphInput
from .training import Training


@attrs.frozen
class CompileContext:
    """The flat parameters, the abstract mesh, the graph's input signature and the options.

    ``training`` holds the training features (clipping, parameter groups,
    accumulation, random numbers; `compiler.training`).

    Example: ``CompileContext(flats, MeshShape((("fsdp", 4),)), traced.inputs)``.
    """

    flats: tuple[FlatParam, ...]
    mesh: MeshShape
    inputs: tuple[GraphInput, ...]
    reshard_after_forward: bool = True
    prefetch: int = 1
    training: Training = Training()

    def flat(self, name: str) -> FlatParam:
        for f in self.flats:
            if f.name == name:
                return f
        raise KeyError(name)
