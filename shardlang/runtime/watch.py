"""Collectives that wait too long: where each rank is, and the error that names the late one.

Note [collective timeout]: every process group is made with a timeout
(`DistContext.timeout_s`, default 10 minutes as NCCL's; ``shardlang run
--timeout``, ``init_process_group(timeout_s=)``, ``sl.compile(timeout=)``), and
gloo fails a collective whose peers have not arrived by then (NCCL's watchdog
does the same). gloo's own error says only "Timed out waiting 600000ms for recv
operation"; it names neither the rank that is late nor the op. So:

- each rank writes the number of the step it begins into the default group's
  store (`StepWatch.begin`: one small ``set`` per step, never per op; a TCP
  round trip to rank 0's store, tens of microseconds);
- when the bound graph raises, the node that raised is found from the traceback
  (`emit.failing_node`, which costs nothing while the step runs), and the
  schedule op that covers it (`Schedule.op_of_node`);
- the rank reads every rank's record and raises `CollectiveTimeoutError` (or,
  when a peer went away instead, `CollectiveError`) naming the op index, its
  unit, and the ranks that had not begun this step (late: stuck in data loading,
  or slow) or had begun a later one (they skipped a collective: an exception
  caught and ignored, a step taken on one rank only).

The local launcher reads ``late_ranks`` from the error and reports those ranks,
still running, as `FailureKind.LATE` with their Python stacks (what they were
doing instead); under torchrun each rank's own error names them.

Example::

    watch = StepWatch(ctx, schedule)        # after every rank has joined
    watch.begin()                           # at the start of each step
    try:
        graph(*inputs)
    except Exception as exc:
        error = watch.explain(exc, graph)
        if error is None:
            raise
        raise error from exc
"""

from __future__ import annotations

import torch.distributed as dist
import torch.fx as fx

from ..compiler import COLLECTIVE_KINDS, OpKind, Schedule, ScheduleOp, failing_node, is_bound_collective
from shardlang.errors import ShardlangRuntimeError
from shardlang.runtime.dist import DistContext

_KEY = "shardlang/step_begun/{rank}"
_TIMEOUT_WORDS = ("timed out", "timeout", "watchdog")


class CollectiveError(ShardlangRuntimeError):
    """A collective of the step failed on this rank; names the step, the schedule op and the ranks out of step.

    ``late_ranks`` had not begun ``step`` when this rank read the store;
    ``ahead_ranks`` had begun a later step. ``op_index`` is the schedule op the
    rank was at (None when the failing node is not known).
    """

    def __init__(self, message: str, *, rank: int, step: int, op_index: int | None,
                 late_ranks: tuple[int, ...], ahead_ranks: tuple[int, ...]):
        super().__init__(message)
        self.rank = rank
        self.step = step
        self.op_index = op_index
        self.late_ranks = late_ranks
        self.ahead_ranks = ahead_ranks


class CollectiveTimeoutError(CollectiveError):
    """A collective waited longer than the process group's timeout for its peers (Note [collective timeout])."""


class StepWatch:
    """One rank's record of the step it is in, and the explanation of a failed collective.

    Build it on every rank after the process group is up; with no process group
    (a world of one) it records nothing and explains nothing.

    Example::

        watch = StepWatch(ctx, step.schedule)
        watch.begin(); loss = graph(*inputs)    # step 1
    """

    def __init__(self, ctx: DistContext, schedule: Schedule, timeout_s: float | None = None):
        self._ctx = ctx
        self._schedule = schedule
        self._timeout_s = ctx.timeout_s if timeout_s is None else timeout_s
        self._store = dist.distributed_c10d._get_default_store() if ctx.has_process_group else None
        self.step = 0  # the step this rank began last (1-based); 0 before the first
        self._record()

    def begin(self) -> None:
        """This rank begins its next step: count it and tell the store."""
        self.step += 1
        self._record()

    def explain(self, exc: BaseException, graph: fx.GraphModule) -> CollectiveError | None:
        """The error to raise for ``exc`` from running ``graph``; None when it is not a collective's failure."""
        if self._store is None:
            return None
        node = failing_node(graph, exc)
        timed_out = any(word in str(exc).lower() for word in _TIMEOUT_WORDS)
        if node is None or not is_bound_collective(node):
            if not (timed_out and isinstance(exc, RuntimeError)):
                return None
        op = self._schedule.op_of_node(node.name) if node is not None else None
        begun = self._read_all()
        late = tuple(r for r, s in begun.items() if s is not None and s < self.step)
        ahead = tuple(r for r, s in begun.items() if s is not None and s > self.step)
        kind = CollectiveTimeoutError if timed_out else CollectiveError
        message = self._message(exc, op, begun, late, ahead, timed_out)
        return kind(message, rank=self._ctx.rank, step=self.step, op_index=None if op is None else op.index,
                    late_ranks=late, ahead_ranks=ahead)

    def _record(self) -> None:
        if self._store is not None:
            self._store.set(_KEY.format(rank=self._ctx.rank), str(self.step))

    def _read_all(self) -> dict[int, int | None]:
        """Every other rank's last begun step; None for a rank whose record cannot be read."""
        begun: dict[int, int | None] = {}
        for rank in range(self._ctx.world_size):
            if rank == self._ctx.rank:
                continue
            key = _KEY.format(rank=rank)
            try:
                begun[rank] = int(self._store.get(key)) if self._store.check([key]) else None
            except Exception:  # rank 0's store went away with rank 0: say what is known
                begun[rank] = None
        return begun

    def _message(self, exc: BaseException, op: ScheduleOp | None, begun: dict[int, int | None],
                 late: tuple[int, ...], ahead: tuple[int, ...], timed_out: bool) -> str:
        rank, step = self._ctx.rank, self.step
        where = f"step {step}, {describe_op(op, self._schedule)}"
        if timed_out:
            head = f"rank {rank} waited {self._timeout_s:g} s for its peers at {where}, and timed out"
        else:
            head = f"rank {rank}'s collective failed at {where}: {type(exc).__name__}: {_first_line(exc)}"
        parts = [head]
        if late:
            parts.append(f"late: {_ranks(late)} (last began step {_steps(begun, late)}; "
                         "stuck before its collectives: data loading, or slower than the others?)")
        if ahead:
            parts.append(f"ahead: {_ranks(ahead)} (began step {_steps(begun, ahead)}: did it skip a collective, "
                         "for example by catching an exception of its step?)")
        unknown = tuple(r for r, s in begun.items() if s is None)
        if unknown:
            parts.append(f"{_ranks(unknown)}: no record (gone?)")
        if not (late or ahead or unknown):
            parts.append(f"every rank began step {step}: one is stuck inside it, or exited")
        hint = ("raise the limit with `shardlang run --timeout SECONDS` (or sl.compile(timeout=...)) if that rank "
                "is only slow" if timed_out else "look at the other ranks' errors first")
        return "; ".join(parts) + f". {hint[0].upper()}{hint[1:]}"


def describe_op(op: ScheduleOp | None, schedule: Schedule) -> str:
    """``op`` as an error names it: its index, kind, unit and phase; a wait names the collective it completes.

    Example: ``"schedule op 5 (wait for op 2: all_gather of unit '0', forward)"``.
    """
    if op is None:
        return "an op not in the schedule"
    target = op
    if op.kind is OpKind.WAIT and op.handle is not None:
        target = next((o for o in schedule.ops if o.kind in COLLECTIVE_KINDS and o.handle == op.handle), op)
    what = f"{target.kind.value}" + (f" of unit {target.unit!r}" if target.unit else "") + \
        (f" ({target.detail})" if target.detail else "") + f", {target.phase.value}"
    if target is not op:
        return f"schedule op {op.index} (wait for op {target.index}: {what})"
    return f"schedule op {op.index} ({what})"


def _ranks(ranks: tuple[int, ...]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _steps(begun: dict[int, int | None], ranks: tuple[int, ...]) -> str:
    return ", ".join(str(begun[r]) for r in ranks)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""
