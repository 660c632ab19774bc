"""Replace each sharded parameter by its local shard plus an all-gather before first use.

Before: a flat parameter's placeholder is the whole (logical) flat tensor and
each member parameter is a detached view of it.
After: the placeholder is this rank's shard (Note [shard layout] in
`compiler.layout.flat`). Right before the first forward use of any member, the pass
inserts ``all_gather -> wait -> unpack`` (one collective for the whole flat
parameter) and every use of a member's leaf reads the unpacked tensor instead:
a view of the gathered buffer in the whole layout, a copy of its pieces in the
pieces layout (Note [whole-flat shards]).
Flat parameters whose strategy keeps them whole on every rank (ZERO1, DDP)
are left as they are: forward reads its views of the placeholder.

Invariant for later passes: each sharded flat parameter has exactly one
``all_gather`` node (kind "all_gather"), one ``wait`` (kind "wait_gather") and one
``unpack`` node per member (kind "unpack", meta ``member``), all in forward.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..ir import collectives
from ..context import CompileContext
from ..layout.flat import unpack_member
from ..ir.graph_utils import first_user, placeholders_by_flat, positions
from ..ir.tags import NodeKind, tag
from ..ir.trace import Phase, tag_of
from .contract import GraphProperty, graph_pass


@graph_pass(establishes={GraphProperty.PARAMETERS_GATHERED})
def gather_parameters(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    graph = gm.graph
    leaves = _member_leaves(graph)
    placeholders = placeholders_by_flat(graph, ctx.inputs)
    for flat in ctx.flats:
        if not flat.params_sharded:
            continue
        flat_leaves = [leaves[m.name] for m in flat.members if m.name in leaves]
        order = positions(graph)
        anchor = first_user(flat_leaves, order)
        if anchor is None:
            continue  # no member is used at all: nothing to gather
        with graph.inserting_before(anchor):
            shard = placeholders[flat.name]
            if flat.param_dtype is not None:  # mixed precision: gather (and compute) in param_dtype
                cast = graph.call_function(torch.ops.prims.convert_element_type.default, (shard, flat.param_dtype))
                shard = tag(cast, NodeKind.CAST, flat.name, Phase.FORWARD)
            issued = tag(graph.call_function(collectives.all_gather, (shard, flat.axis, flat.world)),
                         NodeKind.ALL_GATHER, flat.name, Phase.FORWARD)
            gathered = tag(graph.call_function(collectives.wait, (issued,)), NodeKind.WAIT_GATHER, flat.name,
                           Phase.FORWARD)
            for member in flat.members:
                unpacked = graph.call_function(unpack_member, _unpack_args(gathered, member))
                tag(unpacked, NodeKind.UNPACK, flat.name, Phase.FORWARD, member=member.name)
                if member.name in leaves:
                    leaves[member.name].replace_all_uses_with(unpacked)
    collectives.eliminate_dead_code(graph)
    gm.recompile()
    return gm


def _member_leaves(graph: fx.Graph) -> dict[str, fx.Node]:
    """The node that is each member's autograd leaf: the last node the trace tagged with it."""
    leaves = {}
    for node in graph.nodes:
        member = tag_of(node, "member")
        if member is not None:
            leaves[member] = node
    return leaves


def _unpack_args(gathered: fx.Node, member) -> tuple:
    info = member.info
    return (gathered, member.world, member.offset, member.piece_numel, member.kind.value, member.dim,
            list(member.local_shape), list(info.shape))
