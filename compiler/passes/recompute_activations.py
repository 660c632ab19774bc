"""Compute a unit's activations again just before its backward, instead of keeping them through the step.

Before: backward reads the values forward made (the saved activations)
directly, so every one of them lives from its forward node to its last backward
use. Forward nodes carry ``meta["custom"]["unit"]``, the innermost unit module
that ran them (`compiler.ir.trace`); parameters are already gathered
(`gather_parameters`).

After, for each unit whose policy in ``ctx.recompute`` is not NONE
(`shardlang.spec.vocabulary.Recompute`), and each micro-batch:
  - the unit's *internal* forward values (those no forward node outside the
    unit reads) that backward reads are made again by copies of their forward
    nodes, placed together, in forward order, right before the first backward
    node that reads any of them, and backward reads the copies. The originals
    then die in forward.
  - The copies read, and so keep, everything they do not copy: the unit's
    inputs, its outputs (the next unit's inputs), other units' values, the
    gathered parameters, the values of FSDP's collectives, and under SELECTIVE the
    outputs of matmuls and attention (`saved_by_selective`). The copies are
    backward nodes: `reshard_after_forward`, which runs next, puts the unit's
    backward re-gather before the first of them, so one gather serves the
    recompute and the backward (Note [one gather for recompute and backward]).
  - Note [replayed draws] (`compiler.ir.rng`): a random op among the copies draws
    from the generator state saved just before its forward original, so
    dropout masks are bitwise the forward's.
  - A unit whose forward mutates a value in place that the copies would read
    or write but not copy (BatchNorm's running statistics) cannot be recomputed
    without applying the mutation twice: that is a `CompileError` naming the node.

Note [one gather for recompute and backward]: FSDP2 with activation
checkpointing re-gathered a checkpointed region's parameters for its
recompute, and again for its backward. Here the recompute is part of the
unit's backward, so ZeRO-3 gathers a unit twice per step with or without
recompute, and ZeRO-2 once; `compiler.schedule.verify` checks that every parameter a
recompute reads is read by that unit's backward from the same gather.

Invariant: every copy carries ``meta["custom"]["recompute"]`` (its unit) and
phase backward; no backward node reads a recomputed value's forward original;
no copy is one of FSDP's collectives or waits (a tensor axis's redistributions of
activations are copied: Note [recomputed redistributions] in
`compiler.placement.localize`), or an in-place update of a value it did not copy.
"""

from __future__ import annotations

import functools
import operator

import torch
import torch.fx as fx

from ..context import CompileContext
from shardlang.errors import CompileError
from ..ir.graph_utils import positions
from ..ir.tags import NodeKind, is_inserted, node_tag, set_phase
from shardlang.spec.vocabulary import Recompute
from ..ir.rng import is_random, save_rng_state, with_rng_state
from ..ir.trace import Phase, phase_of, tag_of
from .contract import GraphProperty, graph_pass

_aten = torch.ops.aten

#: What SELECTIVE keeps: the outputs of matmuls and attention (torchtitan's op-level policy).
SAVED_BY_SELECTIVE = frozenset({
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
})


def saved_by_selective(node: fx.Node) -> bool:
    """Whether SELECTIVE keeps ``node``'s value: a matmul or attention output, or an item of one."""
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        return node.args[0].target in SAVED_BY_SELECTIVE
    return node.target in SAVED_BY_SELECTIVE


_REDISTRIBUTIONS = {NodeKind.ALL_GATHER, NodeKind.REDUCE_SCATTER, NodeKind.ALL_REDUCE, NodeKind.WAIT_GATHER,
                    NodeKind.WAIT_REDUCE}


@graph_pass(requires={GraphProperty.PARAMETERS_GATHERED},
            establishes={GraphProperty.ACTIVATIONS_RECOMPUTED},
            invalidates={GraphProperty.GATHERS_FREED, GraphProperty.GATHERS_PREFETCHED})
def recompute_activations(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    policies = {unit: p for unit, p in ctx.recompute.items() if p is not Recompute.NONE}
    if not policies:
        return gm
    graph = gm.graph
    for (unit, _microbatch), nodes in _regions(graph, policies).items():
        _recompute_region(graph, unit, nodes, policies[unit])
    gm.recompile()
    return gm


def recomputed_nodes(gm: fx.GraphModule, policies: dict[str, Recompute]) -> dict[str, list[fx.Node]]:
    """Per unit, the forward nodes this pass would copy under ``policies``, read off a graph compiled without them.

    The memory budget's search (`compiler.analysis.budget`) sums their cost to bound
    what recompute adds to a step before compiling it. Example:
    ``recomputed_nodes(step.graph_module, {"layers.0": Recompute.FULL})["layers.0"]``.
    """
    out: dict[str, list[fx.Node]] = {unit: [] for unit in policies}
    for (unit, _microbatch), nodes in _regions(gm.graph, policies).items():
        out[unit].extend(_copied(nodes, policies[unit])[1])
    return out


def _regions(graph: fx.Graph, policies: dict[str, Recompute]) -> dict[tuple[str, object], list[fx.Node]]:
    """The forward compute nodes of each recomputed unit, by (unit, micro-batch), in graph order."""
    regions: dict[tuple[str, object], list[fx.Node]] = {}
    for node in graph.nodes:
        unit = tag_of(node, "unit")
        if unit in policies and policies[unit] is not Recompute.NONE and _is_forward_compute(node):
            regions.setdefault((unit, tag_of(node, "microbatch")), []).append(node)
    return regions


def _copied(nodes: list[fx.Node], policy: Recompute) -> tuple[list[fx.Node], set[fx.Node]]:
    """Of one region: the internal values backward reads that ``policy`` does not keep, and all it must copy."""
    region = set(nodes)
    internal = {n for n in nodes if all(u in region or phase_of(u) is not Phase.FORWARD for u in n.users)}
    kept = (lambda n: saved_by_selective(n)) if policy is Recompute.SELECTIVE else (lambda n: False)  # noqa: E731
    read_by_backward = [n for n in nodes if n in internal and not kept(n) and any(_is_backward(u) for u in n.users)]
    return read_by_backward, (_needed(read_by_backward, internal, kept) if read_by_backward else set())


def _is_forward_compute(node: fx.Node) -> bool:
    """A forward node of the model's, or a tensor axis's redistribution of an activation (Note [recomputed
    redistributions] in `compiler.placement.localize`), which carries no flat."""
    if node.op != "call_function" or phase_of(node) is not Phase.FORWARD:
        return False
    return not is_inserted(node) or node_tag(node).flat is None and node_tag(node).kind in _REDISTRIBUTIONS


def _recompute_region(graph: fx.Graph, unit: str, nodes: list[fx.Node], policy: Recompute) -> None:
    """Copy what backward reads of one unit's forward (one micro-batch), before the first backward reader."""
    read_by_backward, copied = _copied(nodes, policy)
    if not read_by_backward:
        return
    order = positions(graph)
    _check_mutations(unit, copied, order)
    anchor = min((u for n in read_by_backward for u in n.users if _is_backward(u)), key=order.__getitem__)
    body = sorted(copied, key=order.__getitem__)
    copies: dict[fx.Node, fx.Node] = {}
    for node in body:
        if is_random(node):
            with graph.inserting_before(node):
                state = graph.call_function(save_rng_state, (_first_tensor_arg(node),))
            state.meta["custom"] = dict(node.meta.get("custom", {}))
        else:
            state = None
        with graph.inserting_before(anchor):
            copies[node] = _copy(graph, node, copies, unit, state)
    for node in body:
        for user in list(node.users):
            if _is_backward(user) and user not in copies.values():
                user.replace_input_with(node, copies[node])


def _is_backward(node: fx.Node) -> bool:
    return phase_of(node) is Phase.BACKWARD and tag_of(node, "recompute") is None


def _needed(roots: list[fx.Node], internal: set[fx.Node], kept) -> set[fx.Node]:
    """``roots`` and every internal value they are computed from that the policy does not keep."""
    needed, stack = set(roots), list(roots)
    while stack:
        for arg in stack.pop().all_input_nodes:
            if arg in internal and not kept(arg) and arg not in needed:
                needed.add(arg)
                stack.append(arg)
    return needed


#: Ops that write arguments their schema does not mark as written: (running_mean, running_var) in training.
_UNMARKED_WRITES = {_aten.native_batch_norm.default: (3, 4), _aten.cudnn_batch_norm.default: (3, 4),
                    _aten.miopen_batch_norm.default: (3, 4)}


@functools.lru_cache(maxsize=None)
def _may_write(target) -> bool:
    """Whether an op can write an argument in place (the cheap test before `_mutated_args`)."""
    return target in _UNMARKED_WRITES or getattr(getattr(target, "_schema", None), "is_mutable", False)


def _mutated_args(node: fx.Node) -> set[fx.Node]:
    """The arguments ``node`` writes in place (its schema's alias annotations, and `_UNMARKED_WRITES`)."""
    if node.target in _UNMARKED_WRITES and len(node.args) > 5 and node.args[5]:
        return {node.args[i] for i in _UNMARKED_WRITES[node.target] if isinstance(node.args[i], fx.Node)}
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return set()
    written = set()
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = node.kwargs.get(arg.name, node.args[i] if i < len(node.args) else None)
            if isinstance(value, fx.Node):
                written.add(value)
    return written


def _check_mutations(unit: str, copied: set[fx.Node], order: dict[fx.Node, int]) -> None:
    """Refuse a copy that would write in place to a value it does not copy (it would apply the write twice)."""
    for node in copied:
        outside = _mutated_args(node) - copied
        if outside:
            names = ", ".join(sorted(a.name for a in outside))
            raise CompileError(
                f"recompute of unit {unit or '<root>'!r}: its forward node {node.name} ({node.target}) writes {names} "
                "in place (BatchNorm's running statistics do this); recomputing it would apply the write twice. "
                f"Set recompute 'none' for this unit"
            )
        for arg in node.all_input_nodes:
            if arg in copied:
                continue
            writers = [u for u in arg.users if _may_write(u.target) and order[u] > order[node]
                       and phase_of(u) is Phase.FORWARD and arg in _mutated_args(u)]
            if writers:
                raise CompileError(
                    f"recompute of unit {unit or '<root>'!r}: {node.name} reads {arg.name}, which forward then "
                    f"writes in place ({writers[0].name}, {writers[0].target}); the recompute would read the "
                    "written value. Set recompute 'none' for this unit"
                )


def _first_tensor_arg(node: fx.Node) -> fx.Node:
    for arg in node.all_input_nodes:
        if isinstance(arg.meta.get("val"), torch.Tensor):
            return arg
    raise CompileError(f"recompute: random op {node.name} ({node.target}) has no tensor argument to find its device")


def _copy(graph: fx.Graph, node: fx.Node, copies: dict, unit: str, state: fx.Node | None) -> fx.Node:
    """``node`` again, on the copies of its inputs, tagged as a recompute backward node of ``unit``."""
    if state is None:
        new = graph.node_copy(node, lambda arg: copies.get(arg, arg))
    else:  # Note [replayed draws]
        args = fx.node.map_arg(node.args, lambda arg: copies.get(arg, arg))
        kwargs = fx.node.map_arg(node.kwargs, lambda arg: copies.get(arg, arg))
        new = graph.call_function(with_rng_state, (state, node.target, *args), kwargs)
        new.meta = dict(node.meta)
    set_phase(new, Phase.BACKWARD)
    new.meta["custom"]["recompute"] = unit
    return new
