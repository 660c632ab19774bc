"""Export a predicted timeline (and the memory plan) as a Chrome / Perfetto trace.

The trace is the JSON "trace event" format that chrome://tracing and
https://ui.perfetto.dev open: one process ("shardlang plan, rank 0 of N"), one
thread per lane, in this order:

    compute          compute and optimizer segments, and the waits that block (exposed communication)
    all_gather       each all-gather, from when the link starts it to when it ends
    reduce_scatter   each reduce-scatter
    all_reduce       each all-reduce (replicated gradients, BatchNorm statistics)

plus instant events on the compute lane where a gathered unit is freed, and two
counter tracks: ``memory`` (bytes live by `compiler.analysis.memory.Category`, stacked)
and ``memory total``. Each op's span is named ``"<op index> <kind> <unit>"``,
the name `shardlang.cli.profile` gives the same op in a measured trace, so the
planned and the measured timelines can be read side by side.

Example::

    write_chrome_trace("plan.json", compiled.schedule, compiled.timeline, compiled.memory)
"""

from __future__ import annotations

import json
import os

from .cost import Timeline, op_name
from .memory import Category, MemoryPlan
from ..schedule.schedule import COLLECTIVE_KINDS, OpKind, Schedule

LANES = ("compute",) + tuple(k.value for k in COLLECTIVE_KINDS)
_PID = 0


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def chrome_trace(schedule: Schedule, timeline: Timeline, memory: MemoryPlan | None = None) -> dict:
    """The trace-event JSON object (a dict) for ``timeline``, with ``memory``'s counters when given."""
    events: list[dict] = [
        {"name": "process_name", "ph": "M", "pid": _PID,
         "args": {"name": f"shardlang plan, rank 0 of {schedule.world_size} (predicted)"}},
    ]
    tid = {lane: i + 1 for i, lane in enumerate(LANES)}
    for lane, t in tid.items():
        events.append({"name": "thread_name", "ph": "M", "pid": _PID, "tid": t, "args": {"name": lane}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": _PID, "tid": t, "args": {"sort_index": t}})
    for span in timeline.spans:
        args = {"op": span.op, "kind": span.kind}
        if span.bytes:
            args["bytes"] = span.bytes
        events.append({"name": span.name, "cat": span.kind, "ph": "X", "pid": _PID, "tid": tid[span.lane],
                       "ts": _us(span.start_s), "dur": _us(span.duration_s), "args": args})
    for op in schedule.ops:
        if op.kind is OpKind.FREE:
            events.append({"name": op_name(op), "cat": "free", "ph": "i", "s": "t", "pid": _PID,
                           "tid": tid["compute"], "ts": _us(timeline.op_start_s[op.index]),
                           "args": {"op": op.index, "bytes": op.bytes}})
    if memory is not None:
        events += _memory_counters(timeline, memory)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "source": "shardlang plan (predicted)",
            "world_size": schedule.world_size,
            "step_time_s": timeline.step_time_s,
            "exposed_comm_s": timeline.exposed_comm_s,
            "peak_bytes": memory.peak if memory is not None else None,
            "lanes": list(LANES),
        },
    }


def _memory_counters(timeline: Timeline, memory: MemoryPlan) -> list[dict]:
    """At each op's start, its peak and that peak's breakdown; at its end, what stays live."""
    events = []
    order = [c.value for c in Category]
    for op in memory.ops:
        start, end = _us(timeline.op_start_s[op.index]), _us(timeline.op_end_s[op.index])
        if op.breakdown:
            events.append({"name": "memory", "ph": "C", "pid": _PID, "ts": start,
                           "args": {k: op.breakdown.get(k, 0) for k in order}})
        events.append({"name": "memory total", "ph": "C", "pid": _PID, "ts": start, "args": {"bytes": op.peak}})
        if end > start:
            events.append({"name": "memory total", "ph": "C", "pid": _PID, "ts": end,
                           "args": {"bytes": op.live_after}})
    return events


def write_chrome_trace(path: str | os.PathLike, schedule: Schedule, timeline: Timeline,
                       memory: MemoryPlan | None = None) -> None:
    """Write `chrome_trace` to ``path`` (open it in chrome://tracing or ui.perfetto.dev)."""
    with open(path, "w") as f:
        json.dump(chrome_trace(schedule, timeline, memory), f)
