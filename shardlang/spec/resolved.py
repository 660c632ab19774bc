"""`ResolvedSpec`: a spec met with a model and a world size, the plain data the compiler consumes."""

from __future__ import annotations

import attrs

from shardlang.errors import SpecError
from shardlang.spec import training
from shardlang.spec.layout import Layout, Replicate, Shard
from shardlang.spec.options import Options
from shardlang.spec.strategy import strategy_repr
from shardlang.spec.units import some_names, unit_label
from shardlang.spec.vocabulary import Recompute

from ..compiler import MeshShape, ParamInfo, Placement, Precision, Scheduling, StepConfig

__all__ = ["ResolvedSpec"]



@attrs.frozen
class ResolvedSpec:
    """A spec met with a model and a world size: the plain data the compiler consumes.

    ``params`` follows ``model.named_parameters()`` order. Example::

        resolved = Spec(Mesh(fsdp=-1)).resolve(model, world_size=2)
        resolved.mesh == MeshShape((("fsdp", 2),))
        print(resolved.describe())
    """

    mesh: MeshShape
    params: tuple[ParamInfo, ...] = attrs.field(converter=tuple)
    options: Options
    param_groups: tuple[training.ParamGroup, ...] = ()
    group_of: dict[str, int] = attrs.field(factory=dict)  # trainable parameter -> its group (1-based), if any
    recompute: dict[str, Recompute] = attrs.field(factory=dict)  # unit -> its recompute policy

    @property
    def config(self) -> StepConfig:
        """What the compiler is asked to make (`compiler.config.StepConfig`): placements, mesh, options by concern.

        Example: ``compile_step(model, loss_fn, resolved.config, sl.AdamW(lr=1e-3), batch)``.
        """
        o = self.options
        mp = o.mixed_precision
        return StepConfig(
            self.params, self.mesh,
            precision=Precision(mp.param_dtype, mp.reduce_dtype) if mp is not None else Precision(),
            scheduling=Scheduling(reshard_after_forward=o.reshard_after_forward, prefetch=o.prefetch,
                                  bucket_bytes=o.bucket_bytes, recompute=self.recompute,
                                  keep_reduction_buffers=o.keep_reduction_buffers, buffer_pool=o.buffer_pool),
            training=training.training_of(self), backend=o.backend)

    @property
    def units(self) -> tuple[str, ...]:
        """The units that hold parameters, in order of their first parameter; ``""`` is the root."""
        return tuple(dict.fromkeys(p.unit for p in self.params))

    def param(self, name: str) -> ParamInfo:
        """The `ParamInfo` named ``name``. Example: ``resolved.param("head.weight").unit``."""
        for p in self.params:
            if p.name == name:
                return p
        raise SpecError(f"no parameter named {name!r}; the parameters are {some_names([p.name for p in self.params])}")

    def describe(self) -> str:
        """A table of every parameter: name, shape, dtype, trainable, unit, layout. Example: ``print(r.describe())``."""
        rows = [("parameter", "shape", "dtype", "trainable", "unit", "layout", "strategy")]
        for p in self.params:
            dtype = str(p.dtype).removeprefix("torch.")
            layout = repr(_layout_of(p.placement))
            strategy = strategy_repr(p.strategy) if p.strategy is not None else ""
            rows.append((p.name, str(list(p.shape)), dtype, str(p.trainable), unit_label(p.unit), layout, strategy))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)


def _layout_of(placement: Placement) -> Layout:
    """The layout that gives ``placement`` (a dim already made non-negative)."""
    if not placement.is_sharded:
        return Replicate()
    return Shard(placement.axis, placement.dim)  # type: ignore[arg-type]

