"""The schedule: a frozen, plain-data account of one compiled step, read off the final graph.

It lists, in execution order, every op a rank runs: the collectives
(all-gather, reduce-scatter, all-reduce) with their payload bytes, the waits
that complete them, the frees that end a gathered unit's life, the compute
segments between them, and the optimizer update of each flat parameter. Every
rank derives the same schedule from the same spec and graph. Its
`collectives_digest` (the sequence of collectives alone, which no batch shape
changes: Note [collectives do not depend on the batch]) is what ranks compare at
start-up; `digest` hashes the whole schedule.

Bytes are payload bytes, the size of the buffer a collective produces or
consumes on one rank: an all-gather's output (``N * S`` elements), a
reduce-scatter's input (``N * S``) and an all-reduce's buffer. With a ring
algorithm a rank sends ``(N-1)/N`` of an all-gather or reduce-scatter payload
and ``2(N-1)/N`` of an all-reduce's; `Summary.wire_bytes_per_rank` reports that.

Example::

    print(schedule.table())
    json.loads(schedule.to_json())["bytes_per_rank"]["all_gather"]
"""

from __future__ import annotations

import enum
import hashlib
import json

import attrs
import torch
import torch.fx as fx

from ..ir import collectives
from ..context import CompileContext
from ..ir.graph_utils import alias_closure, unpack_copies
from ..ir.tags import LOGITS_NEVER_GATHERED, NodeKind, kind_of, node_tag, writes_into_slot
from ..layout.member_updates import written_in_place
from ..layout.placement import WORLD
from shardlang.spec.vocabulary import Strategy
from ..ir.trace import Phase, phase_of, tag_of


class OpKind(enum.Enum):
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    WAIT = "wait"
    FREE = "free"
    COMPUTE = "compute"
    OPTIMIZER = "optimizer"


COLLECTIVE_KINDS = (OpKind.ALL_GATHER, OpKind.REDUCE_SCATTER, OpKind.ALL_REDUCE)


@attrs.frozen
class ScheduleOp:
    """One op of the schedule.

    ``handle`` pairs a collective with its wait. ``uses`` lists, for a compute
    segment, the flat parameters whose gathered values it reads. ``numel`` is,
    for an optimizer op, the elements the update touches. ``node_names`` are
    the graph nodes the op covers, in order (not part of the JSON or the
    digest); the memory plan and the profiler map nodes to ops through them.
    """

    index: int
    kind: OpKind
    phase: Phase = attrs.field(converter=Phase)
    unit: str | None = None
    flat: str | None = None
    bytes: int = 0
    handle: int | None = None
    uses: tuple[str, ...] = ()
    nodes: int = 0
    numel: int = 0
    detail: str = ""
    group: str | None = None  # a collective's group: a mesh axis, "*" (every rank), or axes joined by "+"
    group_size: int = 0  # the ranks in that group
    microbatch: int | None = None  # with Options(microbatches=k > 1): the micro-batch the op belongs to, 0..k-1
    node_names: tuple[str, ...] = attrs.field(default=(), eq=False, repr=False)

    def to_dict(self) -> dict:
        d = attrs.asdict(self, recurse=False, filter=lambda a, _v: a.name != "node_names")
        d["kind"] = self.kind.value
        d["phase"] = self.phase.value
        d["uses"] = list(self.uses)
        return d


@attrs.frozen
class FlatSummary:
    """A flat parameter as the schedule reports it.

    ``local_numel`` is the shard a rank's optimizer updates (and the size of each
    optimizer state tensor); ``held_numel`` the parameter storage a rank holds:
    the shard under ZERO3 / ZERO2, the whole (padded) flat parameter under ZERO1
    and DDP. ``strategy`` is its `shardlang.spec.vocabulary.Strategy`; ``axis`` the
    mesh axis it is sharded over (None when replicated).
    """

    name: str
    unit: str
    sharded: bool
    trainable: bool
    numel: int
    padded_numel: int
    local_numel: int
    element_size: int
    members: tuple[str, ...]
    strategy: Strategy = attrs.field(default=Strategy.ZERO3, converter=Strategy)
    held_numel: int = 0
    axis: str | None = None
    gather_element_size: int | None = None  # mixed precision: the param_dtype's (None: element_size)
    reduce_element_size: int | None = None  # the dtype gradients are reduced in (None: element_size)

    @property
    def padded_bytes(self) -> int:
        return self.padded_numel * self.element_size

    @property
    def gathered_bytes(self) -> int:
        """What a ZeRO-3 / ZeRO-2 all-gather of the whole flat parameter moves: in the compute dtype."""
        return self.padded_numel * (self.gather_element_size or self.element_size)

    @property
    def reduced_bytes(self) -> int:
        """What the reduction of the whole (padded) gradient moves: in the dtype gradients are reduced in."""
        return self.padded_numel * (self.reduce_element_size or self.element_size)


@attrs.frozen
class Summary:
    """Per-step totals for one rank: collective counts, payload bytes and ring wire bytes by kind.

    Wire bytes count each collective over its own group of n ranks:
    ``(n-1)/n`` of an all-gather or reduce-scatter payload, ``2(n-1)/n`` of an
    all-reduce's (on a hybrid mesh the all-reduce of shards runs over the
    replicas, the others over the shard group).
    """

    world_size: int
    collectives: dict[str, int]
    bytes_per_rank: dict[str, int]
    wire: dict[str, float] | None = None  # exact wire bytes by kind; None: every collective over the world

    @property
    def wire_bytes_per_rank(self) -> dict[str, int]:
        if self.wire is not None:
            return {k: round(v) for k, v in self.wire.items()}
        return {k: round(v * wire_factor(k, self.world_size)) for k, v in self.bytes_per_rank.items()}


def wire_factor(kind: str, group_size: int) -> float:
    """What one rank sends per payload byte with a ring algorithm over ``group_size`` ranks."""
    n = max(group_size, 1)
    return (2 if kind == "all_reduce" else 1) * (n - 1) / n


@attrs.frozen
class Schedule:
    """The ordered ops of one rank's training step, with its flat parameters and mesh."""

    world_size: int
    mesh: tuple[tuple[str, int], ...]
    flats: tuple[FlatSummary, ...]
    ops: tuple[ScheduleOp, ...]
    options: dict = attrs.field(factory=dict)
    tensor_axis: tuple[str, int] | None = None  # (name, size) of the mesh's tensor axis; ``mesh`` is the data axes
    logits_never_gathered: int = 0  # loss parallelism: bytes of logits a rank neither gathers nor holds

    @property
    def summary(self) -> Summary:
        counts = {k.value: 0 for k in COLLECTIVE_KINDS}
        sizes = {k.value: 0 for k in COLLECTIVE_KINDS}
        wire = {k.value: 0.0 for k in COLLECTIVE_KINDS}
        for op in self.ops:
            if op.kind in COLLECTIVE_KINDS:
                counts[op.kind.value] += 1
                sizes[op.kind.value] += op.bytes
                wire[op.kind.value] += op.bytes * wire_factor(op.kind.value, op.group_size or self.world_size)
        return Summary(self.world_size, counts, sizes, wire)

    @property
    def largest_collective(self) -> int:
        """The payload bytes of the schedule's largest collective (0: none)."""
        return max((op.bytes for op in self.ops if op.kind in COLLECTIVE_KINDS), default=0)

    @property
    def is_evaluation(self) -> bool:
        """Whether this is a forward-only evaluation schedule (`compiler.evaluate`)."""
        return bool(self.options.get("evaluate"))

    def flat(self, name: str) -> FlatSummary:
        return next(f for f in self.flats if f.name == name)

    def by_strategy(self) -> dict[Strategy, dict[str, int]]:
        """Per strategy: its flat parameters, the parameter bytes a rank holds, and its payload bytes by collective.

        Example: ``schedule.by_strategy()[Strategy.ZERO1] == {"flats": 2, "held_bytes": ..., "all_gather": ...,
        "reduce_scatter": ..., "all_reduce": 0}``. Collectives of no flat parameter (BatchNorm statistics,
        a gradient norm) are not counted here.
        """
        out: dict[str, dict[str, int]] = {}
        strategy_of = {f.name: f.strategy for f in self.flats}
        for f in self.flats:
            row = out.setdefault(f.strategy, {"flats": 0, "held_bytes": 0, **{k.value: 0 for k in COLLECTIVE_KINDS}})
            row["flats"] += 1
            row["held_bytes"] += f.held_numel * f.element_size
        for op in self.ops:
            if op.kind in COLLECTIVE_KINDS and op.flat in strategy_of:
                out[strategy_of[op.flat]][op.kind.value] += op.bytes
        return out

    def to_dict(self) -> dict:
        summary = self.summary
        return {
            "world_size": self.world_size,
            "mesh": dict(self.mesh),
            **({"tensor_axis": dict([self.tensor_axis])} if self.tensor_axis else {}),
            **({"logits_never_gathered": self.logits_never_gathered} if self.logits_never_gathered else {}),
            "options": dict(self.options),
            "flats": [attrs.asdict(f) | {"strategy": f.strategy.value, "padded_bytes": f.padded_bytes}
                      for f in self.flats],
            "ops": [op.to_dict() for op in self.ops],
            "collectives": summary.collectives,
            "bytes_per_rank": summary.bytes_per_rank,
            "wire_bytes_per_rank": summary.wire_bytes_per_rank,
            "bytes_by_strategy": {s.value: row for s, row in self.by_strategy().items()},
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    def op_of_node(self, name: str) -> ScheduleOp | None:
        """The op that covers the graph node called ``name`` (`ScheduleOp.node_names`); None if none does.

        Example: ``schedule.op_of_node("wait_tensor_3").index``.
        """
        for op in self.ops:
            if name in op.node_names:
                return op
        return None

    def digest(self) -> str:
        """A hash of the whole schedule (compute segments and memory included)."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def collective_sequence(self) -> tuple[tuple, ...]:
        """Every collective in issue order as ``(kind, group, group_size, bytes, flat, detail, microbatch)``.

        Note [collectives do not depend on the batch]: this is what every rank
        must agree on, and no batch shape changes it. Parameter collectives move
        flat parameters and their gradients; batch statistics (BatchNorm) are
        per channel, with the element count reduced alongside; the gradient norm
        is one number; micro-batches split each rank's own rows. Compute
        segments and memory, which do depend on the batch, are left out, so ranks
        holding batches of different shapes in the same step compare equal. A
        tensor axis's collectives move activations, whose bytes do depend on the
        batch: their order and groups count, their bytes do not. The ranks of one
        tp group take the same rows (`Mesh.batch_split`), so they agree on those
        too; ranks of different tp groups never meet in one.
        """
        tensor = self.tensor_axis[0] if self.tensor_axis else None
        return tuple((op.kind.value, op.group, op.group_size,
                      None if tensor is not None and op.group == tensor and op.flat is None else op.bytes,
                      op.flat, op.detail, op.microbatch)
                     for op in self.ops if op.kind in COLLECTIVE_KINDS)

    def collectives_digest(self) -> str:
        """A hash of `collective_sequence`: what ranks compare at start-up and every new batch shape is checked against.

        Example: ``plan(..., example_batch=short).schedule.collectives_digest() ==
        plan(..., example_batch=long).schedule.collectives_digest()``.
        """
        return hashlib.sha256(json.dumps(self.collective_sequence()).encode()).hexdigest()[:16]

    def table(self, max_rows: int | None = None) -> str:
        """The schedule as a text table (see docs/schedule.md for how to read it)."""
        from .schedule_format import format_table

        return format_table(self, max_rows=max_rows)

    def summary_text(self) -> str:
        from .schedule_format import format_summary

        return format_summary(self)

    def __str__(self) -> str:
        return self.table()


def read_schedule(gm: fx.GraphModule, ctx: CompileContext) -> Schedule:
    """Read the schedule off a compiled graph whose nodes carry `meta["val"]` and pass tags."""
    builder = _Builder(ctx)
    never_gathered = 0
    for node in gm.graph.nodes:
        builder.visit(node)
        never_gathered += node.meta.get(LOGITS_NEVER_GATHERED, 0)
    builder.close_segment()
    return Schedule(
        world_size=ctx.mesh.size,
        mesh=ctx.mesh.axes,
        flats=tuple(flat_summary(f) for f in ctx.flats),
        ops=tuple(builder.ops),
        options=_options(ctx),
        tensor_axis=(ctx.config.tensor.name, ctx.config.tensor.size) if ctx.config.tensor is not None else None,
        logits_never_gathered=never_gathered,
    )


def _options(ctx: CompileContext) -> dict:
    if ctx.evaluate:  # no training features apply to a forward-only graph
        return {"evaluate": True, "prefetch": ctx.prefetch}
    return {"reshard_after_forward": ctx.reshard_after_forward, "prefetch": ctx.prefetch,
            **ctx.training.schedule_options(), **_recompute_options(ctx)}


def _recompute_options(ctx: CompileContext) -> dict[str, object]:
    """``{"recompute": {unit label: policy}}`` for the units that recompute; nothing when none does."""
    chosen = {(unit or "<root>"): p.value for unit, p in sorted(ctx.recompute.items()) if p.value != "none"}
    return {"recompute": chosen} if chosen else {}


def flat_summary(flat) -> FlatSummary:
    """What a schedule records of one flat parameter (`layout.flat.FlatParam`): sizes, dtypes, strategy, axis."""
    return FlatSummary(
        name=flat.name, unit=flat.unit, sharded=flat.sharded, trainable=flat.trainable, numel=flat.numel,
        padded_numel=flat.padded_numel if flat.sharded else flat.numel,
        local_numel=flat.shard_numel if flat.sharded else flat.numel, element_size=flat.element_size,
        members=tuple(m.name for m in flat.members), strategy=flat.strategy, held_numel=flat.storage_numel,
        axis=flat.axis, gather_element_size=flat.compute_dtype.itemsize,
        reduce_element_size=flat.gradient_reduce_dtype.itemsize,
    )


def _freed_bytes(free: fx.Node) -> int:
    """The storage a ``free`` releases: the gathered buffer, or the copies unpacked from it
    (Note [copy-out frees the buffer] in passes/reshard_after_forward.py). In the step's pool or not: the free ends
    the buffer's life; whether its bytes go back or stay in a slot is the memory plan's (Note [buffer assignment])."""
    held = [a for a in free.args if kind_of(a) is NodeKind.WAIT_GATHER
            or (kind_of(a) is NodeKind.UNPACK and (writes_into_slot(a) or unpack_copies(a)))]
    return sum(_nbytes(a) for a in held)


def _nbytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


class _Builder:
    """Walks the graph once, merging runs of compute nodes into segments."""

    def __init__(self, ctx: CompileContext):
        self.ctx = ctx
        self.ops: list[ScheduleOp] = []
        self.handles: dict[fx.Node, int] = {}
        self.gathered: dict[fx.Node, str] = {}  # alias-closure node -> flat name
        self.segment: dict | None = None
        self.microbatch: int | None = None  # of the node being visited

    def add(self, kind: OpKind, phase: Phase, **fields) -> None:
        fields.setdefault("microbatch", self.microbatch)
        self.ops.append(ScheduleOp(index=len(self.ops), kind=kind, phase=phase, **fields))

    def unit_of(self, flat: str | None) -> str | None:
        return self.ctx.flat(flat).unit if flat else None

    def visit(self, node: fx.Node) -> None:
        if node.op in ("placeholder", "output", "get_attr") or kind_of(node) is NodeKind.SLOT:
            return  # a slot of the step's pool is held from the step before, as an input is
        microbatch = tag_of(node, "microbatch")
        if microbatch != self.microbatch:  # an op belongs to one micro-batch
            self.close_segment()
            self.microbatch = microbatch
        tag = node_tag(node)
        kind, flat = (tag.kind, tag.flat) if tag is not None else (None, None)
        phase = phase_of(node) or Phase.FORWARD
        if kind is not None and kind.is_collective:
            self.close_segment()
            handle = len(self.handles)
            self.handles[node] = handle
            nbytes = _nbytes(node) if kind is NodeKind.ALL_GATHER else _nbytes(node.args[0])
            group, group_size = collectives.group_of(node) or (None, 0)
            detail = tag.detail or ("re-gather for backward" if tag.regather else
                                    "updated shards" if tag.update else
                                    "across replicas" if kind is NodeKind.ALL_REDUCE and flat and group != WORLD else "")
            self.add(OpKind(kind.value), phase, unit=self.unit_of(flat), flat=flat, bytes=nbytes, handle=handle,
                     detail=detail, group=group, group_size=group_size, node_names=(node.name,))
        elif kind is not None and kind.is_wait:
            self.close_segment()
            self.add(OpKind.WAIT, phase, unit=self.unit_of(flat), flat=flat, handle=self.handles.get(node.args[0]),
                     node_names=(node.name,))
            if kind is NodeKind.WAIT_GATHER and flat is not None:
                for alias in alias_closure(node):
                    self.gathered[alias] = flat
        elif kind is NodeKind.FREE:
            self.close_segment()
            self.add(OpKind.FREE, phase, unit=self.unit_of(flat), flat=flat, bytes=_freed_bytes(node),
                     node_names=(node.name,))
        elif phase is Phase.OPTIMIZER and tag_of(node, "flat") and not kind:
            self.extend_segment(node, OpKind.OPTIMIZER, phase, tag_of(node, "flat"))
        else:
            self.extend_segment(node, OpKind.COMPUTE, phase, None, tag_of(node, "recompute"))

    def extend_segment(self, node: fx.Node, kind: OpKind, phase: Phase, flat: str | None,
                       recompute: str | None = None) -> None:
        seg = self.segment
        if (seg is None or seg["kind"] is not kind or seg["phase"] is not phase or seg["flat"] != flat
                or seg["recompute"] != recompute):
            self.close_segment()
            seg = self.segment = {"kind": kind, "phase": phase, "flat": flat, "nodes": 0, "uses": [], "numel": 0,
                                  "names": [], "recompute": recompute}
        seg["nodes"] += 1
        seg["names"].append(node.name)
        for arg in node.all_input_nodes:
            used = self.gathered.get(arg)
            if used is not None and used not in seg["uses"]:
                seg["uses"].append(used)
        written = written_in_place(node) if kind is OpKind.OPTIMIZER else None
        if isinstance(written, fx.Node):
            val = written.meta.get("val")
            if isinstance(val, torch.Tensor) and val.dim() > 0:
                seg["numel"] = max(seg["numel"], val.numel())

    def close_segment(self) -> None:
        seg, self.segment = self.segment, None
        if seg is None:
            return
        recompute = seg["recompute"]
        unit = recompute if recompute is not None else self.unit_of(seg["flat"])
        self.add(seg["kind"], seg["phase"], unit=unit, flat=seg["flat"], nodes=seg["nodes"], uses=tuple(seg["uses"]),
                 numel=seg["numel"], detail="recompute" if recompute is not None else "",
                 node_names=tuple(seg["names"]))
