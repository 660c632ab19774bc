"""Propagation: from the placements of the parameters and the batch to every value's, on one tensor axis.

`propagate` is a pure function of the traced logical step (`compiler.ir.trace`)
and each member parameter's placement on the axis. It walks the graph once, in
order, and for each call picks the cheapest strategy its rule offers
(`compiler.placement.strategy.choose`), recording where an argument must first
be redistributed. What it returns, a `PlacementPlan`, says for every node its
placement and the local arguments it runs with; `compiler.placement.localize`
turns that into the graph each rank runs. Passes read a plan; none recomputes one.

The flat parameters are the one place a value is no block of its logical self
(Note [flats on a tensor axis]): a flat and its optimizer state are `Packed`;
a member sliced out of it is `Flattened` by the member's placement, and viewed
to its shape has exactly that placement. A member's gradient is brought to the
member's placement before it is flattened into the flat gradient, which is how a
gradient that came out partial (a replicated parameter used on sharded
activations) is reduced over the axis.

Note [flats on a tensor axis]: each rank's flat holds its local block of every
member, in member order, with no gaps: the local offset of a member is the sum
of the local sizes of the members before it. `FlatLayout` computes those.
"""

from __future__ import annotations

import math
import operator
import types
from collections.abc import Mapping

import attrs
import torch
import torch.fx as fx

from shardlang.errors import CompileError
from ..ir.provenance import site_of_node
from ..ir.trace import GraphInput, InputRole, tag_of
from .placements import REPLICATE, Flattened, Packed, Partial, Placement, Replicate, Shard, local_shape
from .rules import has_rule, strategies_of
from .strategy import OpCall, Strategy, choose, tensor_leaves

__all__ = ["FlatLayout", "MemberSlot", "PlacementPlan", "Redistribution", "propagate"]

aten = torch.ops.aten


@attrs.frozen
class MemberSlot:
    """One member of a flat on the axis: its logical shape and placement, and where its local block lies."""

    name: str
    shape: tuple[int, ...]
    placement: Replicate | Shard
    logical_offset: int
    local_offset: int
    local_numel: int


@attrs.frozen
class FlatLayout:
    """A flat parameter's members on the axis, in order (Note [flats on a tensor axis])."""

    flat: str
    members: tuple[MemberSlot, ...]

    @property
    def local_numel(self) -> int:
        return sum(m.local_numel for m in self.members)

    def member_at(self, logical_offset: int) -> MemberSlot | None:
        return next((m for m in self.members if m.logical_offset == logical_offset), None)

    def local_block(self, logical: torch.Tensor, coordinate: int, n: int) -> torch.Tensor:
        """The flat rank ``coordinate`` of ``n`` holds of the ``logical`` flat (or of its optimizer state).

        Example: ``layout.local_block(torch.arange(12.), 1, 2)`` is the second half of every
        member sharded on dim 0, and all of every replicated member, in member order.
        """
        blocks = []
        for m in self.members:
            value = logical[m.logical_offset:m.logical_offset + math.prod(m.shape)].view(m.shape)
            if isinstance(m.placement, Shard):
                value = value.chunk(n, m.placement.dim)[coordinate]
            blocks.append(value.reshape(-1))
        return torch.cat(blocks) if blocks else logical[:0].clone()


@attrs.frozen
class Redistribution:
    """Argument ``arg`` of node ``consumer`` must go from ``source`` to ``target`` before the call."""

    consumer: str
    arg: str
    shape: tuple[int, ...]
    source: Placement
    target: Placement


@attrs.frozen
class PlacementPlan:
    """Every node's placement on one axis, the strategy it runs with, and the redistributions before calls."""

    axis: str
    size: int
    placements: Mapping[str, Placement | tuple]  # node name -> placement (a tuple for a multi-output op)
    strategies: Mapping[str, Strategy]  # node name -> the strategy chosen (local arguments included)
    redistributions: tuple[Redistribution, ...]
    flats: Mapping[str, FlatLayout]  # flat name -> its members' local layout
    sequence_dim: int | None = None  # activations' dim split between tp regions (Note [sequence shards])
    loss_parallel: bool = False  # the loss may run on vocabulary blocks (Note [loss parallelism])

    def placement(self, node: fx.Node | str):
        return self.placements[node if isinstance(node, str) else node.name]


def propagate(traced, member_placements: Mapping[str, Placement], axis: str, size: int,
              sequence_dim: int | None = None, loss_parallel: bool = False) -> PlacementPlan:
    """Place every value of ``traced`` (a `TracedStep`) on ``axis`` of ``size`` ranks.

    ``member_placements`` maps member names (``"layers.0.attention.wq.weight"``)
    to `Shard` or `Replicate`; members it leaves out are replicated. The batch,
    buffers, the step count and hyperparameters are replicated on the axis.
    ``sequence_dim`` (sequence parallelism): a partial activation is reduce-scattered
    along this dim where that serves (Note [sequence shards] in `compiler.placement.strategy`).
    ``loss_parallel``: the loss may run on logits split by vocabulary (Note [loss
    parallelism] in `compiler.placement.rules.loss`).

    Example::

        plan = propagate(traced, {"blocks.0.mlp.fc1.weight": Shard(0), "blocks.0.mlp.fc2.weight": Shard(1)},
                         "tp", 2)
        plan.placement("mm")          # Shard(1): the first linear's output is column-parallel
    """
    if size == 1:  # one rank holds everything: every placement is the whole value
        member_placements = {}
    return _Propagation(traced, member_placements, axis, size, sequence_dim, loss_parallel).run()


class _Propagation:
    def __init__(self, traced, member_placements, axis, size, sequence_dim, loss_parallel):
        self.graph = traced.graph_module.graph
        self.inputs: tuple[GraphInput, ...] = traced.inputs
        self.seeds = dict(member_placements)
        self.axis, self.n = axis, size
        self.sequence_dim, self.loss_parallel = sequence_dim, loss_parallel
        self.placements: dict[str, object] = {}
        self.strategies: dict[str, Strategy] = {}
        self.redistributions: list[Redistribution] = []
        self.available: dict[str, set] = {}  # value -> placements an earlier redistribution made of it
        self.parameters: set[str] = set()  # members and their views (Note [parameters stay put])
        self.flat_of_input: dict[str, str] = {}
        self.flats = self._flat_layouts()
        self.grad_member = self._gradient_members()
        self.wanted = self._gradient_demands()

    def run(self) -> PlacementPlan:
        for node in self.graph.nodes:
            if node.op == "placeholder":
                self.placements[node.name] = self._input_placement(node)
            elif node.op == "call_function":
                self._place_call(node)
            elif node.op == "output":
                self._place_output(node)
        return PlacementPlan(self.axis, self.n, types.MappingProxyType(self.placements),
                             types.MappingProxyType(self.strategies), tuple(self.redistributions),
                             types.MappingProxyType(self.flats), self.sequence_dim, self.loss_parallel)

    # -- the flats ------------------------------------------------------------------------------------

    def _placeholders(self) -> list[fx.Node]:
        return [n for n in self.graph.nodes if n.op == "placeholder"]

    def _flat_layouts(self) -> dict[str, FlatLayout]:
        slices: dict[str, list[tuple[int, str, tuple[int, ...]]]] = {}
        for node, spec in zip(self._placeholders(), self.inputs):
            if spec.role is InputRole.FLAT:
                self.flat_of_input[node.name] = spec.flat
                slices[spec.flat] = []
            elif spec.role is InputRole.STATE:
                self.flat_of_input[node.name] = spec.flat
        for node in self.graph.nodes:
            member = tag_of(node, "member")
            if member and node.target is aten.slice.Tensor and node.args[0].name in self.flat_of_input:
                view = next(u for u in node.users if u.target is aten.view.default)
                flat = self.flat_of_input[node.args[0].name]
                slices[flat].append((node.args[2], member, tuple(view.meta["val"].shape)))
        layouts = {}
        for flat, members in slices.items():
            slots, local = [], 0
            for offset, name, shape in sorted(members):
                placement = self._seed(name, shape)
                numel = math.prod(local_shape(shape, placement, self.n, f"parameter {name!r}"))
                slots.append(MemberSlot(name, shape, placement, offset, local, numel))
                local += numel
            layouts[flat] = FlatLayout(flat, tuple(slots))
        return layouts

    def _seed(self, name: str, shape: tuple[int, ...]) -> Replicate | Shard:
        placement = self.seeds.get(name, REPLICATE)
        if isinstance(placement, Shard) and placement.dim >= len(shape):
            raise CompileError(f"parameter {name!r} has shape {list(shape)}; {placement!r} on axis "
                               f"{self.axis!r} names dim {placement.dim}, and valid dims are 0..{len(shape) - 1}")
        return placement

    def _gradient_members(self) -> dict[str, MemberSlot]:
        """Each member gradient's flattening view (tagged ``grad_flat``) -> the member it is the gradient of."""
        found = {}
        for node in self.graph.nodes:
            flat = tag_of(node, "grad_flat")
            if flat and node.target is aten.cat.default and flat in self.flats:
                for view, slot in zip(node.args[0], self.flats[flat].members):
                    while view.target is aten._to_copy.default:  # mixed precision: cast after flattening
                        view = view.args[0]
                    found[view.name] = slot
        return found

    def _gradient_demands(self) -> dict[str, Placement]:
        """Note [gradients where their parameters are]: the placement each node on a member gradient's path should take.

        A gradient joins its flat in its parameter's placement. Walking back from
        each member gradient through calls read by nothing else, each node is
        asked for the placement under which its rule produces what its reader
        wants; `choose` takes that strategy among those of least cost. Without it,
        a product of replicated operands (the output head's weight gradient) is
        made whole and then cut to the rank's block: the same bytes moved, but n
        times the compute and a whole-size temporary. The move to what the reader
        wants is part of each strategy's price, so a replicated parameter's
        gradient that would come out partial (an embedding's, under sequence
        parallelism) is priced with its all-reduce, and gathering the activation
        gradient instead wins wherever that moves fewer bytes.
        """
        wanted: dict[str, Placement] = {}
        views = {n.name: n for n in self.graph.find_nodes(op="call_function", target=aten.view.default)}
        pending = [(views[name].args[0], slot.placement) for name, slot in self.grad_member.items()]
        while pending:
            node, placement = pending.pop()
            if node.op != "call_function" or node.name in wanted or not has_rule(node.target):
                continue
            wanted[node.name] = placement
            leaves = tensor_leaves(node)
            call = OpCall(node, tuple(REPLICATE for _ in leaves), self.n)
            chosen = next((s for s in strategies_of(call) if s.outputs[0] == placement), None)
            if chosen is None:
                continue
            for arg, want in zip(leaves, chosen.inputs):
                if isinstance(want, Shard) and len(arg.users) == 1:
                    pending.append((arg, want))
        return wanted

    def _input_placement(self, node: fx.Node):
        flat = self.flat_of_input.get(node.name)
        return Packed(flat) if flat is not None else REPLICATE

    # -- calls ----------------------------------------------------------------------------------------

    def _current(self, node: fx.Node) -> tuple:
        return tuple(self.placements[a.name] for a in tensor_leaves(node))

    def _place_call(self, node: fx.Node) -> None:
        if node.target is operator.getitem:
            parent = self.placements[node.args[0].name]
            self.placements[node.name] = parent[node.args[1]] if isinstance(parent, tuple) else parent
            return
        current = self._current(node)
        strategy = self._flat_strategy(node, current)
        if strategy is None:
            strategy = self._rule_strategy(node, current)
        for arg, have, want in zip(tensor_leaves(node), current, strategy.inputs):
            if have != want:
                self._redistribute(node, arg, have, want)
        self.strategies[node.name] = strategy
        if tag_of(node, "member") or (node.target in _VIEWS and all(a.name in self.parameters
                                                                     for a in node.all_input_nodes)):
            self.parameters.add(node.name)
        outputs = strategy.outputs
        self.placements[node.name] = outputs[0] if isinstance(node.meta.get("val"), torch.Tensor) else outputs

    def _flat_strategy(self, node: fx.Node, current: tuple) -> Strategy | None:
        """The strategies of the nodes that slice members out of flats and pack gradients into them."""
        if node.target is aten.slice.Tensor and current and isinstance(current[0], Packed):
            flat = self.flats.get(current[0].flat)
            slot = flat.member_at(node.args[2]) if flat is not None else None
            if slot is None or node.args[1] != 0:
                raise CompileError(f"{node.name} slices flat {current[0].flat!r} at {node.args[1:]} "
                                   "where no member starts; a flat is sliced only into its members")
            args = (node.args[0], 0, slot.local_offset, slot.local_offset + slot.local_numel)
            return Strategy(current, (Flattened(slot.shape, slot.placement),), args)
        if node.target is aten.view.default and current and isinstance(current[0], Flattened):
            inner = current[0]
            if tuple(node.meta["val"].shape) != inner.shape:
                return None
            return Strategy(current, (inner.inner,),
                            (node.args[0], list(local_shape(inner.shape, inner.inner, self.n, node.name))))
        slot = self.grad_member.get(node.name)
        if slot is not None:  # a member's gradient, viewed flat: first brought to the member's placement
            return Strategy((slot.placement,), (Flattened(slot.shape, slot.placement),))
        if node.target is aten.cat.default and tag_of(node, "grad_flat") in self.flats:
            return Strategy(current, (Packed(tag_of(node, "grad_flat")),))
        return None

    def _rule_strategy(self, node: fx.Node, current: tuple) -> Strategy:
        call = OpCall(node, current, self.n, self.loss_parallel)
        if not has_rule(node.target):
            if all(isinstance(p, Replicate) for p in current):
                return Strategy(current, tuple(REPLICATE for _ in call.out_shapes))
            raise self._error(node, current, "it has no sharding rule, and only replicated arguments run "
                                             "without one")
        strategies = _reduce_shared_partials(call, strategies_of(call), self.sequence_dim)
        chosen = choose(call, strategies, [self.available.get(a.name, ()) for a in call.leaves],
                        [a.name in self.parameters for a in call.leaves], prefer=self.wanted.get(node.name),
                        sequence_dim=self.sequence_dim)
        if chosen is None:
            raise self._error(node, current, "none of its strategies fits these arguments")
        return chosen

    def _redistribute(self, consumer: fx.Node, arg: fx.Node, have, want) -> None:
        """Record that ``consumer`` needs ``arg`` as ``want``; `localize` makes each (value, placement) once."""
        self.redistributions.append(Redistribution(consumer.name, arg.name, tuple(arg.meta["val"].shape), have, want))
        self.available.setdefault(arg.name, set()).add(want)

    def _place_output(self, node: fx.Node) -> None:
        for arg in tensor_leaves(node):
            have = self.placements[arg.name]
            if isinstance(have, (Partial, Shard)):  # what the step returns is whole on every rank
                self._redistribute(node, arg, have, REPLICATE)

    def _error(self, node: fx.Node, current: tuple, why: str) -> CompileError:
        args = ", ".join(f"{a.name}: {p!r}" for a, p in zip(tensor_leaves(node), current))
        site = site_of_node(node)
        where = f"\n  made at {site}" if site is not None else ""
        return CompileError(f"cannot place {node.target} ({node.name}) on axis {self.axis!r} of {self.n} ranks "
                            f"with arguments [{args}]: {why}{where}")


_VIEWS = {aten.t.default, aten.transpose.int, aten.permute.default, aten.view.default, aten.detach.default,
          aten.alias.default, aten._to_copy.default, aten.expand.default}


def _reduce_shared_partials(call: OpCall, strategies: list[Strategy], sequence_dim: int | None) -> list[Strategy]:
    """Drop the strategies that keep a partial argument partial when other calls read it too.

    Note [reduce shared partials]: a partial sum may flow on through linear ops
    (views, sums, scaling) and be reduced later, but a partial read by several
    calls would be reduced once on each path. Reduced where it fans out, it is
    reduced once, and each reader takes the replicated value: this is where
    Megatron's backward all-reduce sits, on the gradient of a norm's output.
    Under sequence parallelism it may be reduce-scattered to its sequence shard
    instead, which the other readers then take as it is.
    """
    shared = [i for i, (a, p) in enumerate(zip(call.leaves, call.placements))
              if isinstance(p, Partial) and len(a.users) > 1]
    if not shared:
        return strategies
    reduced = (REPLICATE,) if sequence_dim is None else (REPLICATE, Shard(sequence_dim))
    kept = [s for s in strategies if all(s.inputs[i] in reduced for i in shared)]
    return kept or strategies
