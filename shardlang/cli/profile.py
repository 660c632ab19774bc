"""A measured timeline of real steps: a torch.profiler Chrome trace whose ranges carry the schedule's op names.

`instrument` copies a step's bound graph and wraps the nodes of every schedule
op in a ``torch.profiler.record_function`` range named ``"<op index> <kind>
<unit>"``, the name the predicted timeline gives the same op
(`compiler.analysis.cost.op_name`). In the trace, compute segments and optimizer
updates show as ranges on the main thread with the aten ops inside them; a
collective's range is its issue, a wait's range is the time the main thread
blocked on it, and gloo's own ``gloo:*`` ranges on its threads are the
transfers. Open the trace next to the plan's (``shardlang plan --chrome-trace``)
to compare planned and measured.

The instrumented graph runs the same ops in the same order; only the profiler
ranges are added, so a profiled step trains like any other.

Example::

    with trace_steps(step, "run_trace.json") as run:
        for batch in batches:
            run(batch)
"""

from __future__ import annotations

import contextlib
import copy
import os
from pathlib import Path

import torch
import torch.fx as fx

from ..compiler import Schedule, op_name


def _enter(name: str):
    """Graph node target: open a profiler range (returns its handle)."""
    return torch.autograd.profiler.record_function(name).__enter__()


def _exit(handle) -> None:
    """Graph node target: close the range ``handle``."""
    handle.__exit__(None, None, None)


def instrument(graph: fx.GraphModule, schedule: Schedule) -> fx.GraphModule:
    """A copy of ``graph`` with each op of ``schedule`` inside a profiler range named by `op_name`.

    ``graph`` is a step's bound graph (`Step.graph`) or the compiled graph the
    schedule was read from; node names match between the two.
    """
    gm = copy.deepcopy(graph)
    nodes = {n.name: n for n in gm.graph.nodes}
    for op in schedule.ops:
        covered = [nodes[name] for name in op.node_names if name in nodes]
        if not covered:
            continue
        with gm.graph.inserting_before(covered[0]):
            handle = gm.graph.call_function(_enter, (op_name(op),))
        with gm.graph.inserting_after(covered[-1]):
            gm.graph.call_function(_exit, (handle,))
    gm.graph.lint()
    gm.recompile()
    return gm


def rank_path(path: str | os.PathLike, rank: int) -> Path:
    """Where rank ``rank`` writes its trace: ``path`` itself for rank 0, ``stem.rank<r>.suffix`` for the others."""
    path = Path(path)
    return path if rank == 0 else path.with_name(f"{path.stem}.rank{rank}{path.suffix or '.json'}")


@contextlib.contextmanager
def trace_steps(step, path: str | os.PathLike):
    """Profile the steps run through the yielded callable; write the Chrome trace to ``path`` on exit.

    The callable is ``step`` itself (same batch in, loss out, same learning-rate
    schedule and random state) running the instrumented graph; each call is
    also a ``"step <k>"`` range. The step gets its own graph back on exit.
    """
    plain = step._graph
    step._graph = instrument(plain, step.schedule)
    count = [0]

    def run(batch) -> torch.Tensor:
        with torch.autograd.profiler.record_function(f"step {count[0]}"):
            count[0] += 1
            return step(batch)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if step.dist.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    try:
        with torch.profiler.profile(activities=activities) as prof:
            yield run
    finally:
        step._graph = plain
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
