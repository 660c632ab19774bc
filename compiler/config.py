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
from .layout.placement import WORLD, MeshShape, ParamInfo
from .placement.placements import REPLICATE, Shard, local_shape
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


SEQUENCE_DIM = 1  # of a (batch, sequence, features) activation, as torchtitan's Shard(1)


@attrs.frozen
class TensorAxis:
    """A tensor axis of the mesh: its name, size, place among the axes, and each parameter's placement on it.

    ``placements`` maps parameter names to `compiler.placement.Shard` or
    `Replicate` (left out: replicated). ``index`` is the axis's position in
    the whole mesh, whose other axes are `StepConfig.mesh` (the data axes).
    ``sequence_parallel``: activations between tp regions are split on the
    sequence, dim `SEQUENCE_DIM` of a ``(batch, sequence, ...)`` activation
    (Note [sequence shards] in `compiler.placement.strategy`). ``loss_parallel``:
    the loss runs on logits split by vocabulary (Note [loss parallelism] in
    `compiler.placement.rules.loss`).
    Example: ``TensorAxis("tp", 2, 1, {"layers.0.attention.wq.weight": Shard(0)})``.
    """

    name: str
    size: int
    index: int
    placements: Mapping[str, object] = attrs.field(converter=lambda p: dict(p or {}))
    sequence_parallel: bool = False
    loss_parallel: bool = False

    @property
    def sequence_dim(self) -> int | None:
        """The dim activations are split on between tp regions; None without sequence parallelism."""
        return SEQUENCE_DIM if self.sequence_parallel else None

    def placement_of(self, param: str):
        return self.placements.get(param, REPLICATE)

    def local_block(self, name: str, value, coordinate: int):
        """The block of parameter ``name``'s logical ``value`` that the rank at ``coordinate`` on this axis holds."""
        placement = self.placement_of(name)
        if isinstance(placement, Shard):
            return value.chunk(self.size, placement.dim)[coordinate]
        return value

    def split_dim(self, name: str) -> int | None:
        """The dim this axis splits parameter ``name`` on; None where it is replicated."""
        placement = self.placement_of(name)
        return placement.dim if isinstance(placement, Shard) else None

    def block_offsets(self, name: str, shape: tuple[int, ...], coordinate: int) -> tuple[int, ...]:
        """Where the block of `local_block` starts in parameter ``name`` of logical ``shape``, on every dim.

        Example: a ``(8, 4)`` weight under ``Shard(0)`` on a tp axis of 2: rank 1's block starts at ``(4, 0)``.
        """
        dim = self.split_dim(name)
        if dim is None:
            return (0,) * len(shape)
        block = shape[dim] // self.size  # `local_shape` has checked that the axis divides it
        return tuple(coordinate * block if d == dim else 0 for d in range(len(shape)))

    def local_param(self, info: ParamInfo) -> ParamInfo:
        """``info`` with the shape a rank of this axis holds of it (its block under its placement)."""
        placement = self.placement_of(info.name)
        return attrs.evolve(info, shape=local_shape(info.shape, placement, self.size,
                                                    f"parameter {info.name!r} on axis {self.name!r}"),
                            tensor_sharded=isinstance(placement, Shard))


@attrs.frozen
class StepConfig:
    """One compilation's configuration: the placements and every option, by concern (see the module).

    With a ``tensor`` axis, ``params`` are the logical parameters, ``mesh``
    holds the data axes only (what FSDP's passes shard and reduce over), and
    the flat parameters hold each rank's tp-local blocks (Note [tp-local flats]).
    """

    params: tuple[ParamInfo, ...] = attrs.field(converter=tuple)
    mesh: MeshShape
    precision: Precision = Precision()
    scheduling: Scheduling = Scheduling()
    training: Training = Training()
    backend: StepBackend = StepBackend.EAGER
    tensor: TensorAxis | None = None

    @property
    def world_mesh(self) -> MeshShape:
        """Every axis the step runs over: ``mesh`` (the data axes), with the tensor axis at its place.

        Example: data ``fsdp=2`` and ``TensorAxis("tp", 2, 1, ...)`` give ``fsdp=2 x tp=2``, rank 1 = (0, 1).
        """
        if self.tensor is None:
            return self.mesh
        axes = list(self.mesh.axes)
        axes.insert(self.tensor.index, (self.tensor.name, self.tensor.size))
        return MeshShape(tuple(axes))

    def runtime_group_key(self, key: str) -> str:
        """The `world_mesh` group of a graph's group key: the passes' "every rank" is every rank of the data axes."""
        if self.tensor is None or key != WORLD:
            return key
        return self.world_mesh.group_key(self.mesh.names)

    @property
    def local_params(self) -> tuple[ParamInfo, ...]:
        """The parameters as a rank of the tensor axis holds them (``params`` without one)."""
        if self.tensor is None:
            return self.params
        return tuple(self.tensor.local_param(p) for p in self.params)

    def logical_flats(self, flats: tuple[FlatParam, ...] | None = None) -> tuple[FlatParam, ...]:
        """`flats` (given, or built) with every member at its logical shape: what the logical step is traced with.

        Note [tp-local flats]: the flats are built once, from the tp-local shapes,
        so that bucketing and grouping see what a rank holds; the logical ones are
        the same flats, member for member, at the logical shapes, so the trace's
        members and the localized graph's are the same members in the same order.
        """
        flats = self.flats() if flats is None else flats
        if self.tensor is None:
            return flats
        logical = {p.name: p for p in self.params}
        return tuple(attrs.evolve(f, members=tuple(attrs.evolve(m, info=logical[m.info.name]) for m in f.members))
                     for f in flats)

    def scheduled(self, **changes) -> StepConfig:
        """The same configuration with some `Scheduling` fields changed (what a budget search varies)."""
        return attrs.evolve(self, scheduling=attrs.evolve(self.scheduling, **changes))

    def flats(self) -> tuple[FlatParam, ...]:
        """The flat parameters this configuration compiles: annotate, split by parameter group, bucket.

        Every parameter without a strategy gets ZeRO-3, or ZeRO-2 without ``reshard_after_forward``.
        """
        default = Strategy.ZERO3 if self.scheduling.reshard_after_forward else Strategy.ZERO2
        flats = build_flat_params(self.local_params, self.mesh, param_dtype=self.precision.param_dtype,
                                  reduce_dtype=self.precision.reduce_dtype, default_strategy=default)
        return bucket_flat_params(split_by_group(flats, self.training), self.scheduling.bucket_bytes)
