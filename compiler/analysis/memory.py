"""The static memory plan: the bytes live on one rank after every op of the schedule.

Computed from the final graph's fake tensors (``meta["val"]``), with no process
and no real weight. The plan replays the graph the way fx's generated code runs
it (Note [liveness]) and sorts every byte into a `Category`, so it can say not
only how high memory goes but what it is made of at the peak.

Note [liveness]: fx's generated code drops a value right after its last user
(``x = None``) and a value nobody uses right after it is made; the graph's
inputs are held by the caller for the whole step. A value keeps its *storage*
alive, and views, in-place ops and identity collectives share their input's
storage: the plan follows storages, identified through the fake tensors (a
view's fake tensor has its base's fake storage; the shapes of the final graph
are propagated in one fake mode, node for node as one FakeTensorProp would,
Note [incremental shapes] in `compiler.ir.shapes`, so the identities are those of
a real run). A
node's output exists while its inputs are still held, so "during" a node
counts both: that is when the allocator's high-water mark is reached, and it is
what the plan's peak reports. "After" a node is what remains once the values
whose last use it was are gone.

Note [collective scratch]: what a backend allocates on its own while a
collective is in flight is not a graph value, but it is memory. NCCL works in
the collective's own buffers. gloo (torch 2.13) does not: measured with
mallinfo2 on 100 KiB to 1 MiB payloads at N=2 and N=4 (and on the GPT example,
tests/test_memory_plan.py), an all-gather holds one more payload once gloo's
thread starts it (a flat staging copy of the output); a reduce-scatter, which
`emit.bind` lowers on gloo to an all-to-all plus a local sum (Note
[reduce-scatter as all-to-all]), keeps its input alive until the wait (the
Work object holds it) and returns a full-size result, ``(1 - 1/N)`` of a
payload more than the shard the graph's value counts, which the sum right after
the wait consumes: ``2 - 1/N`` payloads until the wait, ``1 - 1/N`` of them one
node longer (measured with mallinfo2 on 8 MiB at N = 2 and 4); an all-reduce
holds up to 1/N of a payload. The rest is released by the time the wait
returns. `gloo_scratch` takes those upper bounds and the plan counts
``scratch[kind] * payload`` bytes from the issue until the wait, so it never
promises memory that a run may need; `NO_SCRATCH` is NCCL's.

Note [activations per unit]: a forward value belongs to the unit whose module
made it (``meta["custom"]["unit"]``, `compiler.ir.trace`). A unit's *kept* bytes
are its activations still live when backward starts (at the first backward
node): what it holds from forward to backward. Its *recomputed* bytes are the
new storages its recompute makes in backward (`passes.recompute_activations`):
what it would otherwise have kept, made again just before its backward and
freed by it. Under "full" a unit keeps little but its input; the plan shows
both per unit (`MemoryPlan.units`).

Note [kept buffers in the plan]: the all-reduce buffers that the bound step
keeps between steps (Note [kept reduction buffers] in
`passes.keep_reduction_buffers`) are state, like the parameters: the plan
counts them as `Category.REDUCTION_BUFFERS`, live from the step's start (the
previous step left them) to its end, and in ``persistent``. Their pack
allocates nothing, and neither does what the bound graph does to them in
place (Note [reductions in place] in `passes.reduce_in_place`): the all-reduce,
its wait, and the average when it alone reads the wait share the kept storage
in the compiled graph itself, as in the bound one. The slots of the step's
pool (Note [buffer assignment] in `compiler.layout.buffers`) are held the same
way, as `Category.BUFFER_POOL`: a gather, unpack or pack written into a slot
allocates nothing, its value (and every view of it) shares the slot's storage.

Example::

    plan = plan_memory(compiled.graph_module, compiled.schedule, compiled.context.inputs)
    print(plan.summary_text())
    plan.peak, plan.breakdown["gathered"]
"""

from __future__ import annotations

import enum
import json

import attrs
import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree

from ..ir import collectives
from ..ir.tags import NodeKind, gathers_parameters, is_kept, kind_of, node_tag
from ..layout.member_updates import member_gradients_of, update_members_
from ..schedule.schedule import Schedule
from ..schedule.schedule_format import human_bytes
from ..ir.trace import GraphInput, InputRole, Phase, phase_of, tag_of


class Category(enum.Enum):
    """What a live byte is for. The order is the order of tables and stacked plots."""

    PARAMETERS = "parameters"  # this rank's parameter shards (a replicated flat parameter whole)
    OPTIMIZER_STATE = "optimizer_state"  # optimizer state shards, the step count, hyperparameters
    INPUTS = "batch_and_buffers"  # the batch and the module's buffers (BatchNorm statistics)
    GATHERED = "gathered"  # all-gather outputs and the parameters unpacked from them
    ACTIVATIONS = "activations"  # values made in forward (kept for backward, or not yet dead)
    GRADIENT_BUFFERS = "gradient_buffers"  # full-size parameter gradients and the packed reduction buffers
    REDUCTION_BUFFERS = "reduction_buffers"  # all-reduce buffers kept between steps (Note [kept buffers in the plan])
    BUFFER_POOL = "buffer_pool"  # the step's slots for gathers and packs, held between steps (Note [buffer assignment])
    GRADIENT_SHARDS = "gradient_shards"  # reduction outputs (this rank's shard) and their average
    TEMPORARIES = "temporaries"  # other backward and optimizer values: activation gradients, update terms
    COLLECTIVE_SCRATCH = "collective_scratch"  # the backend's own copies while a collective runs


PERSISTENT = (Category.PARAMETERS, Category.OPTIMIZER_STATE, Category.INPUTS, Category.REDUCTION_BUFFERS,
              Category.BUFFER_POOL)

#: NCCL (and a world of one) work in the collective's own buffers: no scratch.
NO_SCRATCH = {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 0.0}


def backend_scratch(backend: str):
    """The collective scratch of ``backend`` for `plan_memory`: gloo's copies, none for NCCL (Note [collective
    scratch])."""
    return gloo_scratch if backend == "gloo" else NO_SCRATCH


def gloo_scratch(world_size: int) -> dict[str, float]:
    """gloo's in-flight copies per collective kind, in payloads (Note [collective scratch]).

    Example: ``gloo_scratch(4) == {"all_gather": 1.0, "reduce_scatter": 1.75, "all_reduce": 0.25}``.
    """
    if world_size <= 1:
        return dict(NO_SCRATCH)
    return {"all_gather": 1.0, "reduce_scatter": 2.0 - 1.0 / world_size, "all_reduce": 1.0 / world_size}

_ROLE_CATEGORY = {
    InputRole.FLAT: Category.PARAMETERS,
    InputRole.STATE: Category.OPTIMIZER_STATE,
    InputRole.STEP: Category.OPTIMIZER_STATE,
    InputRole.HYPER: Category.OPTIMIZER_STATE,
    InputRole.BUFFER: Category.INPUTS,
    InputRole.BATCH: Category.INPUTS,
}


@attrs.frozen
class NodeMemory:
    """One graph node: the bytes it allocates and frees, and the bytes live during and after it."""

    name: str
    op: int | None  # the schedule op it belongs to (None for placeholders and the output)
    allocated: int  # new storages made by the node (and collective scratch it starts)
    freed: int  # storages whose last holder it was
    during: int  # live while it runs: before + allocated - released
    after: int  # during - freed
    released: int = 0  # collective scratch gone as it starts (a wait returning)


@attrs.frozen
class OpMemory:
    """One schedule op: bytes live after it, its peak (during its busiest node) and that peak's breakdown."""

    index: int
    live_after: int
    peak: int
    peak_node: str
    allocated: int
    freed: int
    breakdown: dict[str, int]

    def to_dict(self) -> dict:
        return attrs.asdict(self)


@attrs.frozen
class UnitActivations:
    """One unit's activations (Note [activations per unit]): bytes kept from forward to backward, bytes recomputed.

    Example: ``UnitActivations("blocks.0", "full", kept=65536, recomputed=917504)``.
    """

    unit: str
    policy: str
    kept: int
    recomputed: int

    def to_dict(self) -> dict:
        return attrs.asdict(self)


@attrs.frozen
class MemoryPlan:
    """The bytes live on one rank over one step, per node and per schedule op, with the peak's breakdown.

    ``breakdown`` maps each `Category` value to its bytes at the peak;
    ``persistent`` is what lives for the whole step (parameters, optimizer
    state, batch and buffers, and the reduction buffers kept between steps,
    Note [kept buffers in the plan]); ``scratch`` is the collective-scratch model used
    (for the world's group size).
    """

    world_size: int
    peak: int
    peak_op: int | None
    peak_node: str
    breakdown: dict[str, int]
    persistent: int
    ops: tuple[OpMemory, ...]
    nodes: tuple[NodeMemory, ...]
    scratch: dict[str, float]
    units: tuple[UnitActivations, ...] = ()

    @property
    def peak_category(self) -> str:
        """The category holding the most bytes at the peak."""
        return max(self.breakdown, key=self.breakdown.__getitem__)

    def to_dict(self) -> dict:
        return {
            "world_size": self.world_size,
            "peak": self.peak,
            "peak_op": self.peak_op,
            "peak_node": self.peak_node,
            "breakdown": dict(self.breakdown),
            "persistent": self.persistent,
            "scratch": dict(self.scratch),
            "units": [u.to_dict() for u in self.units],
            "ops": [op.to_dict() for op in self.ops],
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    def summary_text(self) -> str:
        """The peak, where it is, and what it is made of (largest first)."""
        where = f"op {self.peak_op}" if self.peak_op is not None else "the graph's inputs"
        lines = [f"memory peak: {human_bytes(self.peak)} per rank, during {where} (node {self.peak_node}); "
                 f"persistent {human_bytes(self.persistent)}"]
        for name, nbytes in sorted(self.breakdown.items(), key=lambda kv: -kv[1]):
            if nbytes:
                share = 100 * nbytes / self.peak if self.peak else 0.0
                lines.append(f"  {name:<20}{human_bytes(nbytes):>12}{share:>7.1f}%")
        return "\n".join(lines + self.units_lines())

    def units_lines(self) -> list[str]:
        """Per unit: its recompute policy, the activation bytes it keeps for backward and those it recomputes."""
        shown = [u for u in self.units if u.kept or u.recomputed]
        if not shown:
            return []
        width = max(12, *(len(u.unit or "<root>") + 2 for u in shown))
        lines = ["activations per unit (kept from forward to backward; recomputed in backward):",
                 f"  {'unit':<{width}}{'recompute':<11}{'kept':>12}{'recomputed':>12}"]
        for u in shown:
            lines.append(f"  {u.unit or '<root>':<{width}}{u.policy:<11}{human_bytes(u.kept):>12}"
                         f"{human_bytes(u.recomputed):>12}")
        return lines


def plan_memory(gm: fx.GraphModule, schedule: Schedule, inputs: tuple[GraphInput, ...], *,
                scratch=None) -> MemoryPlan:
    """Simulate one step of ``gm`` (Note [liveness]) and attribute its bytes to ``schedule``'s ops.

    ``inputs`` is the graph's input signature (`CompileContext.inputs`);
    ``scratch`` the backend's in-flight copies in payloads per collective kind
    (Note [collective scratch]): a dict, or a function of a collective's group
    size that returns one; `gloo_scratch` by default, `NO_SCRATCH` for NCCL.
    """
    if scratch is None:
        scratch = gloo_scratch
    if not callable(scratch):
        scratch = {**NO_SCRATCH, **scratch}
    shown = scratch(schedule.world_size) if callable(scratch) else scratch
    sim = _Simulator(gm, inputs, scratch)
    op_of = {name: op.index for op in schedule.ops for name in op.node_names}
    nodes = sim.run(op_of)
    ops = _per_op(schedule, nodes, sim)
    peak_i = max(range(len(nodes)), key=lambda i: nodes[i].during)
    peak = nodes[peak_i]
    return MemoryPlan(
        world_size=schedule.world_size, peak=peak.during, peak_op=peak.op, peak_node=peak.name,
        breakdown=sim.breakdown_during[peak_i], persistent=sim.persistent, ops=ops, nodes=tuple(nodes),
        scratch=dict(shown), units=_units(schedule, sim),
    )


def _units(schedule: Schedule, sim: "_Simulator") -> tuple[UnitActivations, ...]:
    """Note [activations per unit], in the order of the units' flat parameters."""
    policies = schedule.options.get("recompute", {})
    names = dict.fromkeys(f.unit for f in schedule.flats)
    names.update(dict.fromkeys(sim.kept_by_unit))
    return tuple(UnitActivations(unit, policies.get(unit or "<root>", "none"), sim.kept_by_unit.get(unit, 0),
                                 sim.recomputed_by_unit.get(unit, 0)) for unit in names)


def _per_op(schedule: Schedule, nodes: list[NodeMemory], sim: "_Simulator") -> tuple[OpMemory, ...]:
    index = {n.name: i for i, n in enumerate(nodes)}
    out = []
    live = sim.persistent
    for op in schedule.ops:
        members = [index[name] for name in op.node_names if name in index]
        if not members:  # an op the plan cannot see into: nothing changes
            out.append(OpMemory(op.index, live, live, "", 0, 0, {}))
            continue
        top = max(members, key=lambda i: nodes[i].during)
        live = nodes[members[-1]].after
        out.append(OpMemory(
            index=op.index, live_after=live, peak=nodes[top].during, peak_node=nodes[top].name,
            allocated=sum(nodes[i].allocated for i in members), freed=sum(nodes[i].freed + nodes[i].released for i in members),
            breakdown=sim.breakdown_during[top],
        ))
    return tuple(out)


def _storages(val) -> list[tuple[StorageWeakRef, int]]:
    """The distinct storages a node's value holds, with their bytes."""
    out, seen = [], set()
    for leaf in pytree.tree_leaves(val):
        if isinstance(leaf, torch.Tensor):
            storage = leaf.untyped_storage()
            key = StorageWeakRef(storage)
            if key not in seen:
                seen.add(key)
                out.append((key, storage.nbytes()))
    return out


class _Simulator:
    """Replays the graph's allocations and frees in node order (Note [liveness])."""

    def __init__(self, gm: fx.GraphModule, inputs: tuple[GraphInput, ...], scratch):
        self.graph = gm.graph
        self.nodes = list(gm.graph.nodes)
        self.inputs = inputs
        self.scratch = scratch
        self.persistent = 0
        self.breakdown_during: list[dict[str, int]] = []
        self.kept_by_unit: dict[str, int] = {}  # Note [activations per unit]
        self.recomputed_by_unit: dict[str, int] = {}
        self._storages: dict[fx.Node, list[tuple[StorageWeakRef, int]]] = {}

    def _storages_of(self, node: fx.Node) -> list[tuple[StorageWeakRef, int]]:
        """`_storages` of ``node``'s value, found once: the categories and the replay both read them."""
        found = self._storages.get(node)
        if found is None:
            found = self._storages[node] = _storages(node.meta.get("val"))
        return found

    def run(self, op_of: dict[str, int]) -> list[NodeMemory]:
        pos = {n: i for i, n in enumerate(self.nodes)}
        dies_at: dict[int, list[fx.Node]] = {}
        for node in self.nodes:
            if node.op == "placeholder":
                continue  # the caller holds the inputs for the whole step
            last = max(map(pos.__getitem__, node.users)) if node.users else pos[node]
            dies_at.setdefault(last, []).append(node)
        category = self._categories()
        size: dict[StorageWeakRef, int] = {}
        refs: dict[StorageWeakRef, int] = {}
        held: dict[fx.Node, list[StorageWeakRef]] = {}
        live = {c.value: 0 for c in Category}
        scratch_until: dict[fx.Node, tuple[int, int]] = {}  # wait node -> (bytes, bytes that outlive it by a node)
        late: dict[fx.Node, int] = {}  # node -> scratch bytes that outlived a wait and go as this node starts
        records = []
        made_by: dict[StorageWeakRef, fx.Node] = {}
        for node in self.nodes:  # Note [kept buffers in the plan]: held since the step before, as the pool's slots
            if is_kept(node) or kind_of(node) is NodeKind.SLOT:
                for key, nbytes in self._storages_of(node):
                    if key not in size:
                        size[key], refs[key], made_by[key] = nbytes, 0, node
                        live[category[key].value] += nbytes
                        self.persistent += nbytes
        in_backward = False
        for i, node in enumerate(self.nodes):
            if not in_backward and phase_of(node) is Phase.BACKWARD:
                in_backward = True
                self._count_kept(refs, size, category, made_by)
            allocated = 0
            keys = []
            for key, nbytes in self._storages_of(node):
                if key in keys:
                    continue
                keys.append(key)
                if key not in size:
                    size[key] = nbytes
                    refs[key] = 0
                    live[category[key].value] += nbytes
                    allocated += nbytes
                    made_by[key] = node
                    recompute = tag_of(node, "recompute")
                    if recompute is not None:
                        self.recomputed_by_unit[recompute] = self.recomputed_by_unit.get(recompute, 0) + nbytes
                refs[key] += 1
            held[node] = keys
            if node.op == "placeholder":
                self.persistent += allocated
            allocated += self._issue(node, live, scratch_until)
            following = self.nodes[i + 1] if i + 1 < len(self.nodes) else None
            released = self._retire(node, live, scratch_until, late, following)
            during = sum(live.values())
            self.breakdown_during.append(dict(live))
            freed = 0
            for dead in dies_at.get(i, ()):
                for key in held.pop(dead, ()):
                    refs[key] -= 1
                    if refs[key] == 0 and category[key] not in PERSISTENT:
                        live[category[key].value] -= size[key]
                        freed += size[key]
            records.append(NodeMemory(node.name, op_of.get(node.name), allocated, freed, during, sum(live.values()),
                                      released))
        return records

    def _count_kept(self, refs, size, category, made_by) -> None:
        """The activations live as backward starts, by the unit that made them (Note [activations per unit])."""
        for key, count in refs.items():
            if count > 0 and category[key] is Category.ACTIVATIONS:
                unit = tag_of(made_by[key], "unit")
                if unit is not None:
                    self.kept_by_unit[unit] = self.kept_by_unit.get(unit, 0) + size[key]

    def _issue(self, node: fx.Node, live: dict, scratch_until: dict) -> int:
        kind = kind_of(node)
        if kind is None or not kind.is_collective:
            return 0
        payload_node = node if kind is NodeKind.ALL_GATHER else node.args[0]
        payload = sum(n for _, n in self._storages_of(payload_node))
        extra = int(_scale(self.scratch, kind.value, _group_size(node)) * payload)
        waits = [u for u in node.users if kind_of(u) is not None and kind_of(u).is_wait]
        if not extra or not waits:
            return 0
        live[Category.COLLECTIVE_SCRATCH.value] += extra
        lingering = int((1 - 1 / (_group_size(node) or 1)) * payload) if kind is NodeKind.REDUCE_SCATTER else 0
        lingering = min(extra, lingering)
        scratch_until[waits[0]] = (extra, lingering)
        return extra

    @staticmethod
    def _retire(node: fx.Node, live: dict, scratch_until: dict, late: dict, following: fx.Node | None) -> int:
        """A wait returns once the collective is done and its scratch is gone (Note [collective scratch]).

        Part of a reduce-scatter's scratch outlives its wait by one node: on gloo it runs as an all-to-all
        whose full-size result the wait returns and the local sum right after it consumes.
        """
        released = late.pop(node, 0)
        extra, lingering = scratch_until.pop(node, (0, 0))
        if following is None:
            lingering = 0
        released += extra - lingering
        if lingering:
            late[following] = late.get(following, 0) + lingering
        live[Category.COLLECTIVE_SCRATCH.value] -= released
        return released

    def _categories(self) -> dict[StorageWeakRef, Category]:
        """Each storage's category, from the node that first holds it (and the gradients' consumers)."""
        category: dict[StorageWeakRef, Category] = {}
        placeholders = [n for n in self.nodes if n.op == "placeholder"]
        for spec, node in zip(self.inputs, placeholders):
            for key, _ in self._storages_of(node):
                category.setdefault(key, _ROLE_CATEGORY[spec.role])
        for node in placeholders[len(self.inputs):]:
            for key, _ in self._storages_of(node):
                category.setdefault(key, Category.INPUTS)
        for node in self.nodes:
            if node.op == "placeholder":
                continue
            for key, _ in self._storages_of(node):
                category.setdefault(key, Category.REDUCTION_BUFFERS if is_kept(node) else
                                    Category.BUFFER_POOL if kind_of(node) is NodeKind.SLOT else _node_category(node))
        for node in self.nodes:  # what a reduction packs, or an update reads by member, is a parameter gradient
            if kind_of(node) is NodeKind.PACK:
                gradients = node.all_input_nodes
            elif node.target is update_members_:  # Note [updates from member gradients]
                gradients = [g for g in member_gradients_of(node) if isinstance(g, fx.Node)]
            else:
                continue
            for arg in gradients:
                for key, _ in self._storages_of(arg):
                    if category.get(key) in (Category.TEMPORARIES, Category.ACTIVATIONS):
                        category[key] = Category.GRADIENT_BUFFERS
        return category


def _group_size(node: fx.Node) -> int | None:
    """The ranks a collective node runs over (its group, not necessarily the world)."""
    group_of = getattr(collectives, "group_of", None)
    found = group_of(node) if group_of is not None else None
    if found is not None:
        return found[1]
    size = node.args[2] if len(node.args) > 2 else None
    return size if isinstance(size, int) else None


def _scale(scratch, kind: str, group_size: int | None) -> float:
    """``scratch[kind]``, or, when ``scratch`` is a function of the group size (`gloo_scratch`), its value there."""
    if callable(scratch):
        return scratch(group_size or 1).get(kind, 0.0)
    return scratch.get(kind, 0.0)


_GRADIENT_SHARD_KINDS = (NodeKind.REDUCE_SCATTER, NodeKind.ALL_REDUCE, NodeKind.WAIT_REDUCE, NodeKind.AVERAGE)


def _node_category(node: fx.Node) -> Category:
    tag = node_tag(node)
    kind = tag.kind if tag is not None else None
    if kind is NodeKind.UNPACK or gathers_parameters(node):
        return Category.GATHERED
    if kind is NodeKind.PACK:
        return Category.GRADIENT_BUFFERS
    if tag is not None and tag.flat is not None and kind in _GRADIENT_SHARD_KINDS:
        return Category.GRADIENT_SHARDS
    if phase_of(node) is Phase.FORWARD or tag_of(node, "recompute") is not None:  # made in forward, or again
        return Category.ACTIVATIONS
    return Category.TEMPORARIES
