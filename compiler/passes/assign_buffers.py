"""Give each gathered buffer and each gradient pack a slot of the step's pool (Note [buffer assignment]).

Candidates: every ``all_gather`` of a flat shard over more than one rank (its
full-size result; a tensor axis's gathers of shaped activations are left out,
since a slot is flat), every flat-sharded member that ``unpack_member`` copies out of it,
and every ``pack_gradients`` or ``pack_whole_gradients`` that makes a buffer
of its own read by a reduce-scatter over more than one rank. A candidate's life runs from its node
to the last use of any value in its storage (a view, an unpacked member), and,
for a buffer a collective reads, to that collective's wait: the collective
reads it until then. Candidates of one size and dtype are assigned slots in
order of their start, each to a slot whose last occupant is dead by then (an
interval colouring: as many slots as the most of that size alive at once).

Not candidates: ZeRO-1's gathers of updated shards (they write into the
parameter itself), the packs already kept for an all-reduce (Note [kept
reduction buffers]), a pack that is a view of one gradient, and everything
under the inductor backend (it plans its own buffers).

Before: gathers are ``all_gather(shard, axis, N)``, packs ``pack_gradients(...)``.
After: one `buffer_slot` node per slot after the placeholders (kind SLOT); each
assigned gather is ``all_gather_into(shard, slot, axis, N)``, each assigned
unpack ``unpack_member_into(..., slot)`` and each assigned pack its
``..._into(slot, ...)`` form; values propagated again, so each assigned
value (and its views) shares its slot's storage. Tags, waits and frees are
unchanged.

Invariant: two candidates that share a slot never overlap in life; nothing
reads a slot's previous occupant after the next one is written.
"""

from __future__ import annotations

import collections

import attrs
import torch
import torch.fx as fx

from shardlang.spec.vocabulary import StepBackend
from ..context import CompileContext
from ..ir import collectives
from ..ir.graph_utils import storage_key, tensor_leaves
from ..ir.shapes import ShapeMemo, propagate_shapes, remember_shapes
from ..ir.tags import NodeKind, kind_of, tag
from ..ir.trace import Phase
from ..layout.buffers import buffer_slot
from ..layout.flat import (pack_gradients, pack_gradients_into, pack_whole_gradients, pack_whole_gradients_into,
                           unpack_member, unpack_member_into)
from ..layout.placement import LayoutKind
from .contract import GraphProperty, graph_pass


#: Each pack a slot can hold, and its form that writes into the slot.
_POOLED_PACKS = {pack_gradients: pack_gradients_into, pack_whole_gradients: pack_whole_gradients_into}


@attrs.frozen
class Life:
    """One candidate buffer: its node, its size class, and the graph positions it lives between.

    ``end`` is the last position that reads it (a collective's wait, for a buffer a collective reads);
    ``freed`` the last node that holds it, after which the step without the pool frees it.
    """

    node: fx.Node
    numel: int
    dtype: torch.dtype
    start: int
    end: int
    freed: int = -1


@graph_pass(requires={GraphProperty.REDUCTIONS_IN_PLACE, GraphProperty.GATHERS_FREED},
            establishes={GraphProperty.BUFFERS_ASSIGNED})
def assign_buffers(gm: fx.GraphModule, ctx: CompileContext, slots: dict[str, int] | None = None,
                   memo: ShapeMemo | None = None) -> fx.GraphModule:
    """Pool the candidates of ``gm``: by ``slots`` (node name -> slot, as `compile_step` chose them with
    `analysis.pool_choice`), or every candidate by `assign_slots`.

    ``memo``, the trace's shape memo, spares the propagation the nodes it already knows (Note [incremental
    shapes])."""
    if not pools_buffers(ctx):
        return gm
    if slots is None:
        slots = {node.name: index for node, index in assign_slots(candidate_lives(gm.graph)).items()}
    if not slots:
        return gm
    remember_shapes(gm, memo)
    _rewrite(gm.graph, {node: slots[node.name] for node in gm.graph.nodes if node.name in slots})
    gm.recompile()
    return propagate_shapes(gm, ctx)


def pools_buffers(ctx: CompileContext) -> bool:
    """Whether the step may pool its buffers: asked for, eager, more than one rank."""
    return ctx.buffer_pool and ctx.backend is StepBackend.EAGER and ctx.mesh.size > 1


def candidate_lives(graph: fx.Graph) -> list[Life]:
    """The buffers a slot can hold, each with its life, in graph order."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    holders: dict = collections.defaultdict(list)  # storage -> the nodes whose value lies in it
    for node in nodes:
        for t in tensor_leaves(node.meta.get("val")):
            holders[storage_key(t)].append(node)
    lives = []
    for node in nodes:
        if not _is_candidate(node):
            continue
        val = node.meta["val"]
        freed = end = pos[node]
        for holder in holders[storage_key(val)]:
            for user in holder.users:
                freed = max(freed, pos[user])
                end = max(end, pos[user], *(pos[w] for w in _waits_of_collective_reading(user, holder)))
        lives.append(Life(node, val.numel(), val.dtype, pos[node], end, freed))
    return lives


def assign_slots(lives: list[Life]) -> dict[fx.Node, int]:
    """Each candidate's slot: per size class, the first slot free by its start (slot numbers run over classes)."""
    slots: dict[fx.Node, int] = {}
    free_after: dict[tuple[int, torch.dtype], list[list[int]]] = collections.defaultdict(list)  # [slot, end]
    count = 0
    for life in sorted(lives, key=lambda life: life.start):
        held = free_after[(life.numel, life.dtype)]
        reusable = next((h for h in held if h[1] < life.start), None)
        if reusable is None:
            reusable = [count, life.end]
            count += 1
            held.append(reusable)
        reusable[1] = life.end
        slots[life.node] = reusable[0]
    return slots


def _is_candidate(node: fx.Node) -> bool:
    if node.target is collectives.all_gather:  # a slot is flat: a shaped gather (tp's of an activation) is not one
        return collectives.over_ranks(node) and node.args[0].meta["val"].dim() == 1
    if node.target is unpack_member:  # a flat member copied out of its gathered buffer
        return node.args[4] == LayoutKind.SHARD_FLAT.value and _owns_its_buffer(node)
    if kind_of(node) is not NodeKind.PACK or node.target not in _POOLED_PACKS or len(node.users) != 1:
        return False
    (user,) = node.users
    return user.target is collectives.reduce_scatter and collectives.over_ranks(user) and _owns_its_buffer(node)


def _owns_its_buffer(node: fx.Node) -> bool:
    """Whether ``node``'s value is a buffer of its own, not a view of an input's."""
    val = node.meta.get("val")
    taken = {storage_key(t) for a in node.all_input_nodes for t in tensor_leaves(a.meta.get("val"))}
    return isinstance(val, torch.Tensor) and storage_key(val) not in taken


def _waits_of_collective_reading(user: fx.Node, holder: fx.Node) -> list[fx.Node]:
    """The waits of ``user`` when it is a collective that reads ``holder``'s storage until they run."""
    kind = kind_of(user)
    if kind is None or not kind.is_collective or user.args[0] is not holder:
        return []
    return [w for w in user.users if kind_of(w) is not None and kind_of(w).is_wait]


def _rewrite(graph: fx.Graph, slots: dict[fx.Node, int]) -> None:
    """One `buffer_slot` node per slot after the placeholders; each candidate writes into its slot."""
    first = next(n for n in graph.nodes if n.op != "placeholder")
    like = next(n for n in graph.nodes if n.op == "placeholder")
    slot_nodes: dict[int, fx.Node] = {}
    for node, index in sorted(slots.items(), key=lambda item: item[1]):
        if index not in slot_nodes:
            val = node.meta["val"]
            with graph.inserting_before(first):
                slot_nodes[index] = tag(graph.call_function(buffer_slot, (index, val.numel(), val.dtype, like)),
                                        NodeKind.SLOT, None, Phase.FORWARD, detail=f"slot {index}")
    for node, index in slots.items():
        slot = slot_nodes[index]
        if node.target is collectives.all_gather:
            shard, axis, size = node.args
            node.target, node.args = collectives.all_gather_into, (shard, slot, axis, size)
        elif node.target is unpack_member:  # the slot last: readers of the unpack's arguments keep their places
            node.target, node.args = unpack_member_into, (*node.args, slot)
        else:
            node.target, node.args = _POOLED_PACKS[node.target], (slot, *node.args)
