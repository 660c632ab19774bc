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

from ..compiler import MeshShape, ParamInfo, Placement, Precision, Scheduling, StepConfig, TensorAxis

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
    tensor: TensorAxis | None = None  # the tensor axis, when the mesh has one of more than one rank

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
            training=training.training_of(self), backend=o.backend,
            tensor=attrs.evolve(self.tensor, sequence_parallel=o.sequence_parallel, loss_parallel=o.loss_parallel)
            if self.tensor else None)

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
        """A table of every parameter: name, shape, dtype, trainable, unit, layout. Example: ``print(r.describe())``.

        With a tensor axis, the layout gives the placement on each axis and a column the
        shape each tensor rank holds (which the data axes then shard).
        """
        head = ("parameter", "shape", "dtype", "trainable", "unit", "layout", "strategy")
        rows = [head + (("tp-local shape",) if self.tensor is not None else ())]
        for p in self.params:
            dtype = str(p.dtype).removeprefix("torch.")
            layout = _layout_text(p, self.tensor)
            strategy = strategy_repr(p.strategy) if p.strategy is not None else ""
            row = (p.name, str(list(p.shape)), dtype, str(p.trainable), unit_label(p.unit), layout, strategy)
            if self.tensor is not None:
                row += (str(list(self.tensor.local_param(p).shape)),)
            rows.append(row)
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)


def _layout_text(p: ParamInfo, tensor: TensorAxis | None) -> str:
    """The layout of ``p`` on every axis: ``shard('fsdp')``, or ``tp: shard(dim=0), fsdp: shard()``."""
    data = _layout_of(p.placement)
    if tensor is None:
        return repr(data)
    on_tensor = tensor.placement_of(p.name)
    tp = f"shard(dim={on_tensor.dim})" if hasattr(on_tensor, "dim") else "replicate()"
    data_text = f"{data.axis}: shard(" + ("" if data.dim is None else f"dim={data.dim}") + ")" \
        if isinstance(data, Shard) else "data: replicate()"
    return f"{tensor.name}: {tp}, {data_text}"


def _layout_of(placement: Placement) -> Layout:
    """The layout that gives ``placement`` (a dim already made non-negative)."""
    if not placement.is_sharded:
        return Replicate()
    return Shard(placement.axis, placement.dim)  # type: ignore[arg-type]

