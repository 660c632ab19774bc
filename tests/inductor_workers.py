"""Worker functions for tests/test_inductor.py: train under inductor and read back the order it runs the step in.

`overlap` says, for every collective in the order it is issued, how many
matmuls run between its issue and its wait: in the bound graph the schedule
emitted, and in the Python wrapper inductor generated for it. Inductor must not
shrink any of these (Note [inductor keeps the schedule] in compiler/lower/backend.py).
"""

from __future__ import annotations

import re

import torch

import parity
import shardlang as sl
from models import CASES

_ISSUE = re.compile(r"^(\w+) = torch\.ops\._c10d_functional\.(\w+)\.")
_WAIT = re.compile(r"torch\.ops\._c10d_functional\.wait_tensor\.default\((\w+)\)")


def train_with_order(ctx, case_name: str, dtype: str, steps: int, units: tuple[str, ...]):
    """AdamW under ``Options(backend="inductor")``: (losses, params, overlap in the graph, overlap compiled)."""
    from torch._inductor.codecache import PyCodeCache

    case, dt = CASES[case_name], parity.DTYPES[dtype]
    spec = sl.Spec(mesh=sl.Mesh(fsdp=ctx.world_size), units=list(units), options=sl.Options(backend="inductor"))
    loaded = len(PyCodeCache.modules)
    losses, step = parity.run_steps(ctx, case, dt, spec, "adamw", steps)
    sources = [open(m.__file__).read() for m in PyCodeCache.modules[loaded:]]
    source = max(sources, key=lambda s: s.count("_c10d_functional"), default="")
    return losses, step.full_parameters(), overlap(graph_events(step._graph)), overlap(source_events(source))


def graph_events(gm: torch.fx.GraphModule) -> list[tuple[str, str]]:
    """``("issue", name)``, ``("wait", name of the issue)`` and ``("mm", name)`` in the bound graph's order."""
    events = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        namespace = getattr(node.target, "namespace", None)
        if namespace == "_c10d_functional":
            is_wait = node.target is torch.ops._c10d_functional.wait_tensor.default
            events.append(("wait", node.args[0].name) if is_wait else ("issue", node.name))
        elif namespace == "aten" and node.target.__name__.split(".")[0] in ("mm", "addmm", "bmm"):
            events.append(("mm", node.name))
    return events


def source_events(source: str) -> list[tuple[str, str]]:
    """The same events in inductor's generated wrapper: collectives, their waits, extern matmuls."""
    events = []
    for line in source.split("def call(self, args)")[-1].splitlines():
        line = line.strip()
        if (issue := _ISSUE.match(line)) and issue.group(2) != "wait_tensor":
            events.append(("issue", issue.group(1)))
        elif wait := _WAIT.search(line):
            events.append(("wait", wait.group(1)))
        elif line.startswith("extern_kernels.") and "mm(" in line:
            events.append(("mm", line))
    return events


def overlap(events: list[tuple[str, str]]) -> list[int]:
    """For each collective, in issue order: the matmuls between its issue and its wait."""
    open_, counts = {}, []
    for kind, name in events:
        if kind == "issue":
            open_[name] = len(counts)
            counts.append(0)
        elif kind == "wait":
            open_.pop(name, None)
        else:
            for k in open_.values():
                counts[k] += 1
    return counts
