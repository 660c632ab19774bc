"""What every pass, the schedule and the analyses read besides the graph: one compilation's plain-data facts."""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from shardlang.spec.vocabulary import Recompute, StepBackend

from .config import StepConfig
from .ir.trace import GraphInput
from .ir.training import Training
from .layout.flat import FlatParam
from .layout.placement import MeshShape


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

    @property
    def mesh(self) -> MeshShape:
        return self.config.mesh

    @property
    def training(self) -> Training:
        return self.config.training

    @property
    def backend(self) -> StepBackend:
        """What runs the bound graph; the cost model reads it (fusion)."""
        return self.config.backend

    @property
    def reshard_after_forward(self) -> bool:
        return self.config.scheduling.reshard_after_forward

    @property
    def prefetch(self) -> int:
        return self.config.scheduling.prefetch

    @property
    def recompute(self) -> Mapping[str, Recompute]:
        """Unit name -> its `Recompute` policy (units left out keep everything)."""
        return self.config.scheduling.recompute

    @property
    def keep_reduction_buffers(self) -> bool:
        """Note [kept reduction buffers] (`passes.keep_reduction_buffers`)."""
        return self.config.scheduling.keep_reduction_buffers

    def flat(self, name: str) -> FlatParam:
        for f in self.flats:
            if f.name == name:
                return f
        raise KeyError(name)
