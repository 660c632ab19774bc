"""Which slots of the step's pool to hold: those that do not raise the planned peak (Note [buffer assignment]).

A slot held between steps costs its bytes wherever none of its buffers is
alive: before its first, between two, after its last. (A buffer that a
collective reads is the slot's until that collective's wait, but the step
without the pool frees it after its last reader: there the slot costs its
bytes too.) The plan of the pooled step is the plan without the pool plus
these idle bytes, node for node, so the choice needs no second plan. Taken one at a time,
largest first, a slot is held when, at every node where it would be idle, the
bytes live there without the pool, plus the idle slots already chosen, plus
its own, stay within the step's peak without the pool. A slot left out makes
its buffers anew, as without the pool.

Example::

    lives = candidate_lives(compiled.graph_module.graph)
    slots = assign_slots(lives)
    held = slots_within_peak(lives, slots, compiled.memory)     # {slot index, ...}
"""

from __future__ import annotations

from ..passes.assign_buffers import Life
from .memory import MemoryPlan


def slots_within_peak(lives: list[Life], slots: dict, plan: MemoryPlan) -> set[int]:
    """The slots the pool may hold without raising ``plan``'s peak (``plan``: the step without the pool)."""
    during = [n.during for n in plan.nodes]
    busy: dict[int, list[Life]] = {}
    for life in lives:
        busy.setdefault(slots[life.node], []).append(life)
    idle_extra = [0] * len(during)
    held: set[int] = set()
    for index, occupants in sorted(busy.items(), key=lambda item: -_nbytes(item[1][0])):
        size = _nbytes(occupants[0])
        idle = _idle_positions(occupants, len(during))
        if all(during[i] + idle_extra[i] + size <= plan.peak for i in idle):
            held.add(index)
            for i in idle:
                idle_extra[i] += size
    return held


def _nbytes(life: Life) -> int:
    return life.numel * life.dtype.itemsize


def _idle_positions(occupants: list[Life], count: int) -> list[int]:
    busy = [False] * count
    for life in occupants:
        for i in range(life.start, life.freed + 1):
            busy[i] = True
    return [i for i, b in enumerate(busy) if not b]
