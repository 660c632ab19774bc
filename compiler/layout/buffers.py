"""The step's buffer pool: slots that gathers and reduction packs write into, held from one step to the next.

Note [buffer assignment]: a gathered unit and a packed gradient are each a
fresh full-size buffer. Made anew every step, such a buffer lies above
glibc's mmap threshold: its pages are mapped and faulted in by the gather or
the pack, then unmapped when it dies, every step (at 100M parameters, N = 2,
ZeRO-2 faulted in about 183k pages a step). `passes.assign_buffers` gives
each such buffer a slot instead, as XLA's buffer assignment does: buffers of
the same size and dtype whose lives do not overlap share a slot, so a unit's
gathered buffer, once freed, takes its gradient pack, or a later unit's
gather. In the graph a slot is one `buffer_slot` node at the step's start;
a gather writes into it (``all_gather_into``), a pack too
(`pack_gradients_into`). `emit.bind` swaps `buffer_slot` for a `BufferPool`'s
``slot``, which allocates on the first step and returns the same tensor after:
the slots are the bound step's, held between steps. The memory plan counts
them as `Category.BUFFER_POOL`, live for the whole step; `compile_step` keeps
the pool only where the planned peak does not rise.

Example::

    pool = BufferPool()
    a = pool.slot(0, 1024, torch.float32, shard)     # allocated now
    b = pool.slot(0, 1024, torch.float32, shard)     # the same tensor: b is a
"""

from __future__ import annotations

import torch


def buffer_slot(index: int, numel: int, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    """Slot ``index`` of the step's pool: ``numel`` elements of ``dtype`` on ``like``'s device.

    Unbound (planning, fake tensors), a new buffer of that size: what the bound
    step's `BufferPool.slot` returns, minus the keeping.
    """
    return like.new_empty(numel, dtype=dtype)


class BufferPool:
    """The slots of one bound step (Note [buffer assignment]): each allocated by its first use, then kept."""

    def __init__(self) -> None:
        self.slots: dict[int, torch.Tensor] = {}

    def slot(self, index: int, numel: int, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
        """`buffer_slot` with the buffer kept: the same tensor every step (a new one if the request changed)."""
        held = self.slots.get(index)
        if held is None or held.numel() != numel or held.dtype != dtype or held.device != like.device:
            held = self.slots[index] = torch.empty(numel, dtype=dtype, device=like.device)
        return held

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.slots.values())
