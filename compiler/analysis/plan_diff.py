"""Compare two plans: what moved, what was added or removed, the bytes, the peak, the predicted time.

A plan is a `compiler.analysis.plan_report.Plan` or its JSON form (``shardlang plan
--json``, `Plan.to_dict`), so plans saved yesterday compare with plans made now.

Ops are matched by identity, not by index: a collective, wait, free or
optimizer update is ``(kind, flat parameter, n)``, its n-th occurrence of that
kind for that flat parameter (a unit's forward gather and its re-gather for
backward are n=0 and n=1). The two sequences of identities are aligned
(longest common subsequence, `difflib`); an op in both but outside the
alignment *moved*, an op in one only was *added* or *removed*. Compute segments
are not matched (they split differently whenever a collective moves); their
effect shows in the memory and the time.

Example::

    d = diff_plans(make_plan(step_a), make_plan(step_b), labels=("prefetch=1", "prefetch=2"))
    print(d.text())
    d.peak_delta, [m.key for m in d.moved]
"""

from __future__ import annotations

import difflib
import json
import os

import attrs

from .memory import Category
from ..schedule.schedule_format import human_bytes

_KINDS = ("all_gather", "reduce_scatter", "all_reduce")
_MATCHED_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "wait", "free", "optimizer")


@attrs.frozen
class OpChange:
    """One op that differs between the plans: its identity, its index in each (None if absent) and bytes."""

    key: str
    index_a: int | None
    index_b: int | None
    bytes_a: int = 0
    bytes_b: int = 0

    def to_dict(self) -> dict:
        return attrs.asdict(self)


@attrs.frozen
class PlanDiff:
    """The differences between plan A and plan B (all deltas are B minus A)."""

    labels: tuple[str, str]
    world_sizes: tuple[int, int]
    op_counts: tuple[int, int]
    moved: tuple[OpChange, ...]
    added: tuple[OpChange, ...]
    removed: tuple[OpChange, ...]
    resized: tuple[OpChange, ...]
    collectives: dict[str, tuple[int, int]]
    bytes_per_rank: dict[str, tuple[int, int]]
    peak: tuple[int, int]
    peak_where: tuple[str, str]
    breakdown: dict[str, tuple[int, int]]
    step_time_s: tuple[float, float]
    exposed_comm_s: tuple[float, float]

    @property
    def peak_delta(self) -> int:
        return self.peak[1] - self.peak[0]

    @property
    def identical(self) -> bool:
        """Whether the plans have the same ops in the same order with the same bytes, and the same peak."""
        return not (self.moved or self.added or self.removed or self.resized) and self.peak[0] == self.peak[1]

    def to_dict(self) -> dict:
        d = attrs.asdict(self, recurse=False)
        for name in ("moved", "added", "removed", "resized"):
            d[name] = [c.to_dict() for c in d[name]]
        d["peak_delta"] = self.peak_delta
        d["identical"] = self.identical
        return d

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    def text(self, max_listed: int = 20) -> str:
        """A readable comparison: totals side by side, then the ops that moved, appeared or went away."""
        a, b = self.labels
        width = 14
        lines = [f"A: {a}", f"B: {b}", "", f"{'':<30}{'A':>{width}}  {'B':>{width}}  {'B - A':>12}"]

        def row(name, va, vb, fmt):
            lines.append(f"{name:<30}{fmt(va):>{width}}  {fmt(vb):>{width}}  {_signed(vb - va, fmt):>12}")

        row("world size", *self.world_sizes, str)
        row("ops", *self.op_counts, str)
        for kind, (ca, cb) in self.collectives.items():
            row(f"{kind} count", ca, cb, str)
        for kind, (ba, bb) in self.bytes_per_rank.items():
            row(f"{kind} bytes/rank", ba, bb, human_bytes)
        row("memory peak", *self.peak, human_bytes)
        for category, (ba, bb) in self.breakdown.items():
            if ba or bb:
                row(f"  at peak: {category}", ba, bb, human_bytes)
        row("predicted step (ms)", self.step_time_s[0] * 1e3, self.step_time_s[1] * 1e3, lambda v: f"{v:.3f}")
        row("exposed comm (ms)", self.exposed_comm_s[0] * 1e3, self.exposed_comm_s[1] * 1e3, lambda v: f"{v:.3f}")
        lines.append(f"peak is during: A {self.peak_where[0]}; B {self.peak_where[1]}")
        for title, changes in (("moved", self.moved), ("added in B", self.added), ("removed from A", self.removed),
                               ("bytes changed", self.resized)):
            if not changes:
                continue
            lines.append(f"\n{title} ({len(changes)}):")
            for c in changes[:max_listed]:
                where = f"op {_idx(c.index_a)} -> op {_idx(c.index_b)}"
                size = f"  {human_bytes(c.bytes_a)} -> {human_bytes(c.bytes_b)}" if c.bytes_a != c.bytes_b else ""
                lines.append(f"  {c.key:<40}{where}{size}")
            if len(changes) > max_listed:
                lines.append(f"  ... {len(changes) - max_listed} more")
        if self.identical:
            lines.append("\nthe plans have the same ops, in the same order, with the same bytes and peak")
        return "\n".join(lines)


def _idx(i: int | None) -> str:
    return "-" if i is None else str(i)


def _signed(value, fmt) -> str:
    if value == 0:
        return "0"
    text = fmt(abs(value))
    return ("+" if value > 0 else "-") + text


def load_plan(source) -> dict:
    """A plan as its JSON dict: from a `Plan`, a dict, or the path of a ``shardlang plan --json`` file."""
    if hasattr(source, "to_dict") and hasattr(source, "memory"):
        return source.to_dict()
    if isinstance(source, dict):
        return source
    if isinstance(source, (str, os.PathLike)):
        with open(source) as f:
            return json.load(f)
    raise TypeError(f"cannot compare a {type(source).__name__}; give a Plan, its to_dict(), or a plan JSON path")


def _keyed(ops: list[dict]) -> list[tuple[str, dict]]:
    seen: dict[tuple, int] = {}
    out = []
    for op in ops:
        if op["kind"] not in _MATCHED_KINDS:
            continue
        base = (op["kind"], op.get("flat"))
        n = seen.get(base, 0)
        seen[base] = n + 1
        flat = op.get("flat") or ("batch statistics" if op["kind"] in ("all_reduce", "wait") else "")
        out.append((f"{op['kind']} {flat}#{n}".replace(" #", "#"), op))
    return out


def diff_plans(a, b, labels: tuple[str, str] = ("A", "B")) -> PlanDiff:
    """Compare plans ``a`` and ``b`` (each a `Plan`, its dict, or a JSON path)."""
    pa, pb = load_plan(a), load_plan(b)
    ka, kb = _keyed(pa["ops"]), _keyed(pb["ops"])
    names_a, names_b = [k for k, _ in ka], [k for k, _ in kb]
    matcher = difflib.SequenceMatcher(a=names_a, b=names_b, autojunk=False)
    aligned_a, aligned_b = set(), set()
    for block in matcher.get_matching_blocks():
        aligned_a.update(range(block.a, block.a + block.size))
        aligned_b.update(range(block.b, block.b + block.size))
    where_a = {k: (i, op) for i, (k, op) in enumerate(ka)}
    where_b = {k: (i, op) for i, (k, op) in enumerate(kb)}
    moved, added, removed, resized = [], [], [], []
    for key, (i, op) in where_a.items():
        if key not in where_b:
            removed.append(OpChange(key, op["index"], None, op.get("bytes", 0), 0))
            continue
        j, other = where_b[key]
        change = OpChange(key, op["index"], other["index"], op.get("bytes", 0), other.get("bytes", 0))
        if i not in aligned_a or j not in aligned_b:
            moved.append(change)
        if change.bytes_a != change.bytes_b:
            resized.append(change)
    for key, (_, op) in where_b.items():
        if key not in where_a:
            added.append(OpChange(key, None, op["index"], 0, op.get("bytes", 0)))
    ma, mb = pa.get("memory", {}), pb.get("memory", {})
    ta, tb = pa.get("timeline", {}), pb.get("timeline", {})
    known = [c.value for c in Category]
    categories = sorted(set(ma.get("breakdown", {})) | set(mb.get("breakdown", {})),
                        key=lambda c: (known.index(c) if c in known else len(known), c))
    return PlanDiff(
        labels=labels,
        world_sizes=(pa["world_size"], pb["world_size"]),
        op_counts=(len(pa["ops"]), len(pb["ops"])),
        moved=tuple(moved), added=tuple(added), removed=tuple(removed), resized=tuple(resized),
        collectives={k: (pa["collectives"].get(k, 0), pb["collectives"].get(k, 0)) for k in _KINDS},
        bytes_per_rank={k: (pa["bytes_per_rank"].get(k, 0), pb["bytes_per_rank"].get(k, 0)) for k in _KINDS},
        peak=(ma.get("peak", 0), mb.get("peak", 0)),
        peak_where=(_peak_where(ma), _peak_where(mb)),
        breakdown={c: (ma.get("breakdown", {}).get(c, 0), mb.get("breakdown", {}).get(c, 0)) for c in categories},
        step_time_s=(ta.get("step_time_s", 0.0), tb.get("step_time_s", 0.0)),
        exposed_comm_s=(ta.get("exposed_comm_s", 0.0), tb.get("exposed_comm_s", 0.0)),
    )


def _peak_where(memory: dict) -> str:
    if not memory:
        return "(no memory plan)"
    return f"op {memory.get('peak_op')} ({memory.get('peak_node')})"
