"""Flat parameters: how a unit's parameters are packed into the tensors a rank holds.

A `FlatParam` is the parameters of one unit that share a layout (sharded over the
same axis, or replicated), a trainability and a dtype, concatenated. It is the
grain of everything downstream: one graph input per rank, one collective to
gather it, one collective to reduce its gradient, one optimizer update.

Note [shard layout]: in the pieces layout (`FlatLayout.PIECES`), a rank's
shard of a flat parameter is the concatenation of its members' local pieces,
``[m1 piece | m2 piece | ...]``. A member sharded flat is flattened and padded
to ``N * c`` elements, and rank r holds elements ``[r*c, (r+1)*c)``. A member sharded along dim d is padded on d to ``N * k`` and
rank r holds the slab ``[r*k, (r+1)*k)`` on d, flattened. A gather therefore
returns an ``(N, S)`` matrix whose row r is rank r's shard, and a member is
rebuilt from its column block. Padding is zero and stays zero: its gradient is
zero and every optimizer here maps a zero parameter with zero gradient and
zero state to zero.

Note [whole-flat shards]: that layout is for units with a member sharded
along a dim (``shard(axis, dim=d)``), whose gathered pieces must be rebuilt
into slabs. A unit whose members are all sharded flat (``shard(axis)``, the
default) and every ZERO1 unit lie whole instead (`FlatLayout.WHOLE`): the
members concatenated whole and padded to ``N * c`` elements, rank r's shard
being the slice ``[r*c, (r+1)*c)`` of that (DeepSpeed's flat partition,
FSDP1's flat parameter). Under ZERO3 / ZERO2 a rank holds only its slice, and
the gathered buffer *is* the whole flat: each member is a view of it, with no
copy out (the pieces layout copies every gathered member once, 0.2 s of a
3.6 s step at 100M N = 2 under ZERO2, twice that under ZERO3, which gathers
twice). The gradient is packed in the same order, the optimizer updates the
slice, and a checkpoint writes the part of each member inside the slice
(`shardlang.checkpoint.layout`). Under ZERO1 a rank holds the whole
storage: forward reads views of it, the optimizer updates the slice in place,
and an all-gather writes every rank's updated slice back into the storage. A
member's dims do not matter in this layout: nothing is rebuilt from pieces.

The functions here are plain torch code used in two places: by the runtime to cut
real tensors into shards, and as call targets of graph nodes that unpack a
gathered buffer or pack gradients for a reduce-scatter.
"""

from __future__ import annotations

import enum
import math

import attrs
import torch

from .placement import LayoutKind, MeshShape, ParamInfo
from shardlang.spec.vocabulary import Strategy


@attrs.frozen
class Member:
    """One parameter inside a flat parameter, with its piece's size and offset in the shard."""

    info: ParamInfo
    world: int  # ranks along the sharding axis (1 when replicated)
    offset: int  # where this member's piece starts in the shard

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def kind(self) -> LayoutKind:
        return self.info.placement.kind

    @property
    def dim(self) -> int | None:
        return self.info.placement.dim

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of this rank's piece before flattening (padded)."""
        shape = self.info.shape
        if self.kind is LayoutKind.SHARD_FLAT:
            return (math.ceil(self.info.numel / self.world),)
        if self.kind is LayoutKind.SHARD_DIM:
            d = self.dim
            return shape[:d] + (math.ceil(shape[d] / self.world),) + shape[d + 1 :]
        return shape

    @property
    def piece_numel(self) -> int:
        return math.prod(self.local_shape)

    @property
    def padded_numel(self) -> int:
        return self.piece_numel * self.world


class FlatLayout(enum.Enum):
    """How a flat parameter's members lie in its storage.

    ``PIECES``: rank r holds piece r of every member, concatenated (Note [shard layout]); a gather
    is rebuilt into members by copying. ``WHOLE``: the members lie whole, concatenated and padded,
    and rank r's shard is slice r (Note [whole-flat shards]); a gathered member is a view.
    """

    PIECES = "pieces"
    WHOLE = "whole"


@attrs.frozen
class FlatParam:
    """The parameters of one unit that share layout, trainability and dtype.

    Example: the sharded, trainable float32 parameters of ``blocks.0`` form the
    flat parameter named ``"blocks.0"``; its frozen ones would form
    ``"blocks.0#frozen"``.
    """

    name: str
    unit: str
    axis: str | None  # None when replicated
    world: int
    trainable: bool
    dtype: torch.dtype
    members: tuple[Member, ...]
    group: int = 0  # parameter group (`compiler.ir.training`): which optimizer hyperparameters update it
    param_dtype: torch.dtype | None = None  # mixed precision: gather and compute in this dtype
    reduce_dtype: torch.dtype | None = None  # mixed precision: reduce gradients in this dtype
    strategy: Strategy = Strategy.ZERO3  # DDP exactly when axis is None
    layout: FlatLayout = FlatLayout.PIECES  # Note [whole-flat shards]; ZERO1 and DDP lie whole whatever it says
    tensor_sharded: bool = False  # its members are blocks of a tensor axis (each tensor rank holds other values)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the gathered parameters have: ``param_dtype`` when set, else the master dtype."""
        return self.param_dtype or self.dtype

    @property
    def gradient_reduce_dtype(self) -> torch.dtype:
        """The dtype gradients are reduced in (as FSDP2: ``reduce_dtype``, else the compute dtype)."""
        return self.reduce_dtype or self.compute_dtype

    @property
    def sharded(self) -> bool:
        return self.axis is not None

    @property
    def params_sharded(self) -> bool:
        """Whether a rank holds only a shard of the parameters and gathers them to compute (ZERO3, ZERO2)."""
        return self.sharded and self.strategy.shards_parameters

    @property
    def whole_layout(self) -> bool:
        """Whether a sharded flat's members lie whole and a shard is a slice of them (Note [whole-flat shards])."""
        return self.sharded and (self.strategy is Strategy.ZERO1 or self.layout is FlatLayout.WHOLE)

    @property
    def shard_numel(self) -> int:
        """S: the elements of a rank's shard, which its optimizer updates (all members' pieces).

        In the whole layout, ``ceil(numel / N)`` (Note [whole-flat shards]); replicated, the whole.
        """
        if self.whole_layout:
            return -(-self.numel // self.world)
        return sum(m.piece_numel for m in self.members)

    @property
    def padded_numel(self) -> int:
        """N * S: the elements of the gathered buffer (the padded whole)."""
        return self.shard_numel * self.world

    @property
    def storage_numel(self) -> int:
        """The elements of the parameter tensor a rank holds: its shard, or (ZERO1, DDP) the whole, padded."""
        if self.params_sharded:
            return self.shard_numel
        return self.padded_numel if self.sharded else self.numel

    @property
    def numel(self) -> int:
        """The real (unpadded) elements of all members."""
        return sum(m.info.numel for m in self.members)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def build_flat_params(params: tuple[ParamInfo, ...], mesh: MeshShape, param_dtype: torch.dtype | None = None,
                      reduce_dtype: torch.dtype | None = None,
                      default_strategy: Strategy = Strategy.ZERO3) -> tuple[FlatParam, ...]:
    """Group parameters into flat parameters, in order of first appearance of each group.

    ``param_dtype`` / ``reduce_dtype`` set mixed precision on every floating flat parameter.
    A parameter whose ``strategy`` is None gets ``default_strategy``. A flat
    parameter is replicated (DDP) when its layout is ``replicate()``, its
    strategy is DDP, or it is frozen under ZERO1 (no optimizer state to shard).
    """
    groups: dict[tuple, list[ParamInfo]] = {}
    for p in params:
        strategy = p.strategy or default_strategy
        axis = p.placement.axis if p.placement.is_sharded else None
        if strategy is Strategy.DDP or (strategy is Strategy.ZERO1 and not p.trainable):
            axis = None
        if axis is None:
            strategy = Strategy.DDP
        suffix = "#replicated" if not p.placement.is_sharded and (p.strategy or default_strategy) is not Strategy.DDP else ""
        suffix += "#tp" if p.tensor_sharded else ""  # Note [norm over shards]: a flat is split over tp or not
        key = (p.unit, axis, p.trainable, p.dtype, strategy, suffix)
        groups.setdefault(key, []).append(p)
    flats = []
    for (unit, axis, trainable, dtype, strategy, suffix), infos in groups.items():
        world = mesh.axis_size(axis) if axis is not None else 1
        layout = _layout(strategy, infos)
        members, offset = [], 0
        for info in infos:
            member = Member(info=info, world=1 if layout is FlatLayout.WHOLE else world, offset=offset)
            members.append(member)
            offset += member.piece_numel
        flats.append(
            FlatParam(
                name=_flat_name(unit, trainable, suffix),
                unit=unit,
                axis=axis,
                world=world,
                trainable=trainable,
                dtype=dtype,
                members=tuple(members),
                param_dtype=param_dtype if dtype.is_floating_point and param_dtype != dtype else None,
                reduce_dtype=reduce_dtype if dtype.is_floating_point else None,
                strategy=strategy,
                layout=layout,
                tensor_sharded=suffix.endswith("#tp"),
            )
        )
    return _unique_names(flats)


def _layout(strategy: Strategy, infos: list[ParamInfo]) -> FlatLayout:
    """WHOLE unless the parameters are sharded and one of them along a dim (Note [whole-flat shards])."""
    if strategy.shards_parameters and any(p.placement.kind is LayoutKind.SHARD_DIM for p in infos):
        return FlatLayout.PIECES
    return FlatLayout.WHOLE


def _flat_name(unit: str, trainable: bool, suffix: str) -> str:
    return (unit or "<root>") + suffix + ("" if trainable else "#frozen")


def _unique_names(flats: list[FlatParam]) -> tuple[FlatParam, ...]:
    """Flat parameters that would share a name get what tells them apart: ``#axis``, ``#strategy``, ``#dtype``.

    Example: a unit with parameters sharded over two axes of a 2-D mesh has
    flat parameters ``blocks.0#fsdp`` and ``blocks.0#replicate``.
    """
    clashes: dict[str, list[FlatParam]] = {}
    for f in flats:
        clashes.setdefault(f.name, []).append(f)
    parts = (lambda f: f.axis, lambda f: f.strategy.value, lambda f: str(f.dtype).removeprefix("torch."))
    renamed = []
    for f in flats:
        group = clashes[f.name]
        if len(group) > 1:
            varying = [part for part in parts if len({part(g) for g in group}) > 1]
            f = attrs.evolve(f, name=f.name + "".join(f"#{part(f)}" for part in varying if part(f) is not None))
        renamed.append(f)
    return tuple(renamed)


# ---- cutting real tensors (runtime) -------------------------------------------------


def member_piece(member: Member, full: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank``'s piece of one member, flattened (see Note [shard layout])."""
    if member.kind is LayoutKind.REPLICATE:
        return full.reshape(-1)
    if member.kind is LayoutKind.SHARD_FLAT:
        c = member.piece_numel
        flat = _pad_flat(full.reshape(-1), member.padded_numel)
        return flat[rank * c : (rank + 1) * c]
    d = member.dim
    k = member.local_shape[d]
    padded = _pad_dim(full, d, k * member.world)
    return padded.narrow(d, rank * k, k).reshape(-1)


def shard_of(flat: FlatParam, tensors: dict[str, torch.Tensor], rank: int) -> torch.Tensor:
    """A rank's parameter storage for ``flat`` cut from full tensors by member name (fresh, contiguous).

    Its shard when the strategy shards parameters; the whole flat parameter
    (padded under ZERO1, Note [whole-flat shards]) otherwise.
    """
    if flat.params_sharded and flat.whole_layout:  # slice ``rank`` of the whole (Note [whole-flat shards])
        pieces = [tensors[m.name].detach().reshape(-1)[lo:hi] for m, lo, hi in slice_spans(flat, rank)]
    else:
        pieces = [member_piece(m, tensors[m.name].detach(), rank) for m in flat.members]
    out = torch.cat(pieces) if pieces else torch.empty(0, dtype=flat.dtype)
    return _pad_flat(out, flat.storage_numel)


def member_span(flat: FlatParam, member: Member, coordinate: int) -> tuple[int, int]:
    """In the whole layout: the elements ``[lo, hi)`` of ``member`` (flattened) inside slice ``coordinate``.

    Empty (``lo >= hi``) when the slice holds none of it (Note [whole-flat shards]).
    """
    start = coordinate * flat.shard_numel
    lo = max(start, member.offset) - member.offset
    hi = min(start + flat.shard_numel, member.offset + member.info.numel) - member.offset
    return lo, hi


def slice_spans(flat: FlatParam, coordinate: int) -> list[tuple[Member, int, int]]:
    """In the whole layout: each member with elements in slice ``coordinate``, and their ``[lo, hi)``, in order."""
    return [(m, lo, hi) for m in flat.members for lo, hi in [member_span(flat, m, coordinate)] if lo < hi]


# ---- graph node targets --------------------------------------------------------------


def unpack_member(gathered: torch.Tensor, world: int, offset: int, piece: int, kind: str, dim: int | None,
                  local_shape: list[int], shape: list[int]) -> torch.Tensor:
    """Rebuild one full parameter from a gathered ``(N * S)`` buffer (copy-out).

    A view when the member's column block is the whole row (single-member flat
    sharded flat); a copy otherwise.
    """
    rows = gathered.view(world, -1)
    block = rows[:, offset : offset + piece] if rows.shape[1] != piece else rows
    numel = math.prod(shape)
    if kind == LayoutKind.SHARD_DIM.value:
        parts = block.reshape(world, *local_shape).movedim(0, dim)
        merged_shape = list(local_shape)
        merged_shape[dim] = local_shape[dim] * world
        return parts.reshape(merged_shape).narrow(dim, 0, shape[dim])
    return block.reshape(-1)[:numel].view(shape)


def unpack_member_into(gathered: torch.Tensor, world: int, offset: int, piece: int, kind: str, dim: int | None,
                       local_shape: list[int], shape: list[int], out: torch.Tensor) -> torch.Tensor:
    """`unpack_member` of a flat-sharded member copied into ``out`` (a slot of the step's pool, Note [buffer
    assignment]) row by row, with no temporary; returns ``out`` viewed as ``shape``. The same values, in the same
    order: rank 0's piece, then rank 1's, ..., the padding left out."""
    rows = gathered.view(world, -1)
    block = rows[:, offset : offset + piece]
    numel = math.prod(shape)
    flat = out.view(-1)
    whole = numel // piece
    if whole:
        flat[: whole * piece].view(whole, piece).copy_(block[:whole])
    if numel > whole * piece:
        flat[whole * piece :].copy_(block[whole, : numel - whole * piece])
    return out.view(shape)


def pack_gradients(world: int, specs: list, dtype: torch.dtype | None, *grads: torch.Tensor) -> torch.Tensor:
    """Lay out full gradients as a ``(N * S)`` buffer whose row r is rank r's shard (copy-in).

    ``specs`` holds one ``(kind, dim, piece_numel, local_dim, shape)`` per
    gradient; a gradient may arrive flattened, and is viewed back to ``shape``.
    ``dtype`` (mixed precision) is the dtype of the packed buffer, the one reduced in.
    The inverse of `unpack_member`, applied to every member at once.
    """
    rows = _gradient_rows(world, specs, dtype, grads)
    return torch.cat(rows, dim=1).reshape(-1) if len(rows) > 1 else rows[0].reshape(-1)


def pack_gradients_into(out: torch.Tensor, world: int, specs: list, dtype: torch.dtype | None,
                        *grads: torch.Tensor) -> torch.Tensor:
    """`pack_gradients` written into ``out`` (a slot of the step's pool, Note [buffer assignment]); returns ``out``."""
    rows = _gradient_rows(world, specs, dtype, grads)
    torch.cat(rows, dim=1, out=out.view(world, -1))
    return out


def _gradient_rows(world: int, specs: list, dtype: torch.dtype | None, grads) -> list[torch.Tensor]:
    """Each gradient as ``(N, piece)``: row r is rank r's piece of it."""
    rows = []
    for grad, (kind, dim, piece, local_dim, shape) in zip(grads, specs):
        grad = grad.reshape(shape) if dtype is None else grad.reshape(shape).to(dtype)
        if kind == LayoutKind.SHARD_DIM.value:
            padded = _pad_dim(grad, dim, local_dim * world)
            split = padded.reshape(*padded.shape[:dim], world, local_dim, *padded.shape[dim + 1 :])
            rows.append(split.movedim(dim, 0).reshape(world, piece))
        else:
            rows.append(_pad_flat(grad.reshape(-1), world * piece).view(world, piece))
    return rows


def flatten_gradients(dtype: torch.dtype | None, *grads: torch.Tensor) -> torch.Tensor:
    """Concatenate full gradients of a replicated flat parameter (the all-reduce buffer), in ``dtype``."""
    flat = torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 else grads[0].reshape(-1)
    return flat if dtype is None else flat.to(dtype)


def is_new_flat_buffer(node) -> bool:
    """Whether fx ``node`` is a `flatten_gradients` that makes a buffer of its own (several gradients, or a cast)
    read by one node alone; one gradient flattened is a view of it (Note [reductions in place] in `compiler.passes.reduce_in_place`)."""
    if node.op != "call_function" or node.target is not flatten_gradients or len(node.users) != 1:
        return False
    dtype, *grads = node.args
    return len(grads) > 1 or dtype is not None


class KeptReductionBuffer:
    """The all-reduce buffer of one replicated flat gradient, kept between steps (Note [kept reduction buffers]).

    Its `fill` stands in for `flatten_gradients` in the bound graph: the first
    call allocates the buffer, later calls write the same concatenation into it
    (a buffer of another size is allocated anew). Example::

        kept = KeptReductionBuffer()
        flat = kept.fill(None, grad_a, grad_b)     # kept.buffer is flat, reused by the next step
    """

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def fill(self, dtype: torch.dtype | None, *grads: torch.Tensor) -> torch.Tensor:
        """`flatten_gradients` into the kept buffer: the same values, to the bit, in the same storage every step."""
        numel = sum(g.numel() for g in grads)
        dtype = dtype or grads[0].dtype
        buffer = self.buffer
        if buffer is None or buffer.numel() != numel or buffer.dtype != dtype or buffer.device != grads[0].device:
            buffer = self.buffer = torch.empty(numel, dtype=dtype, device=grads[0].device)
        if len(grads) > 1:
            torch.cat([g.reshape(-1) for g in grads], out=buffer)
        else:
            buffer.copy_(grads[0].reshape(-1))
        return buffer


def pack_whole_gradients(padded_numel: int, dtype: torch.dtype | None, *grads: torch.Tensor) -> torch.Tensor:
    """Concatenate full gradients and pad them to ``padded_numel`` (ZERO1's reduce-scatter buffer), in ``dtype``.

    Row r of the result viewed as ``(N, c)`` is rank r's slice (Note [whole-flat shards]).
    """
    flat = torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 else grads[0].reshape(-1)
    flat = flat if dtype is None else flat.to(dtype)
    return _pad_flat(flat, padded_numel)


def pack_whole_gradients_into(out: torch.Tensor, padded_numel: int, dtype: torch.dtype | None,
                              *grads: torch.Tensor) -> torch.Tensor:
    """`pack_whole_gradients` written into ``out`` (a slot of the step's pool, Note [buffer assignment]): each
    gradient copied (and cast) in place, the padding zeroed; returns ``out``."""
    offset = 0
    for grad in grads:
        out[offset : offset + grad.numel()].copy_(grad.reshape(-1))
        offset += grad.numel()
    out[offset:padded_numel].zero_()
    return out


def _pad_flat(flat: torch.Tensor, numel: int) -> torch.Tensor:
    if flat.numel() == numel:
        return flat
    return torch.nn.functional.pad(flat, (0, numel - flat.numel()))


def _pad_dim(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    if t.shape[dim] == size:
        return t
    pad = [0, 0] * (t.dim() - dim - 1) + [0, size - t.shape[dim]]
    return torch.nn.functional.pad(t, pad)
