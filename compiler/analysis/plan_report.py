"""The whole plan of one compiled step, as users read it: schedule, memory, communication, time.

A `Plan` bundles three frozen objects computed from the same graph: the
`Schedule`, the `MemoryPlan` and the predicted `Timeline`. It renders as the
report that ``shardlang plan`` prints (`Plan.report`) and serialises to the
JSON that ``shardlang plan --json`` writes and ``shardlang diff`` reads.

The communication check compares the schedule's bytes with formulas computed
from the flat parameters alone (docs/schedule.md, "The formulas"): per rank per
step, with M the padded bytes of the sharded parameters,

    all_gather      = M + R      R: the re-gathered units (M at most; 0 without resharding)
    reduce_scatter  = M_trainable
    all_reduce      = replicated trainable parameters + BatchNorm statistics

and the wire total with the textbook ``3(N-1)/N * M`` of full sharding.

Example::

    plan = make_plan(compiled)                       # defaults: gloo on loopback, this CPU
    print(plan.report())
    plan.memory.peak, plan.timeline.step_time_s
"""

from __future__ import annotations

import json

import attrs
import torch.fx as fx

from ..collection import collection_paused
from .cost import CostModel, Timeline
from .memory import MemoryPlan, backend_scratch, plan_memory
from ..schedule.schedule import COLLECTIVE_KINDS, OpKind, Schedule
from ..schedule.schedule_format import _detail, _unit, human_bytes
from ..ir.trace import GraphInput
from shardlang.spec.vocabulary import Strategy


@attrs.frozen
class Plan:
    """A compiled step's schedule, memory plan and predicted timeline, all from one graph."""

    schedule: Schedule
    memory: MemoryPlan
    timeline: Timeline
    budget: object = None  # `compiler.analysis.budget.BudgetChoice`, when Options.memory_budget chose the configuration

    def to_dict(self) -> dict:
        """The schedule's JSON object plus ``memory``, ``timeline`` and ``communication`` (see docs/plan.md)."""
        timeline = self.timeline.to_dict()
        timeline.pop("spans")
        timeline["ops"] = [{"index": i, "start_s": s, "end_s": e}
                           for i, (s, e) in enumerate(zip(self.timeline.op_start_s, self.timeline.op_end_s))]
        budget = {} if self.budget is None else {"memory_budget": self.budget.to_dict()}
        return self.schedule.to_dict() | budget | {
            "memory": self.memory.to_dict(),
            "timeline": timeline,
            "communication": [row.to_dict() for row in communication_check(self.schedule)],
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    def report(self, max_rows: int | None = None) -> str:
        """Summary, communication against the formulas, memory peak, predicted time, then the table."""
        return "\n\n".join(([] if self.budget is None else [self.budget.summary_text()]) + [
            self.schedule.summary_text(),
            format_communication(self.schedule),
            self.memory.summary_text(),
            self.timeline.summary_text(),
            format_plan_table(self, max_rows=max_rows),
        ])


@collection_paused  # Note [no collection while compiling]: the memory plan and timeline walk the whole graph
def make_plan(compiled=None, *, graph_module: fx.GraphModule | None = None, schedule: Schedule | None = None,
              inputs: tuple[GraphInput, ...] | None = None, cost_model: CostModel | None = None,
              scratch: dict[str, float] | None = None) -> Plan:
    """The `Plan` of a `CompiledStep` (or of a graph, its schedule and its input signature).

    ``cost_model`` defaults to `CostModel()` (gloo on loopback, CPU); the
    memory plan's collective scratch follows its link's backend unless
    ``scratch`` is given (Note [collective scratch] in `compiler.analysis.memory`).
    """
    cost_model = cost_model or CostModel()
    if compiled is not None:
        graph_module, schedule, inputs = compiled.graph_module, compiled.schedule, compiled.context.inputs
    if compiled is not None and scratch is None:
        memory = compiled.memory_on(cost_model.link.backend)  # planned once, as the budget search may have
    else:
        memory = plan_memory(graph_module, schedule, inputs,
                             scratch=backend_scratch(cost_model.link.backend) if scratch is None else scratch)
    return Plan(schedule, memory, cost_model.predict(schedule, graph_module), getattr(compiled, "budget", None))


# ---- communication against the formulas ----------------------------------------


@attrs.frozen
class CommunicationRow:
    """One collective kind: the schedule's payload bytes per rank and the formula's."""

    kind: str
    planned: int
    formula: int
    expression: str

    @property
    def matches(self) -> bool:
        return self.planned == self.formula

    def to_dict(self) -> dict:
        return attrs.asdict(self) | {"matches": self.matches}


def communication_check(schedule: Schedule) -> tuple[CommunicationRow, ...]:
    """Each collective kind's planned payload against the strategies' formulas (`compiler.analysis.formulas`)."""
    from .formulas import REGATHER_DETAIL, formula_bytes

    formula = formula_bytes(schedule)
    planned = schedule.summary.bytes_per_rank
    flats = {f.name: f for f in schedule.flats}
    sharded = [f for f in schedule.flats if f.sharded and f.strategy is not Strategy.DDP]
    m = sum(f.gathered_bytes for f in sharded)
    m_trainable = sum(f.reduced_bytes for f in sharded if f.trainable)
    regathered = [op.flat for op in schedule.ops if op.kind is OpKind.ALL_GATHER and op.detail == REGATHER_DETAIL]
    r = sum(flats[name].gathered_bytes for name in regathered if name in flats)
    replicated = sum(f.numel * (f.reduce_element_size or f.element_size) for f in schedule.flats
                     if f not in sharded and f.trainable)
    tensor = schedule.tensor_axis[0] if schedule.tensor_axis else None
    on_tensor = {kind: sum(op.bytes for op in schedule.ops if op.kind is kind and op.flat is None
                           and tensor is not None and op.group == tensor)
                 for kind in COLLECTIVE_KINDS}
    other = sum(op.bytes for op in schedule.ops if op.kind is OpKind.ALL_REDUCE and op.flat is None)
    other -= on_tensor[OpKind.ALL_REDUCE]
    expressions = {
        "all_gather": f"M + R = {human_bytes(m)} + {human_bytes(r)} ({len(regathered)} re-gathered for backward)",
        "reduce_scatter": f"M_trainable = {human_bytes(m_trainable)}",
        "all_reduce": f"replicated {human_bytes(replicated)} + statistics and norms {human_bytes(other)}",
    }
    if tensor is not None:  # the tensor axis's redistributions of activations and gradients
        expressions["all_gather"] += f" + {tensor} activations {human_bytes(on_tensor[OpKind.ALL_GATHER])}"
        expressions["all_reduce"] += f" + {tensor} activations {human_bytes(on_tensor[OpKind.ALL_REDUCE])}"
        if on_tensor[OpKind.REDUCE_SCATTER]:  # sequence parallelism
            expressions["reduce_scatter"] += (f" + {tensor} activations "
                                              f"{human_bytes(on_tensor[OpKind.REDUCE_SCATTER])}")
    if schedule.is_evaluation:  # forward only: each gathered unit once, nothing reduced
        gathered = sum(f.gathered_bytes for f in sharded if f.strategy.shards_parameters)
        expressions = {"all_gather": f"M = {human_bytes(gathered)} (each unit once, forward only)",
                       "reduce_scatter": "none: evaluation has no gradients",
                       "all_reduce": "none: evaluation has no gradients, eval-mode BatchNorm no batch statistics"}
    elif not _plain_full_sharding(schedule):
        expressions = {k: "per flat parameter by its strategy (docs/strategies.md)" for k in expressions}
    return tuple(CommunicationRow(k, planned[k], formula[k], expressions[k]) for k in planned)


def format_communication(schedule: Schedule) -> str:
    """The communication check as text, with the wire total against ``3(N-1)/N * M``."""
    n = schedule.world_size
    lines = [f"{'communication':<16}{'planned/rank':>14}{'formula':>14}  check"]
    for row in communication_check(schedule):
        verdict = "= " if row.matches else f"differs by {human_bytes(row.planned - row.formula)}: "
        lines.append(f"{row.kind:<16}{human_bytes(row.planned):>14}{human_bytes(row.formula):>14}  "
                     f"{verdict}{row.expression}")
    wire = sum(schedule.summary.wire_bytes_per_rank.values())
    line = f"on the wire per rank: {human_bytes(wire)}"
    if _plain_full_sharding(schedule) and not schedule.is_evaluation:
        m = sum(f.padded_bytes for f in schedule.flats if f.sharded)
        line += f"; full sharding's textbook 3(N-1)/N*M = {human_bytes(3 * (n - 1) / n * m if n > 1 else 0)}"
    lines.append(line)
    return "\n".join(lines)


def _plain_full_sharding(schedule: Schedule) -> bool:
    """Every flat parameter fully sharded (ZeRO-3) or replicated, on a 1-D mesh: the textbook's setting."""
    return len(schedule.mesh) == 1 and all(f.strategy is Strategy.ZERO3 or not f.sharded
                                           for f in schedule.flats)


# ---- the table -------------------------------------------------------------------


def format_plan_table(plan: Plan, max_rows: int | None = None) -> str:
    """The schedule table with each op's memory (live after it, peak during it) and predicted start and length."""
    header = ("#", "phase", "op", "unit", "bytes", "live after", "peak in op", "start ms", "ms", "detail")
    rows = [header]
    tl = plan.timeline
    memory = {m.index: m for m in plan.memory.ops}
    durations = _op_durations(plan)
    for op in plan.schedule.ops:
        mem = memory.get(op.index)
        peak_mark = " *" if plan.memory.peak_op == op.index else ""
        rows.append((
            str(op.index), op.phase.value, op.kind.value, _unit(op.unit), human_bytes(op.bytes) if op.bytes else "",
            human_bytes(mem.live_after) if mem else "", (human_bytes(mem.peak) + peak_mark) if mem else "",
            f"{tl.op_start_s[op.index] * 1e3:.3f}", f"{durations[op.index] * 1e3:.3f}" if durations[op.index] else "",
            _detail(op),
        ))
    if max_rows is not None and len(rows) > max_rows + 1:
        keep = max_rows // 2
        rows = rows[: keep + 1] + [("...", "", f"({len(rows) - 1 - 2 * keep} more ops)") + ("",) * 7] + rows[-keep:]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    right = {4, 5, 6, 7, 8}
    lines = ["  ".join(cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             .rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("(* the op with the step's memory peak; a collective's ms is its time on the link, a wait's the "
                 "time it blocks)")
    return "\n".join(lines)


def _op_durations(plan: Plan) -> list[float]:
    durations = [0.0] * len(plan.schedule.ops)
    for span in plan.timeline.spans:
        durations[span.op] = span.duration_s
    return durations

