"""The schedule verifier: invariants every compiled step must hold.

  1. every collective is waited for exactly once, after it is issued;
  2. every gathered value is read only after its wait and before its free, and
     every gather of a sharded flat parameter is freed exactly once;
  3. every trainable flat parameter's gradient is reduced exactly once, and the
     reduction is waited for before its optimizer update;
  4. the optimizer touches only local data: a sharded flat parameter's update
     touches exactly its shard's elements.

`verify` raises `ScheduleError` naming the op and the flat parameter at fault.
Tests run it after every pass; `compile` runs it once at the end.
"""

from __future__ import annotations

from .errors import ScheduleError
from .schedule import COLLECTIVE_KINDS, OpKind, Schedule


def verify(schedule: Schedule) -> None:
    _check_waits(schedule)
    _check_gather_lifetimes(schedule)
    _check_reductions(schedule)
    _check_optimizer_locality(schedule)


def _check_waits(schedule: Schedule) -> None:
    issued: dict[int, int] = {}
    waited: set[int] = set()
    for op in schedule.ops:
        if op.kind in COLLECTIVE_KINDS:
            issued[op.handle] = op.index
        elif op.kind is OpKind.WAIT:
            if op.handle not in issued:
                raise ScheduleError(f"op {op.index} waits for handle h{op.handle}, which was never issued before it")
            if op.handle in waited:
                raise ScheduleError(f"op {op.index} waits a second time for h{op.handle} ({op.flat})")
            waited.add(op.handle)
    missing = set(issued) - waited
    if missing:
        h = min(missing)
        raise ScheduleError(f"collective h{h} (op {issued[h]}) is never waited for")


def _check_gather_lifetimes(schedule: Schedule) -> None:
    live: dict[str, int] = {}  # flat -> index of the wait that made it live
    gathers: dict[int, str] = {op.handle: op.flat for op in schedule.ops if op.kind is OpKind.ALL_GATHER}
    for op in schedule.ops:
        if op.kind is OpKind.WAIT and op.handle in gathers:
            if op.flat in live:
                raise ScheduleError(f"op {op.index} gathers {op.flat} again while the gather from op {live[op.flat]} is live")
            live[op.flat] = op.index
        elif op.kind is OpKind.FREE:
            if op.flat not in live:
                raise ScheduleError(f"op {op.index} frees {op.flat}, which is not gathered at that point")
            del live[op.flat]
        elif op.kind in (OpKind.COMPUTE, OpKind.OPTIMIZER):
            for flat in op.uses:
                if flat not in live:
                    raise ScheduleError(f"op {op.index} ({op.phase} compute) reads {flat} while it is not gathered")
    if live:
        flat = next(iter(live))
        raise ScheduleError(f"{flat} is gathered at op {live[flat]} and never freed")


def _check_reductions(schedule: Schedule) -> None:
    reduces: dict[str, list] = {}
    for op in schedule.ops:
        if op.kind in (OpKind.REDUCE_SCATTER, OpKind.ALL_REDUCE):
            reduces.setdefault(op.flat, []).append(op)
    waits = {op.handle: op.index for op in schedule.ops if op.kind is OpKind.WAIT}
    updates = {op.flat: op.index for op in schedule.ops if op.kind is OpKind.OPTIMIZER}
    for flat in schedule.flats:
        ops = reduces.get(flat.name, [])
        if not flat.trainable:
            if ops:
                raise ScheduleError(f"frozen {flat.name} has its gradient reduced at op {ops[0].index}")
            continue
        if len(ops) != 1:
            raise ScheduleError(f"trainable {flat.name} has its gradient reduced {len(ops)} times, expected once")
        if flat.name in updates and waits[ops[0].handle] > updates[flat.name]:
            raise ScheduleError(f"{flat.name} is updated at op {updates[flat.name]} before its gradient's reduction "
                                f"is waited for")


def _check_optimizer_locality(schedule: Schedule) -> None:
    for op in schedule.ops:
        if op.kind is not OpKind.OPTIMIZER:
            continue
        flat = schedule.flat(op.flat)
        if op.uses:
            raise ScheduleError(f"the optimizer update of {op.flat} (op {op.index}) reads gathered {op.uses}")
        if op.numel != flat.local_numel:
            raise ScheduleError(
                f"the optimizer update of {op.flat} (op {op.index}) touches {op.numel} elements; this rank holds "
                f"{flat.local_numel}"
            )
