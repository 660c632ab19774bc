"""The cost model: how long each op of the schedule takes, and the timeline they make together.

Collectives follow the alpha-beta model of a ring over N ranks: a collective
that takes ``s`` ring steps and sends ``w`` bytes per rank takes
``s * alpha + w / bandwidth``, where

    kind             steps       bytes a rank sends (payload B)
    all_gather       N - 1       (N-1)/N * B
    reduce_scatter   N - 1       (N-1)/N * B
    all_reduce       2(N - 1)    2(N-1)/N * B

(the same "on the wire" bytes as `Summary.wire_bytes_per_rank`). gloo in torch
2.13 runs a reduce-scatter as an all-reduce (`LinkModel.reduce_scatter_as_all_reduce`).
Compute is a roofline per graph node: ``overhead + max(flops / flops_per_s,
bytes / bytes_per_s)``, where flops come from `torch.utils.flop_counter`'s
formulas (matmuls, convolutions, attention) and bytes are what the node reads
and writes; views cost only their (smaller) overhead. A segment's time is the
sum over its nodes.

`CostModel.predict` plays the schedule on one compute lane and the
communication lanes: an issue starts its collective when the link is free (one
process group runs its collectives in order, so by default they queue on one
link; `serialize_collectives=False` gives each kind its own), compute runs
until a wait, and a wait blocks until its collective ends. The time a wait
blocks is *exposed* communication; the rest overlaps compute.

With ``fused=True`` (``Options(backend="inductor")``, `compiler.lower.backend`) the
compute is costed as inductor runs it: Note [fused compute].

The presets and the numbers behind them are in docs/plan.md ("The knobs").

Example::

    model = CostModel(link=LINKS["nvlink"], compute=COMPUTE["h100-bf16"])
    timeline = model.predict(compiled.schedule, compiled.graph_module)
    timeline.step_time_s, timeline.exposed_comm_s
"""

from __future__ import annotations

import json
from collections.abc import Callable

import attrs
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from shardlang.errors import SpecError
from ..ir.graph_utils import is_alias_op
from ..ir.tags import NodeKind, kind_of
from ..layout.placement import WORLD
from ..schedule.schedule import COLLECTIVE_KINDS, OpKind, Schedule

_aten = torch.ops.aten


@attrs.frozen
class LinkModel:
    """One link's alpha-beta parameters.

    ``alpha_s`` is the latency of one ring step, ``bandwidth`` the bytes per
    second a rank sustains sending (1/beta); ``backend`` names the library
    ("gloo" or "nccl"), which decides the memory plan's collective scratch.

    Example: ``LinkModel("my-ib", alpha_s=8e-6, bandwidth=40e9, backend="nccl")``.
    """

    name: str
    alpha_s: float = attrs.field(validator=attrs.validators.ge(0))
    bandwidth: float = attrs.field(validator=attrs.validators.gt(0))
    backend: str = "nccl"
    reduce_scatter_as_all_reduce: bool = False

    @property
    def beta(self) -> float:
        """Seconds per byte sent."""
        return 1.0 / self.bandwidth

    def time(self, kind: str, world_size: int, payload: int) -> float:
        """Seconds for one collective of ``kind`` over ``world_size`` ranks with ``payload`` bytes per rank."""
        n = world_size
        if n <= 1 or payload == 0:
            return 0.0
        if kind == "reduce_scatter" and self.reduce_scatter_as_all_reduce:
            kind = "all_reduce"
        steps, share = {"all_gather": (n - 1, (n - 1) / n), "reduce_scatter": (n - 1, (n - 1) / n),
                        "all_reduce": (2 * (n - 1), 2 * (n - 1) / n)}[kind]
        return steps * self.alpha_s + share * payload / self.bandwidth


@attrs.frozen
class ComputeModel:
    """A device's roofline: matmul rate, memory bandwidth, and the fixed cost of running one node.

    Example: ``ComputeModel("my-cpu", flops_per_s=50e9, bytes_per_s=10e9, op_overhead_s=8e-6)``.
    """

    name: str
    flops_per_s: float = attrs.field(validator=attrs.validators.gt(0))
    bytes_per_s: float = attrs.field(validator=attrs.validators.gt(0))
    op_overhead_s: float = attrs.field(default=0.0, validator=attrs.validators.ge(0))
    view_overhead_s: float = attrs.field(default=0.0, validator=attrs.validators.ge(0))

    def node_time(self, node: fx.Node) -> float:
        """Seconds to run one graph node (0 for placeholders and the output)."""
        if node.op != "call_function" or kind_of(node) is NodeKind.SLOT:
            return 0.0  # a slot of the step's pool is held between steps: no kernel (Note [buffer assignment])
        if is_alias_op(node):
            return self.view_overhead_s
        return self.kernel_time(node_flops(node), node_bytes(node))

    def kernel_time(self, flops: int, nbytes: int) -> float:
        """Seconds of one kernel: its launch overhead, then the slower of its arithmetic and its memory traffic."""
        return self.op_overhead_s + max(flops / self.flops_per_s, nbytes / self.bytes_per_s)


# The presets. docs/plan.md ("The knobs") gives the sources and measurements behind every number.
LINKS: dict[str, LinkModel] = {
    "gloo-loopback": LinkModel("gloo-loopback", alpha_s=155e-6, bandwidth=1.0e9, backend="gloo",
                               reduce_scatter_as_all_reduce=True),
    "nvlink": LinkModel("nvlink", alpha_s=3e-6, bandwidth=360e9, backend="nccl"),
    "infiniband": LinkModel("infiniband", alpha_s=8e-6, bandwidth=40e9, backend="nccl"),
}
COMPUTE: dict[str, ComputeModel] = {
    "cpu": ComputeModel("cpu", flops_per_s=95e9, bytes_per_s=90e9, op_overhead_s=13e-6, view_overhead_s=0.7e-6),
    "a100-bf16": ComputeModel("a100-bf16", flops_per_s=150e12, bytes_per_s=1.6e12, op_overhead_s=10e-6,
                              view_overhead_s=3e-6),
    "h100-bf16": ComputeModel("h100-bf16", flops_per_s=400e12, bytes_per_s=2.6e12, op_overhead_s=10e-6,
                              view_overhead_s=3e-6),
}


def link(name: str) -> LinkModel:
    """The link preset ``name``; a `SpecError` lists the valid names."""
    try:
        return LINKS[name]
    except KeyError:
        raise SpecError(f"unknown link {name!r}; known links: {', '.join(sorted(LINKS))}") from None


def compute(name: str) -> ComputeModel:
    """The compute preset ``name``; a `SpecError` lists the valid names."""
    try:
        return COMPUTE[name]
    except KeyError:
        raise SpecError(f"unknown compute model {name!r}; known: {', '.join(sorted(COMPUTE))}") from None


@attrs.frozen
class Span:
    """One interval of the predicted timeline, on one lane.

    ``lane`` is "compute" or a collective kind; ``name`` is ``"<op index> <kind>
    <unit>"``, the name the measured trace gives the same op
    (`shardlang.cli.profile`). A wait's span is the time it blocks: exposed
    communication.
    """

    lane: str
    op: int
    name: str
    kind: str
    start_s: float
    duration_s: float
    bytes: int = 0

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


@attrs.frozen
class Timeline:
    """The predicted timeline of one step on one rank: spans per lane, op start times, totals."""

    world_size: int
    spans: tuple[Span, ...]
    op_start_s: tuple[float, ...]
    op_end_s: tuple[float, ...]
    step_time_s: float
    compute_s: float
    comm_s: dict[str, float]
    exposed_comm_s: float
    model: dict

    @property
    def lanes(self) -> tuple[str, ...]:
        return ("compute",) + tuple(k.value for k in COLLECTIVE_KINDS)

    def to_dict(self) -> dict:
        return {
            "world_size": self.world_size,
            "step_time_s": self.step_time_s,
            "compute_s": self.compute_s,
            "comm_s": dict(self.comm_s),
            "exposed_comm_s": self.exposed_comm_s,
            "model": self.model,
            "spans": [attrs.asdict(s) for s in self.spans],
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    def summary_text(self) -> str:
        """The predicted step time, what it is made of, and how much communication is exposed."""
        total_comm = sum(self.comm_s.values())
        hidden = total_comm - self.exposed_comm_s
        lines = [
            f"predicted step: {_ms(self.step_time_s)} = compute {_ms(self.compute_s)} + exposed communication "
            f"{_ms(self.exposed_comm_s)}",
            f"  communication {_ms(total_comm)} in all ("
            + ", ".join(f"{k} {_ms(v)}" for k, v in self.comm_s.items() if v) + f"); {_ms(hidden)} of it overlaps "
            f"compute ({100 * hidden / total_comm if total_comm else 100:.0f}%)",
            f"  model: link {self.model['link']['name']} (alpha {self.model['link']['alpha_s'] * 1e6:g} us, "
            f"{self.model['link']['bandwidth'] / 1e9:g} GB/s), compute {self.model['compute']['name']} "
            f"({self.model['compute']['flops_per_s'] / 1e12:g} TFLOP/s, "
            f"{self.model['compute']['bytes_per_s'] / 1e9:g} GB/s, {self.model['compute']['op_overhead_s'] * 1e6:g} us/op)",
        ]
        if self.model.get("axis_links"):
            lines.append("  links per axis: " + ", ".join(
                f"{axis} {m['name']} (alpha {m['alpha_s'] * 1e6:g} us, {m['bandwidth'] / 1e9:g} GB/s)"
                for axis, m in self.model["axis_links"].items()) + "; other axes on the link above")
        return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


@attrs.frozen
class CostModel:
    """A link and a compute model, and whether collectives queue on one link (one process group).

    The defaults are what ``shardlang run`` uses on a CPU machine: gloo on loopback and the CPU calibration.

    Example::

        CostModel().predict(schedule, graph_module).step_time_s      # gloo on loopback, this CPU
        CostModel(link=LINKS["infiniband"], compute=COMPUTE["h100-bf16"])
    """

    link: LinkModel = LINKS["gloo-loopback"]
    compute: ComputeModel = COMPUTE["cpu"]
    serialize_collectives: bool = True
    fused: bool = False  # Note [fused compute]
    # Note [contention]: how many times as long compute takes while a collective is in flight (1.0: not at all)
    contention: float = attrs.field(default=1.0, validator=attrs.validators.ge(1.0))
    # Note [links per axis]: (axis, link) pairs; an axis left out runs on ``link``
    axis_links: tuple[tuple[str, LinkModel], ...] = attrs.field(
        default=(), converter=lambda links: tuple(sorted(dict(links).items())))

    def collective_time(self, kind: str, world_size: int, payload: int, axes: tuple[str, ...] = ()) -> float:
        """Seconds for one collective over ``world_size`` ranks of the mesh ``axes`` (none given: ``link``'s).

        Note [links per axis]: a mesh's axes may ride different links (tp on NVLink
        inside a node, fsdp on InfiniBand between nodes). A collective over one
        axis runs on that axis's link; a ring over several axes crosses each of
        their links, so it takes as long as on the slowest of them.
        """
        if not self.axis_links or not axes:
            return self.link.time(kind, world_size, payload)
        return max(self.link_of(a).time(kind, world_size, payload) for a in axes)

    def link_of(self, axis: str) -> LinkModel:
        """The link collectives over mesh axis ``axis`` run on."""
        return next((link for name, link in self.axis_links if name == axis), self.link)

    def _contended(self, work_s: float, busy_s: float) -> float:
        """Seconds that ``work_s`` of compute takes when the link stays busy for ``busy_s`` more (Note [contention]).

        Note [contention]: on a CPU, gloo copies a collective's bytes on the cores that compute, so compute
        overlapping a collective runs slower; `calibrate` measures by how much (``contention``). While the
        link is busy, compute advances at 1/contention of its rate; after, at its own.
        """
        if self.contention == 1.0 or busy_s <= 0 or work_s <= 0:
            return work_s
        if work_s * self.contention <= busy_s:
            return work_s * self.contention
        return busy_s + (work_s - busy_s / self.contention)

    def predict(self, schedule: Schedule, gm: fx.GraphModule) -> Timeline:
        """Play ``schedule`` (read off ``gm``) on a compute lane and communication lanes."""
        nodes = {n.name: n for n in gm.graph.nodes}
        fusion = plan_fusion(gm) if self.fused else None
        node_time = self.compute.node_time if fusion is None else fusion.node_time(self.compute)
        clock = 0.0
        link_free = {k.value: 0.0 for k in COLLECTIVE_KINDS}
        done: dict[int, float] = {}
        spans, starts, ends = [], [], []
        compute_s, exposed = 0.0, 0.0
        comm = {k.value: 0.0 for k in COLLECTIVE_KINDS}
        for op in schedule.ops:
            starts.append(clock)
            name = op_name(op)
            if op.kind in COLLECTIVE_KINDS:
                kind = op.kind.value
                lane_free = max(link_free.values()) if self.serialize_collectives else link_free[kind]
                begin = max(clock, lane_free)
                duration = self.collective_time(kind, getattr(op, "group_size", 0) or schedule.world_size, op.bytes,
                                                group_axes(schedule, getattr(op, "group", None)))
                link_free[kind] = begin + duration
                done[op.handle] = begin + duration
                comm[kind] += duration
                spans.append(Span(kind, op.index, name, kind, begin, duration, op.bytes))
            elif op.kind is OpKind.WAIT:
                until = done.get(op.handle, clock)
                if until > clock:
                    spans.append(Span("compute", op.index, name, "wait", clock, until - clock))
                    exposed += until - clock
                    clock = until
            elif op.kind in (OpKind.COMPUTE, OpKind.OPTIMIZER):
                duration = self._contended(sum(node_time(nodes[n]) for n in op.node_names if n in nodes),
                                           max(link_free.values()) - clock)
                spans.append(Span("compute", op.index, name, op.kind.value, clock, duration))
                clock += duration
                compute_s += duration
            ends.append(clock)
        return Timeline(
            world_size=schedule.world_size, spans=tuple(spans), op_start_s=tuple(starts), op_end_s=tuple(ends),
            step_time_s=clock, compute_s=compute_s, comm_s=comm, exposed_comm_s=exposed,
            model={"link": attrs.asdict(self.link), "compute": attrs.asdict(self.compute),
                   "axis_links": {a: attrs.asdict(link) for a, link in self.axis_links},
                   "serialize_collectives": self.serialize_collectives, "contention": self.contention,
                   "fusion": None if fusion is None else fusion.summary()},
        )


@attrs.frozen
class FusionPlan:
    """Which compute nodes inductor fuses into a consumer, and which write their result (Note [fused compute]).

    ``inlined``: pointwise nodes computed inside their consumers' kernel (their
    result is never written to memory); ``kernels``: the nodes that still run as
    a kernel (or an extern call: matmuls, attention, collectives) and write a result.

    Example::

        plan = plan_fusion(compiled.graph_module)
        plan.summary()          # {'compute_nodes': 2990, 'inlined': 1510, 'kernels': 1210, 'views': 270}
    """

    inlined: frozenset[str]
    kernels: frozenset[str]
    views: frozenset[str]

    def summary(self) -> dict[str, int]:
        n = len(self.inlined) + len(self.kernels) + len(self.views)
        return {"compute_nodes": n, "inlined": len(self.inlined), "kernels": len(self.kernels),
                "views": len(self.views)}

    def node_time(self, model: ComputeModel) -> Callable[[fx.Node], float]:
        """Seconds per node under fusion: inlined nodes and views are free; a kernel reads its region's inputs."""
        def time(node: fx.Node) -> float:
            if node.op != "call_function" or node.name in self.inlined or node.name in self.views:
                return 0.0
            moved = _tensor_bytes(node.meta.get("val")) + sum(_tensor_bytes(a.meta.get("val"))
                                                               for a in self._region_inputs(node))
            return model.kernel_time(node_flops(node), moved)

        return time

    def _region_inputs(self, node: fx.Node) -> list[fx.Node]:
        """The materialised values a kernel reads: through inlined producers and views, to what was written."""
        out, seen, stack = [], set(), list(node.all_input_nodes)
        while stack:
            arg = stack.pop()
            if arg in seen:
                continue
            seen.add(arg)
            if arg.name in self.inlined or arg.name in self.views:
                stack.extend(arg.all_input_nodes)
            else:
                out.append(arg)
        return out


def plan_fusion(gm: fx.GraphModule) -> FusionPlan:
    """Note [fused compute]: inductor's vertical fusion, as the cost model counts it.

    A pointwise node (``torch.Tag.pointwise``, not in place) whose every user is
    pointwise or a view is computed inside its users' kernel: it costs no kernel
    launch and its result never goes through memory. Views cost nothing (index
    arithmetic). Everything else (matmuls, attention, reductions, collectives,
    in-place updates, and pointwise nodes with a non-pointwise user) is a kernel
    that reads its inputs, through the inlined nodes, and writes its result.
    Horizontal fusion (independent kernels merged) and reductions fused with their
    pointwise epilogue are not counted: the model stays on the slow side.
    """
    inlined, kernels, views = set(), set(), set()
    for node in reversed(list(gm.graph.nodes)):  # users before producers
        if node.op != "call_function":
            continue
        if is_alias_op(node):
            views.add(node.name)
        elif _pointwise(node) and node.users and all(
                u.name in inlined or u.name in views or (_pointwise(u) and u.name in kernels) for u in node.users):
            inlined.add(node.name)
        else:
            kernels.add(node.name)
    return FusionPlan(frozenset(inlined), frozenset(kernels), frozenset(views))


def _pointwise(node: fx.Node) -> bool:
    target = node.target
    tags = getattr(target, "tags", ())
    schema = getattr(target, "_schema", None)
    return torch.Tag.pointwise in tags and not (schema is not None and schema.is_mutable)


def group_axes(schedule: Schedule, group: str | None) -> tuple[str, ...]:
    """The mesh axes a collective's group spans: ``"*"`` is every data axis (the tensor axis has its own name)."""
    if group is None:
        return ()
    if group == WORLD:
        return tuple(name for name, _ in schedule.mesh)
    return tuple(group.split("+"))


def op_name(op) -> str:
    """``"<index> <kind> <unit>"``: how both timelines, planned and measured, name a schedule op."""
    unit = "" if op.unit is None else (op.unit or "<root>")
    return f"{op.index} {op.kind.value} {unit}".rstrip()


# ---- per-node work ---------------------------------------------------------------

_CPU_ATTENTION = {
    _aten._scaled_dot_product_flash_attention_for_cpu: "forward",
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: "backward",
}


def _val(x):
    return x.meta.get("val") if isinstance(x, fx.Node) else x


def node_flops(node: fx.Node) -> int:
    """Floating-point operations of one node by `torch.utils.flop_counter`'s formulas (0 where it has none)."""
    packet = getattr(node.target, "overloadpacket", None)
    if packet is None:
        return 0
    try:
        if packet in flop_registry:
            args, kwargs = pytree.tree_map(_val, (node.args, node.kwargs))
            return int(flop_registry[packet](*args, **kwargs, out_val=node.meta.get("val")))
        direction = _CPU_ATTENTION.get(packet)
        if direction == "forward":
            q, k, v = (_val(a).shape for a in node.args[:3])
            return int(sdpa_flop_count(q, k, v))
        if direction == "backward":
            grad, q, k, v = (_val(a).shape for a in node.args[:4])
            return int(sdpa_backward_flop_count(grad, q, k, v))
    except (AttributeError, TypeError, ValueError, AssertionError):
        return 0  # a formula that does not fit this call: count no flops rather than fail the plan
    return 0


def _tensor_bytes(val) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(val) if isinstance(t, torch.Tensor))


def node_bytes(node: fx.Node) -> int:
    """Bytes one node reads and writes: its tensor inputs and its output.

    A slot of the step's pool that the node writes its output into is written, not read: it counts once, as
    the output, so a gather or a pack costs the same pooled or not (Note [pool after the search]).
    """
    read = (a for a in node.all_input_nodes if kind_of(a) is not NodeKind.SLOT)
    return _tensor_bytes(node.meta.get("val")) + sum(_tensor_bytes(a.meta.get("val")) for a in read)
