"""The schedule verifier: invariants every compiled step must hold.

  1. every collective is waited for exactly once, after it is issued;
  2. every gathered value is read only after its wait and before its free, and
     every gather of a sharded flat parameter is freed exactly once;
  3. every trainable flat parameter's gradient is summed over every rank
     exactly once (one collective per mesh axis it spans: a reduce-scatter over
     its shard axis plus, on a hybrid mesh, an all-reduce across the replicas;
     or one all-reduce over the world), and waited for before its update;
  4. the optimizer touches only local data: a sharded flat parameter's update
     touches exactly its shard's elements;
  5. each flat parameter communicates as its strategy says: ZERO3 gathers at
     most twice (forward, and again for backward), ZERO2 at most once, ZERO1
     never before its update and exactly once (the updated shards) after it,
     DDP never (docs/strategies.md);
  6. a recompute (compute ops with detail "recompute") runs in backward, after
     every forward op, and every gathered flat parameter it reads stays
     gathered until that unit's backward reads it: one gather serves the
     recompute and the backward, never one of its own (Note [one gather for
     recompute and backward] in passes/recompute_activations.py).

An evaluation schedule (``options["evaluate"]``, Note [evaluation graph] in
`compiler.evaluate`) keeps 1 and 2 and replaces 3 to 5 by: it is forward only,
with no reduction and no optimizer update, and each flat parameter is gathered
at most once (ZERO3, ZERO2) or never (ZERO1, DDP: every rank holds it whole).

`verify` raises `ScheduleError` naming the op and the flat parameter at fault.
Tests run it after every pass; `compile` runs it once at the end.
"""

from __future__ import annotations

from shardlang.errors import ScheduleError
from ..ir.trace import Phase
from ..layout.placement import WORLD
from shardlang.spec.vocabulary import Strategy
from .schedule import COLLECTIVE_KINDS, OpKind, Schedule


def verify(schedule: Schedule) -> None:
    _check_waits(schedule)
    _check_gather_lifetimes(schedule)
    if schedule.is_evaluation:
        _check_forward_only(schedule)
        return
    _check_reductions(schedule)
    _check_optimizer_locality(schedule)
    _check_strategies(schedule)
    _check_recompute(schedule)


def verify_structure(schedule: Schedule, *, frees_placed: bool = True) -> None:
    """What holds after every pass: each collective is waited for; with ``frees_placed``, each gather is freed.

    The pipeline checks this between passes (``check_each_pass``); `verify` checks it and the rest at the end.
    """
    _check_waits(schedule)
    if frees_placed:
        _check_gather_lifetimes(schedule)


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
    updates = {f.name for f in schedule.flats if f.strategy is Strategy.ZERO1}  # gathered into storage
    gathers: dict[int, str] = {op.handle: op.flat for op in schedule.ops  # a tensor axis's gathers: activations
                               if op.kind is OpKind.ALL_GATHER and op.flat is not None and op.flat not in updates}
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
                    raise ScheduleError(f"op {op.index} ({op.phase.value} compute) reads {flat} while it is not gathered")
    if live:
        flat = next(iter(live))
        raise ScheduleError(f"{flat} is gathered at op {live[flat]} and never freed")


def _check_forward_only(schedule: Schedule) -> None:
    """An evaluation schedule: forward ops, no reductions, no updates, one gather per gathered flat at most."""
    gathered: dict[str, int] = {}
    for op in schedule.ops:
        if op.phase is not Phase.FORWARD:
            raise ScheduleError(f"op {op.index} ({op.kind.value}) of an evaluation schedule is in phase "
                                f"{op.phase.value}; "
                                "evaluation is forward only")
        if op.flat is None and op.kind in COLLECTIVE_KINDS:
            continue  # a tensor axis's redistribution of an activation
        if op.kind in (OpKind.REDUCE_SCATTER, OpKind.ALL_REDUCE, OpKind.OPTIMIZER):
            raise ScheduleError(f"op {op.index} of an evaluation schedule is a {op.kind.value}"
                                + (f" of {op.flat}" if op.flat else "") + "; evaluation reduces and updates nothing")
        if op.kind is OpKind.ALL_GATHER:
            flat = schedule.flat(op.flat)
            if not flat.strategy.shards_parameters:
                raise ScheduleError(f"{flat.strategy.value} {flat.name} is gathered at op {op.index}; under "
                                    f"{flat.strategy.value} every rank holds the whole parameter")
            if op.flat in gathered:
                raise ScheduleError(f"{op.flat} is gathered twice in an evaluation schedule (ops "
                                    f"{gathered[op.flat]} and {op.index}); forward needs it once")
            gathered[op.flat] = op.index


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
        if not ops:
            if schedule.world_size == 1:
                continue  # Note [updates from member gradients]: nothing to sum, the update reads member gradients
            raise ScheduleError(f"trainable {flat.name} has its gradient reduced 0 times, expected once")
        for microbatch in sorted({op.microbatch for op in ops}, key=lambda m: -1 if m is None else m):
            _check_sums_over_every_rank(schedule, flat, [op for op in ops if op.microbatch == microbatch])
        for op in ops:
            if flat.name in updates and waits[op.handle] > updates[flat.name]:
                raise ScheduleError(f"{flat.name} is updated at op {updates[flat.name]} before its gradient's "
                                    f"reduction (op {op.index}) is waited for")


def _check_sums_over_every_rank(schedule: Schedule, flat, ops: list) -> None:
    """The reductions of one gradient span every mesh axis exactly once, and its shard axis first."""
    all_axes = [name for name, _ in schedule.mesh]
    seen: dict[str, int] = {}
    for op in ops:
        group = op.group or WORLD
        for axis in all_axes if group == WORLD else group.split("+"):
            if axis in seen:
                raise ScheduleError(f"trainable {flat.name} has its gradient reduced {len(ops)} times, expected once "
                                    f"over each mesh axis: axis {axis!r} at ops {seen[axis]} and {op.index}")
            seen[axis] = op.index
    missing = [a for a in all_axes if a not in seen and dict(schedule.mesh)[a] > 1]
    if missing:
        raise ScheduleError(f"trainable {flat.name}'s gradient is never summed over mesh axes {missing} "
                            f"(reductions at ops {[op.index for op in ops]})")
    if flat.sharded and ops[0].kind is not OpKind.REDUCE_SCATTER:
        raise ScheduleError(f"sharded {flat.name}'s gradient is first reduced by {ops[0].kind.value} "
                            f"(op {ops[0].index}); it must be reduce-scattered over {flat.axis!r}")


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


def _most_in_one_microbatch(ops: list) -> int:
    """The most ``ops`` of one micro-batch (each micro-batch gathers on its own, `accumulate_microbatches`)."""
    counts: dict = {}
    for op in ops:
        counts[op.microbatch] = counts.get(op.microbatch, 0) + 1
    return max(counts.values(), default=0)


def _check_strategies(schedule: Schedule) -> None:
    gathers: dict[str, list] = {}
    for op in schedule.ops:
        if op.kind is OpKind.ALL_GATHER:
            gathers.setdefault(op.flat, []).append(op)
    updated = {op.flat: op.index for op in schedule.ops if op.kind is OpKind.OPTIMIZER}
    allowed = {Strategy.ZERO3: 2, Strategy.ZERO2: 1, Strategy.DDP: 0}
    for flat in schedule.flats:
        ops = gathers.get(flat.name, [])
        if flat.strategy is Strategy.ZERO1:
            early = [op for op in ops if flat.name not in updated or op.index < updated[flat.name]]
            if early:
                raise ScheduleError(f"zero1 {flat.name} is gathered at op {early[0].index}, before its update; "
                                    "under ZERO1 every rank holds the whole parameter")
            expected = 1 if flat.trainable and flat.name in updated else 0
            if len(ops) != expected:
                raise ScheduleError(f"zero1 {flat.name} gathers its updated shards {len(ops)} times, "
                                    f"expected {expected}")
        elif _most_in_one_microbatch(ops) > allowed.get(flat.strategy, 0):
            raise ScheduleError(f"{flat.strategy.value} {flat.name} is gathered {len(ops)} times (ops "
                                f"{[op.index for op in ops]}); {flat.strategy.value} allows at most "
                                f"{allowed.get(flat.strategy, 0)}")


def _check_recompute(schedule: Schedule) -> None:
    ops = schedule.ops
    recomputes = [op for op in ops if op.kind is OpKind.COMPUTE and op.detail == "recompute"]
    if not recomputes:
        return
    last_forward: dict = {}  # micro-batch -> its last forward op before its first backward op
    started: set = set()
    for op in ops:
        if op.phase is Phase.BACKWARD:
            started.add(op.microbatch)
        elif op.phase is Phase.FORWARD and op.microbatch not in started:
            last_forward[op.microbatch] = op.index
    for op in recomputes:
        if op.phase is not Phase.BACKWARD or op.index < last_forward.get(op.microbatch, -1):
            raise ScheduleError(f"op {op.index} recomputes unit {op.unit or '<root>'} in {op.phase.value}, before forward "
                                f"ends (op {last_forward.get(op.microbatch)}); a recompute belongs to backward")
        for flat in op.uses:
            _check_gather_reused(schedule, op, flat)


def _check_gather_reused(schedule: Schedule, recompute, flat: str) -> None:
    """Between the recompute's read of ``flat`` and its next free, the unit's backward reads it too."""
    for op in schedule.ops[recompute.index + 1:]:
        if op.kind is OpKind.FREE and op.flat == flat:
            break
        if op.kind is OpKind.COMPUTE and op.detail != "recompute" and op.phase is Phase.BACKWARD and flat in op.uses:
            return
    raise ScheduleError(f"op {recompute.index} recomputes unit {recompute.unit or '<root>'} reading {flat}, but no "
                        "backward op reads that gather after it: the recompute gathered its parameters for itself "
                        "alone, instead of sharing the backward's gather")
