"""DCP planners that write and read `Entry` values: names and global shapes outside, shards inside.

A state dict handed to `torch.distributed.checkpoint` may hold, next to plain
tensors and Python values, `layout.Entry` leaves. For an entry, the save
planner emits one ``WriteItem`` per chunk this rank writes (Note [chunks of a
flat shard]), with the global size, so the checkpoint's metadata is the same
``TensorStorageMetadata`` FSDP2's DTensors produce; the load planner asks DCP's
resharding (`create_read_items_for_chunk_list`) for the reads that fill the
chunks this rank holds, whatever chunks the checkpoint was written in, and DCP
copies straight into views of the rank's storage.

Note [cached save plans]: a step's checkpoints all have the same keys, chunks
and files, so the save plan is computed and agreed on (a gather and a scatter
of every rank's items) once per step: its saves pass DCP's plan cache a key of
their own, a rank whose plan is unchanged sends an empty plan, and the
coordinator reuses the agreed global plan and metadata. A step built anew (a
new layout) gets a new key.

The load planner is strict where DCP's default is terse or silent: a missing
key, a shape or dtype that differs, a value that is a tensor in one and not
in the other, or chunks that do not cover what this rank needs are each a
`CheckpointError` naming the key.
"""

from __future__ import annotations

import dataclasses
import io
import math

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner_helpers import _compare_save_plans
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, SavePlanner, TensorWriteData, WriteItem, \
    WriteItemType
from torch.distributed.checkpoint.planner_helpers import _create_read_items, _create_write_items, \
    create_read_items_for_chunk_list

from ..errors import CheckpointError
from .layout import Entry
from .untrusted import load_value

SHOWN_KEYS = 6  # keys an error lists before "... (N in all)"


class EntrySavePlanner(DefaultSavePlanner):
    """DCP's default save planner, plus `Entry` leaves written chunk by chunk (each rank its own chunks).

    With a ``cache_key``, DCP's plan caching is on under that key (Note [cached save plans]).
    """

    def __init__(self, cache_key: str | None = None):
        super().__init__(enable_plan_caching=cache_key is not None)
        if cache_key is not None:
            self._cached_plans_key = cache_key

    def create_local_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        self._pieces: dict[tuple[str, torch.Size], torch.Tensor] = {}
        for fqn, obj in self.state_dict.items():
            if not isinstance(obj, Entry):
                items += _create_write_items(fqn, obj)
                continue
            for piece in obj.save:
                offsets = torch.Size(piece.chunk.offsets)
                self._pieces[(fqn, offsets)] = piece.tensor
                items.append(WriteItem(
                    index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(piece.chunk.sizes)),
                        properties=TensorProperties(dtype=obj.dtype), size=torch.Size(obj.shape))))
        plan = SavePlan(items)
        if self.flatten_state_dict:
            plan = dataclasses.replace(plan, planner_data=self.mappings)
        self.plan = plan
        if self._enable_plan_caching:
            return self._unless_cached(plan)
        return plan

    def _unless_cached(self, plan: SavePlan) -> SavePlan:
        """As DCP's default planner caches: a plan equal to the last one is not sent; DCP reuses the cached one."""
        cached = SavePlanner._cached_save_plan.get(self._cached_plans_key)
        if cached is not None and _compare_save_plans(plan, cached):
            return SavePlan([], usable=False)
        self._pending_local_plan = plan  # promoted to the cache by `finish_plan` once the global plan succeeded
        return plan

    def lookup_object(self, index: MetadataIndex):
        if isinstance(self.state_dict.get(index.fqn), Entry):
            return self._pieces[(index.fqn, index.offset)]
        return super().lookup_object(index)


class EntryLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, plus `Entry` leaves read into this rank's chunks, with checks that name keys.

    ``where`` names the checkpoint in errors; keys in ``optional`` may be missing from it.
    """

    def __init__(self, where: str, optional: frozenset[str] = frozenset()):
        super().__init__()
        self.where = where
        self.optional = optional

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # As the default, minus `_init_state_dict`, which would replace an `Entry` by None (nothing here is on meta).
        self.original_state_dict = state_dict
        self.state_dict, self.mappings = flatten_state_dict(state_dict)
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata
        missing = [k for k in self.state_dict if k not in saved and k not in self.optional]
        if missing:
            raise CheckpointError(
                f"{self.where} has no {_keys(missing)}: it was written for another model, optimizer or format "
                f"(it holds {_keys(sorted(saved))})", path=self.where, key=missing[0])
        requests = []
        for fqn, obj in self.state_dict.items():
            if fqn not in saved:
                continue
            md = saved[fqn]
            if isinstance(obj, Entry):
                requests += self._entry_reads(fqn, obj, md)
            elif isinstance(obj, torch.Tensor):
                self._check_tensor(fqn, tuple(obj.shape), obj.dtype, md)
                requests += _create_read_items(fqn, md, obj)
            elif isinstance(md, TensorStorageMetadata):
                raise CheckpointError(f"{self.where}: {fqn!r} is a tensor there, but a {type(obj).__name__} here",
                                      path=self.where, key=fqn)
            else:
                requests += _create_read_items(fqn, md, obj)
        return LoadPlan(requests)

    def _entry_reads(self, fqn: str, entry: Entry, md) -> list:
        self._check_tensor(fqn, entry.shape, entry.dtype, md)
        chunks = [ChunkStorageMetadata(offsets=torch.Size(p.chunk.offsets), sizes=torch.Size(p.chunk.sizes))
                  for p in entry.load]
        reads = create_read_items_for_chunk_list(fqn, md, chunks)
        covered = [0] * len(chunks)
        for read in reads:
            covered[read.dest_index.index] += math.prod(read.lengths)
        for piece, got in zip(entry.load, covered):
            if got != piece.chunk.numel:  # a checkpoint whose chunks leave a hole: never load part of a tensor
                raise CheckpointError(
                    f"{self.where}: {fqn!r} is incomplete: its saved chunks cover {got} of the {piece.chunk.numel} "
                    f"elements at offsets {piece.chunk.offsets} (sizes {piece.chunk.sizes})", path=self.where, key=fqn)
        return reads

    def _check_tensor(self, fqn: str, shape: tuple[int, ...], dtype: torch.dtype, md) -> None:
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"{self.where}: {fqn!r} is not a tensor there ({type(md).__name__}); "
                                  f"here it is a tensor of shape {shape}", path=self.where, key=fqn)
        if tuple(md.size) != tuple(shape):
            raise CheckpointError(f"{self.where}: {fqn!r} has shape {tuple(md.size)} there and {tuple(shape)} "
                                  "here: it was written for another model", path=self.where, key=fqn)
        if md.properties.dtype != dtype:
            raise CheckpointError(f"{self.where}: {fqn!r} is {md.properties.dtype} there and {dtype} here; "
                                  "train (or convert the job) in the checkpoint's dtype", path=self.where, key=fqn)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        """A non-tensor value, read with torch's ``weights_only`` allowlist (Note [checkpoints run no code])."""
        fqn = read_item.dest_index.fqn
        loaded = load_value(value, self.where, fqn)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, Entry):
            return obj.load[index.index].tensor
        return super().lookup_tensor(index)


def _keys(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:SHOWN_KEYS])
    more = f", ... ({len(keys)} in all)" if len(keys) > SHOWN_KEYS else ""
    return ("key " if len(keys) == 1 else "keys ") + shown + more
