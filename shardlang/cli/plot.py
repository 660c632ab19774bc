"""Pictures of a plan: memory over the schedule, and the lanes of a Chrome trace.

matplotlib is an optional extra (``pip install 'shardlang[plot]'``); it is
imported only when a picture is drawn, and a missing matplotlib is a
`ShardlangError` that says how to install it.

Example::

    from shardlang.cli.plot import plot_memory, plot_trace
    plot_memory(plan, "memory.png")            # plan: compiler.analysis.plan_report.Plan
    plot_trace("plan_trace.json", "trace.png")  # a trace from `shardlang plan --chrome-trace`
"""

from __future__ import annotations

import json
import os
import re

from ..compiler import Category, OpKind
from ..errors import ShardlangError

INSTALL_HINT = "pip install 'shardlang[plot]'"
_PHASE_SHADE = {"forward": "#f2f7ff", "backward": "#fff6ee", "optimizer": "#f3fbf3"}
_LANE_COLOURS = {"compute": "#4c72b0", "optimizer": "#64b5cd", "wait": "#c44e52", "all_gather": "#55a868",
                 "reduce_scatter": "#dd8452", "all_reduce": "#8172b3"}


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ShardlangError(f"drawing a plot needs matplotlib, which is not installed; run: {INSTALL_HINT}") from exc
    return plt


def _mib(nbytes: float) -> float:
    return nbytes / 2**20


def plot_memory(plan, path: str | os.PathLike, title: str | None = None) -> None:
    """Memory per rank over the schedule: the peak of each op stacked by category, gathers and frees marked.

    The x axis is the op index of the schedule table. Each op's bar is its peak
    (the busiest moment inside it) split into `Category`; the line is what stays
    live after it. Green triangles mark all-gather issues, red ones frees; the
    background shows the phase. The step's peak is annotated.
    """
    plt = _pyplot()
    schedule, memory = plan.schedule, plan.memory
    xs = [op.index for op in memory.ops]
    fig, ax = plt.subplots(figsize=(12, 5.5), dpi=110)
    top = max(_mib(memory.peak), 1e-9)
    _shade_phases(ax, schedule, top * 1.28)
    bottom = [0.0] * len(xs)
    cmap = plt.get_cmap("tab10")
    for i, category in enumerate(Category):
        values = [_mib(op.breakdown.get(category.value, 0)) for op in memory.ops]
        if not any(values):
            continue
        ax.bar(xs, values, bottom=bottom, width=0.85, color=cmap(i), label=category.value.replace("_", " "),
               linewidth=0)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.step(xs, [_mib(op.live_after) for op in memory.ops], where="mid", color="black", linewidth=1.2,
            label="live after op")
    gathers = [op.index for op in schedule.ops if op.kind is OpKind.ALL_GATHER]
    frees = [op.index for op in schedule.ops if op.kind is OpKind.FREE]
    ax.scatter(gathers, [top * 1.06] * len(gathers), marker="v", color="#2ca02c", s=40, zorder=5,
               label="all-gather issued")
    ax.scatter(frees, [top * 1.06] * len(frees), marker="^", color="#d62728", s=40, zorder=5, label="unit freed")
    if memory.peak_op is not None:
        ax.annotate(f"peak {_mib(memory.peak):.2f} MiB\n(op {memory.peak_op}, {memory.peak_node})",
                    xy=(memory.peak_op, _mib(memory.peak)), xytext=(memory.peak_op + 1.5, top * 1.14),
                    arrowprops={"arrowstyle": "->", "color": "black"}, fontsize=9)
    ax.set_ylim(0, top * 1.3)
    ax.set_xlim(-0.8, len(xs) - 0.2)
    ax.set_xlabel("schedule op (index in the plan table)")
    ax.set_ylabel("MiB per rank")
    ax.set_title(title or f"memory per rank over one step, world {schedule.world_size}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _shade_phases(ax, schedule, label_y: float) -> None:
    start = 0
    ops = schedule.ops
    for i in range(1, len(ops) + 1):
        if i == len(ops) or ops[i].phase != ops[start].phase:
            ax.axvspan(start - 0.5, i - 0.5, color=_PHASE_SHADE.get(ops[start].phase.value, "white"), zorder=0)
            if i - start > 2:
                ax.text((start + i - 1) / 2, label_y, ops[start].phase.value, ha="center", va="top", fontsize=8,
                        color="grey")
            start = i


def plot_trace(trace, path: str | os.PathLike, title: str | None = None, max_lanes: int = 12,
               only: str | None = None) -> None:
    r"""Draw a Chrome trace's lanes (its "X" events per thread) and its ``memory total`` counter.

    ``trace`` is a trace-event dict or the path of a JSON file: the predicted
    trace of ``shardlang plan --chrome-trace`` or a measured one of
    ``shardlang run --trace``. Spans are coloured by kind: their ``cat``, or
    the kind in a schedule op's name (``"7 compute"``), or gloo's range name
    (``gloo:all_gather``). ``only``, a regular expression, keeps only the
    spans whose names match it: ``r"^(\d+ |gloo:)"`` keeps a measured trace's
    schedule ops and gloo's transfers and drops the aten ops inside them.
    """
    plt = _pyplot()
    if not isinstance(trace, dict):
        with open(trace) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {(e.get("pid"), e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    keep = re.compile(only) if only else None
    spans: dict[tuple, list] = {}
    for e in events:
        if e.get("ph") == "X" and "dur" in e and (keep is None or keep.search(e.get("name", ""))):
            spans.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    keys = set(spans) | (set(names) if len(names) <= max_lanes else set())
    lanes = sorted(keys, key=lambda k: (str(k[0]), _lane_order(names.get(k, str(k[1]))), str(k[1])))[:max_lanes]
    for key in lanes:
        spans.setdefault(key, [])
    counter = sorted(((e["ts"], e["args"].get("bytes", 0)) for e in events
                      if e.get("ph") == "C" and e.get("name") == "memory total"), key=lambda p: p[0])
    t0 = min((e["ts"] for k in lanes for e in spans[k]), default=0.0)
    rows = 2 if counter else 1
    fig, axes = plt.subplots(rows, 1, figsize=(12, 1.2 + 0.55 * len(lanes) + (2.2 if counter else 0)), dpi=110,
                             sharex=True, gridspec_kw={"height_ratios": [max(len(lanes), 1), 3][:rows]})
    ax = axes[0] if rows > 1 else axes
    char_ms = _span_ms(spans, lanes, t0) / 170  # about how much time one character of a label covers
    for row, key in enumerate(lanes):
        for e in spans[key]:
            colour = _LANE_COLOURS.get(_kind(e), "#999999")
            ax.broken_barh([((e["ts"] - t0) / 1e3, max(e["dur"], 0.5) / 1e3)], (row - 0.4, 0.8), color=colour,
                           edgecolor="white", linewidth=0.3)
            if e["dur"] / 1e3 > char_ms * (len(e["name"]) + 2):
                ax.text((e["ts"] - t0 + e["dur"] / 2) / 1e3, row, e["name"], ha="center", va="center",
                        fontsize=6.5, color="white", clip_on=True)
    ax.set_yticks(range(len(lanes)), [names.get(k, f"thread {k[1]}") for k in lanes])
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    other = trace.get("otherData", {}) if isinstance(trace, dict) else {}
    ax.set_title(title or other.get("source", "trace"))
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _LANE_COLOURS.values()]
    ax.legend(handles, [k.replace("_", "-") + (" (exposed)" if k == "wait" else "") for k in _LANE_COLOURS],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    if counter:
        mem_ax = axes[1]
        xs = [(ts - t0) / 1e3 for ts, _ in counter]
        mem_ax.step(xs, [_mib(v) for _, v in counter], where="post", color="black", linewidth=1)
        mem_ax.fill_between(xs, [_mib(v) for _, v in counter], step="post", color="#bbbbbb")
        mem_ax.set_ylabel("memory\nMiB")
        mem_ax.set_ylim(bottom=0)
        mem_ax.set_xlabel("time (ms)")
    else:
        ax.set_xlabel("time (ms)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _kind(event: dict) -> str:
    """What a span is: its ``cat`` when that is a kind, else read off its name."""
    if event.get("cat") in _LANE_COLOURS:
        return event["cat"]
    name = event.get("name", "")
    if name.startswith("gloo:"):
        return {"all_gather": "all_gather", "allgather": "all_gather", "reduce_scatter": "reduce_scatter"}.get(
            name[5:], "all_reduce")
    words = name.split()
    if len(words) > 1 and words[0].isdigit():
        return words[1] if words[1] in _LANE_COLOURS else "compute"
    return ""


def _lane_order(name: str) -> int:
    order = ["compute", "all_gather", "reduce_scatter", "all_reduce"]
    return order.index(name) if name in order else len(order)


def _span_ms(spans, lanes, t0) -> float:
    end = max((e["ts"] + e["dur"] for k in lanes for e in spans[k]), default=t0 + 1)
    return max((end - t0) / 1e3, 1e-9)
