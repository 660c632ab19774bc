"""What one compilation is asked to make, as one frozen value: `StepConfig`.

The front end's `ResolvedSpec.config` gives it (`shardlang.spec.spec`); the
compiler's entry, `compile_step(model, loss_fn, config, optimizer, batch)`,
takes it whole, and every pass reads it through `CompileContext.config`. Its
parts are records by concern:

- ``params`` and ``mesh``: where each parameter lives (`ParamInfo`, `MeshShape`);
- `Precision`: the dtypes gathers and reductions run in;
- `Scheduling`: how the step trades memory for overlap (resharding,
  prefetch depth, bucketing, recompute per unit, kept reduction buffers);
- `Training` (`compiler.ir.training`): clipping, parameter groups,
  micro-batches, random numbers, skipping non-finite steps;
- ``backend``: what runs the bound graph.

Its flat parameters (`StepConfig.flats`) follow from it alone, so the
evaluation graph and a budget search over `Scheduling` reuse them.

Example::

    config = StepConfig(params, MeshShape((("fsdp", 4),)), scheduling=Scheduling(prefetch=2))
    compiled = compile_step(model, loss_fn, config, AdamW(lr=1e-3), batch)
    compile_step(model, loss_fn, config.scheduled(prefetch=0), AdamW(lr=1e-3), batch, traced=compiled.traced)
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch

from shardlang.spec.vocabulary import Recompute, Strategy

from .ir.training import Training, split_by_group
from .layout.bucket import bucket_flat_params
from .layout.flat import FlatParam, build_flat_params
from .layout.placement import MeshShape, ParamInfo
from shardlang.spec.vocabulary import StepBackend


@attrs.frozen
class Precision:
    """Mixed precision: ``param_dtype`` for gathered parameters and compute, ``reduce_dtype`` for reductions.

    None keeps each parameter's own dtype (`FlatParam`).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


@attrs.frozen
class Scheduling:
    """How the step is scheduled: what it frees, how early it gathers, what it merges and recomputes.

    - ``reshard_after_forward``: the default strategy of a unit no strategy rule
      names (ZeRO-3 when True, ZeRO-2 when False);
    - ``prefetch``: how many units ahead a gather is issued (`passes.prefetch_gathers`);
    - ``bucket_bytes``: small flat parameters merged into collectives of about
      this size (`compiler.layout.bucket`; 0: one per flat parameter);
    - ``recompute``: unit name -> `Recompute` policy (units left out keep
      everything; `passes.recompute_activations`);
    - ``keep_reduction_buffers``: replicated gradients' all-reduce buffers kept
      between steps (`passes.keep_reduction_buffers`);
    - ``buffer_pool``: gathers and reduction packs write into slots held between
      steps, where that does not raise the planned peak (`passes.assign_buffers`).
    """

    reshard_after_forward: bool = True
    prefetch: int = 1
    bucket_bytes: int = 0
    recompute: Mapping[str, Recompute] = attrs.field(factory=dict, converter=lambda r: dict(r or {}))
    keep_reduction_buffers: bool = True
    buffer_pool: bool = True


@attrs.frozen
class StepConfig:
    """One compilation's configuration: the placements and every option, by concern (see the module)."""

    params: tuple[ParamInfo, ...] = attrs.field(converter=tuple)
    mesh: MeshShape
    precision: Precision = Precision()
    scheduling: Scheduling = Scheduling()
    training: Training = Training()
    backend: StepBackend = StepBackend.EAGER

    def scheduled(self, **changes) -> StepConfig:
        """The same configuration with some `Scheduling` fields changed (what a budget search varies)."""
        return attrs.evolve(self, scheduling=attrs.evolve(self.scheduling, **changes))

    def flats(self) -> tuple[FlatParam, ...]:
        """The flat parameters this configuration compiles: annotate, split by parameter group, bucket.

        Every parameter without a strategy gets ZeRO-3, or ZeRO-2 without ``reshard_after_forward``.
        """
        default = Strategy.ZERO3 if self.scheduling.reshard_after_forward else Strategy.ZERO2
        flats = build_flat_params(self.params, self.mesh, param_dtype=self.precision.param_dtype,
                                  reduce_dtype=self.precision.reduce_dtype, default_strategy=default)
        return bucket_flat_params(split_by_group(flats, self.training), self.scheduling.bucket_bytes)
