"""Text rendering of a `Schedule`: the op table and a one-screen summary."""

from __future__ import annotations

from .schedule import COLLECTIVE_KINDS, OpKind, Schedule


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def format_table(schedule: Schedule, max_rows: int | None = None) -> str:
    """One row per op: index, phase, kind, unit, payload bytes and what it is."""
    rows = [("#", "phase", "op", "unit", "bytes", "detail")]
    for op in schedule.ops:
        rows.append((str(op.index), _phase(op), op.kind.value, _unit(op.unit), human_bytes(op.bytes) if op.bytes else "",
                     _detail(op)))
    if max_rows is not None and len(rows) > max_rows + 1:
        keep = max_rows // 2
        rows = rows[: keep + 1] + [("...", "", f"({len(rows) - 1 - 2 * keep} more ops)", "", "", "")] + rows[-keep:]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_summary(schedule: Schedule) -> str:
    """A one-screen summary: mesh, flat parameters, collectives and bytes per rank per step."""
    s = schedule.summary
    mesh = " x ".join(f"{name}={size}" for name, size in schedule.mesh)
    world = schedule.world_size
    if schedule.tensor_axis is not None:  # the data axes, and the tensor axis the step runs over too
        name, size = schedule.tensor_axis
        mesh, world = f"{mesh} x {name}={size}, {name} a tensor axis", world * size
    sharded = [f for f in schedule.flats if f.sharded]
    title = "evaluation schedule (forward only)" if schedule.is_evaluation else "schedule"
    lines = [
        f"{title}: world {world} (mesh {mesh}), {len(schedule.ops)} ops, "
        f"{len(schedule.flats)} flat parameters ({len(sharded)} sharded)",
        f"options: {', '.join(f'{k}={v}' for k, v in schedule.options.items())}",
        f"{'collective':<16}{'count':>7}{'payload/rank':>16}{'on the wire':>16}",
    ]
    wire = s.wire_bytes_per_rank
    for kind in COLLECTIVE_KINDS:
        k = kind.value
        lines.append(f"{k:<16}{s.collectives[k]:>7}{human_bytes(s.bytes_per_rank[k]):>16}{human_bytes(wire[k]):>16}")
    params = sum(f.padded_bytes for f in sharded)
    local = sum(f.held_numel * f.element_size for f in schedule.flats)
    lines.append(f"sharded parameters M = {human_bytes(params)} (padded); held per rank: {human_bytes(local)}")
    if schedule.logits_never_gathered:  # Note [loss parallelism]
        name, size = schedule.tensor_axis
        lines.append(f"loss parallel: the logits stay split by vocabulary over {name}; a rank never gathers nor "
                     f"holds {human_bytes(schedule.logits_never_gathered)} of them (b*s*V*(1 - 1/{size}))")
    lines += _strategy_lines(schedule)
    return "\n".join(lines)


def _strategy_lines(schedule: Schedule) -> list[str]:
    """Per strategy: flat parameters, parameter bytes held per rank, payload per rank by collective."""
    rows = schedule.by_strategy()
    lines = [f"{'strategy':<10}{'flats':>6}{'held/rank':>13}{'all_gather':>13}{'reduce_scatter':>16}{'all_reduce':>13}"]
    for strategy, row in rows.items():
        lines.append(f"{strategy.value:<10}{row['flats']:>6}{human_bytes(row['held_bytes']):>13}"
                     f"{human_bytes(row['all_gather']):>13}{human_bytes(row['reduce_scatter']):>16}"
                     f"{human_bytes(row['all_reduce']):>13}")
    return lines


def _phase(op) -> str:
    """The op's phase, and its micro-batch when there are several: ``forward[1]``."""
    return op.phase.value if op.microbatch is None else f"{op.phase.value}[{op.microbatch}]"


def _unit(unit: str | None) -> str:
    if unit is None:
        return ""
    return unit or "<root>"


def _detail(op) -> str:
    if op.kind in COLLECTIVE_KINDS:
        return f"h{op.handle}" + (f" {op.flat}" if op.flat else "") + (f" ({op.detail})" if op.detail else "")
    if op.kind is OpKind.WAIT:
        return f"h{op.handle}"
    if op.kind is OpKind.COMPUTE:
        uses = f", reads {', '.join(u for u in op.uses)}" if op.uses else ""
        what = "recompute, " if op.detail == "recompute" else ""
        return f"{what}{op.nodes} nodes{uses}"
    if op.kind is OpKind.OPTIMIZER:
        return f"{op.flat}: {op.numel} elements in place"
    if op.kind is OpKind.FREE:
        return op.flat or ""
    return op.detail
