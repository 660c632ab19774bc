"""From a rank's flat tensors to named tensors in rectangular chunks: what DCP needs to reshard.

Note [chunks of a flat shard]: DCP describes a shard of a tensor as a
rectangular chunk (offsets and sizes in the global tensor) and reshards by
intersecting the chunks a checkpoint holds with the chunks a rank wants. A
rank's piece of a member sharded flat is a contiguous range ``[lo, hi)`` of
the member's row-major flattening (Note [shard layout] in `compiler.layout.flat`),
which is not one rectangle but a union of a few: a partial row, whole rows, a
partial row, each partial row split the same way one dimension down
(`range_chunks`). So is the part of a member inside a rank's slice of a whole
flat (Note [whole-flat shards]), which may start and end mid-member. Each of
those chunks is itself a contiguous run of the flat storage, so its tensor is
a view of the rank's storage, and DCP reads into and writes from the storage
directly. A member sharded along a dim is one chunk
(the slab, clipped to the real size); a whole member is one chunk. Padding
is outside every chunk, so it is never saved and a load never reads it.

What a rank writes and what it reads may differ: under ZeRO-1 a rank holds
the whole parameter (Note [whole-flat shards]) but writes only the slice its
optimizer updates, so that every element is written by the rank that owns it;
it reads the whole.

Example::

    >>> range_chunks((3, 4), 2, 9)       # elements 2..8 of a 3x4 matrix
    [Chunk(offsets=(0, 2), sizes=(1, 2)), Chunk(offsets=(1, 0), sizes=(1, 4)), Chunk(offsets=(2, 0), sizes=(1, 1))]
"""

from __future__ import annotations

import math

import attrs
import torch

from ..compiler import FlatParam, LayoutKind, Member, member_span


@attrs.frozen
class Chunk:
    """A rectangle of a global tensor: where it starts on every dim, and its size on every dim."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@attrs.frozen(eq=False)
class Piece:
    """One chunk of a named tensor and the tensor that holds its elements on this rank (a view of the storage)."""

    chunk: Chunk
    tensor: torch.Tensor


@attrs.frozen(eq=False)
class Entry:
    """A named tensor as a checkpoint sees it: global shape, dtype, and the pieces this rank writes and reads.

    Example: ``Entry("model.fc.weight", (4, 3), torch.float32, save=(...), load=(...))``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    save: tuple[Piece, ...]
    load: tuple[Piece, ...]


def range_chunks(shape: tuple[int, ...], lo: int, hi: int) -> list[Chunk]:
    """The rectangles whose union is elements ``[lo, hi)`` of a tensor of ``shape`` flattened row-major.

    In flattening order, so chunk i's elements follow chunk i-1's (Note [chunks of a flat shard]).
    """
    if lo >= hi:
        return []
    if not shape:
        return [Chunk((), ())]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    first, first_off = divmod(lo, inner)
    last, last_off = divmod(hi, inner)
    if first == last:  # inside one row
        return [_prepend(first, c) for c in range_chunks(shape[1:], first_off, last_off)]
    chunks = []
    if first_off:
        chunks += [_prepend(first, c) for c in range_chunks(shape[1:], first_off, inner)]
        first += 1
    if last > first:
        chunks.append(Chunk((first, *(0 for _ in shape[1:])), (last - first, *shape[1:])))
    if last_off:
        chunks += [_prepend(last, c) for c in range_chunks(shape[1:], 0, last_off)]
    return chunks


def _prepend(row: int, chunk: Chunk) -> Chunk:
    return Chunk((row, *chunk.offsets), (1, *chunk.sizes))


def range_pieces(shape: tuple[int, ...], lo: int, hi: int, buffer: torch.Tensor) -> list[Piece]:
    """`range_chunks` with views: ``buffer`` is 1-d and holds elements ``[lo, hi)``, in order."""
    pieces, start = [], 0
    for chunk in range_chunks(shape, lo, hi):
        pieces.append(Piece(chunk, buffer[start : start + chunk.numel].view(chunk.sizes)))
        start += chunk.numel
    return pieces


def whole_piece(member: Member, buffer: torch.Tensor) -> list[Piece]:
    """The whole member as one chunk; ``buffer`` holds its elements flattened."""
    shape = member.info.shape
    if member.info.numel == 0:
        return []
    return [Piece(Chunk((0,) * len(shape), shape), buffer[: member.info.numel].view(shape))]


def sharded_pieces(member: Member, piece: torch.Tensor, coordinate: int) -> list[Piece]:
    """The chunks of rank ``coordinate``'s piece of a sharded member; ``piece`` is that piece, flattened."""
    shape = member.info.shape
    if member.kind is LayoutKind.SHARD_FLAT:
        c = member.piece_numel
        lo, hi = coordinate * c, min((coordinate + 1) * c, member.info.numel)
        return range_pieces(shape, lo, hi, piece)
    if member.kind is LayoutKind.SHARD_DIM:
        d = member.dim
        k = member.local_shape[d]
        start = coordinate * k
        valid = max(0, min(k, shape[d] - start))
        if valid == 0 or member.info.numel == 0:
            return []
        view = piece.view(member.local_shape).narrow(d, 0, valid)
        offsets = tuple(start if i == d else 0 for i in range(len(shape)))
        sizes = tuple(valid if i == d else s for i, s in enumerate(shape))
        return [Piece(Chunk(offsets, sizes), view)]
    return whole_piece(member, piece)


def placed(pieces: list[Piece], offsets: tuple[int, ...]) -> list[Piece]:
    """``pieces`` of a block that starts at ``offsets`` in the global tensor, as chunks of the global tensor.

    A tensor axis's block is a rectangle (Note [tp-local flats]); every chunk of it moves by its start.
    """
    if not any(offsets):
        return pieces
    return [Piece(Chunk(tuple(o + s for o, s in zip(p.chunk.offsets, offsets)), p.chunk.sizes), p.tensor)
            for p in pieces]


def parameter_pieces(flat: FlatParam, member: Member, storage: torch.Tensor, coordinate: int
                     ) -> tuple[list[Piece], list[Piece]]:
    """(what this rank writes, what it reads) of one member of its parameter storage for ``flat``.

    ``coordinate`` is the rank's coordinate on the flat's axis (0 when replicated).
    """
    if flat.params_sharded and flat.whole_layout:  # the rank holds its slice of the whole, nothing more
        pieces = _slice_pieces(flat, member, storage, coordinate, base=coordinate * flat.shard_numel)
        return pieces, pieces
    if flat.params_sharded:
        pieces = sharded_pieces(member, storage[member.offset : member.offset + member.piece_numel], coordinate)
        return pieces, pieces
    whole = whole_piece(member, storage[member.offset :])
    if not flat.sharded:  # DDP: every rank holds and writes the whole (DCP keeps one copy)
        return whole, whole
    return _slice_pieces(flat, member, storage, coordinate, base=0), whole  # ZeRO-1


def optimizer_pieces(flat: FlatParam, member: Member, state: torch.Tensor, coordinate: int) -> list[Piece]:
    """The chunks of one member in one optimizer-state tensor of ``flat`` (shaped like the optimizer's shard)."""
    if flat.params_sharded and not flat.whole_layout:
        return sharded_pieces(member, state[member.offset : member.offset + member.piece_numel], coordinate)
    if not flat.sharded:
        return whole_piece(member, state[member.offset :])
    return _slice_pieces(flat, member, state, coordinate, base=coordinate * flat.shard_numel)


def _slice_pieces(flat: FlatParam, member: Member, buffer: torch.Tensor, coordinate: int, base: int) -> list[Piece]:
    """The whole layout: the part of ``member`` inside rank ``coordinate``'s slice of the whole flat storage.

    ``buffer`` starts at storage element ``base`` (0 for the whole storage, the slice's start for
    optimizer state, which holds only the slice).
    """
    lo, hi = member_span(flat, member, coordinate)
    if lo >= hi:
        return []
    start = member.offset - base
    return range_pieces(member.info.shape, lo, hi, buffer[start + lo : start + hi])
