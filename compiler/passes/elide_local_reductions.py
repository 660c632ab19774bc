"""Drop the pack and the identity reduction of a gradient nothing reduces: the update reads member gradients.

Before: every trainable flat parameter's gradient is packed (`flat.pack_gradients`,
`flat.flatten_gradients`, `flat.pack_whole_gradients`), reduced by a collective
and waited for (`reduce_gradients`), and the optimizer's ops read the result
(`shard_optimizer` has given every node its final shape).
After: where that collective is over one rank (a world of one), the pack is a
pure concatenation (no cast, no padding) and every reader of the reduced
gradient is an in-place elementwise op whose other tensor arguments are flat
sized or 0-d, each reader is replaced by an `update_members_` call that runs it
member by member on the member gradients, under the reader's name and meta;
the pack, the collective, its wait and their aliases are gone (Note [updates
from member gradients] in `compiler.layout.member_updates`). Any other flat is left
as it was.

Invariant: a pack feeding a collective over one rank is read by something
other than in-place elementwise updates (a norm, a cast, an accumulation); the
values every node computes are those of the graph before, to the bit.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..ir import collectives
from shardlang.spec.vocabulary import StepBackend
from ..context import CompileContext
from ..layout.flat import flatten_gradients, pack_gradients, pack_whole_gradients
from ..layout.member_updates import FLAT, GRAD, SAME, update_members_
from .contract import GraphProperty, graph_pass

_aten = torch.ops.aten

#: In-place elementwise ops that may read the flat gradient in any argument but the first (the one written).
_ELEMENTWISE_INPLACE = frozenset({
    _aten.lerp_.Scalar, _aten.lerp_.Tensor, _aten.addcmul_.default, _aten.addcdiv_.default,
    _aten.add_.Tensor, _aten.sub_.Tensor, _aten.mul_.Tensor, _aten.div_.Tensor, _aten.copy_.default,
})
_PACKS = (pack_gradients, flatten_gradients, pack_whole_gradients)


@graph_pass(requires={GraphProperty.GRADIENTS_REDUCED, GraphProperty.OPTIMIZER_SHARDED},
            establishes={GraphProperty.LOCAL_REDUCTIONS_ELIDED})
def elide_local_reductions(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    if ctx.mesh.size != 1:
        return gm  # every reduction sums over more than one rank (Note [updates from member gradients])
    if ctx.backend is not StepBackend.EAGER:
        return gm  # inductor fuses the pack into the update's kernels; member slices would cost it more (see Invariant)
    graph = gm.graph
    changed = False
    for pack in [n for n in graph.nodes if n.op == "call_function" and n.target in _PACKS]:
        chain = _local_chain(pack)
        readers = _readers(chain) if chain is not None else None
        if readers is None:
            continue
        spans, grads = _spans(pack), _member_gradients(pack)
        total = spans[-1][0] + spans[-1][1]
        for reader in readers:
            roles = tuple(_role(arg, chain, total) for arg in reader.args)
            args = tuple(None if role == GRAD else arg for role, arg in zip(roles, reader.args))
            with graph.inserting_before(reader):
                new = graph.call_function(update_members_, (reader.target, spans, roles, dict(reader.kwargs),
                                                            len(args), *args, *grads))
            new.meta = dict(reader.meta)  # the same value: the first argument, written in place
            reader.replace_all_uses_with(new)
            graph.erase_node(reader)
            new.name = reader.name  # the schedule's op and the profiler's range keep the update's own name
        for node in reversed(chain):  # aliases, wait, identity collective, pack: now unread
            graph.erase_node(node)
        changed = True
    if changed:
        gm.recompile()
    return gm


def _local_chain(pack: fx.Node) -> list[fx.Node] | None:
    """``[pack, collective, wait, *aliases]`` when ``pack`` feeds an identity (one-rank) reduction, else None.

    Only packs that are pure concatenations qualify: no dtype cast, no padding.
    """
    if _spans(pack) is None:
        return None
    chain = [pack]
    (issued,) = pack.users if len(pack.users) == 1 else (None,)
    group = collectives.group_of(issued) if issued is not None else None
    if group is None or group[1] != 1 or issued.target not in (collectives.reduce_scatter, collectives.all_reduce):
        return None
    (done,) = issued.users if len(issued.users) == 1 else (None,)
    if done is None or done.target is not collectives.wait:
        return None
    chain += [issued, done]
    while len(chain[-1].users) == 1 and next(iter(chain[-1].users)).target is _aten.alias.default:
        chain.append(next(iter(chain[-1].users)))
    return chain


def _readers(chain: list[fx.Node]) -> list[fx.Node] | None:
    """The ops that read the flat gradient, when every one of them can run member by member; else None."""
    inner, last = set(chain[:-1]), chain[-1]
    for node in chain[:-1]:
        if any(user not in inner and user is not last for user in node.users):
            return None
    total = sum(numel for _, numel in _spans(chain[0]))
    readers = list(last.users)
    for reader in readers:
        if reader.target not in _ELEMENTWISE_INPLACE or not reader.args or reader.args[0] is last:
            return None
        if any(_role(arg, chain, total) is None for arg in reader.args) or _role(reader.args[0], chain, total) != FLAT:
            return None
        if any(isinstance(v, fx.Node) for v in reader.kwargs.values()):
            return None
    return readers or None


def _role(arg, chain: list[fx.Node], total: int) -> str | None:
    """What ``arg`` of a reader is for `update_members_`; None when it cannot be split by member."""
    if arg is chain[-1]:
        return GRAD
    if not isinstance(arg, fx.Node):
        return SAME if isinstance(arg, (int, float, bool)) else None
    val = arg.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    if val.dim() == 0:
        return SAME
    if val.dim() == 1 and val.numel() == total:
        return FLAT
    return None


def _member_gradients(pack: fx.Node) -> list[fx.Node]:
    skip = 3 if pack.target is pack_gradients else 2 if pack.target is pack_whole_gradients else 1
    return list(pack.args[skip:])


def _spans(pack: fx.Node) -> tuple[tuple[int, int], ...] | None:
    """Each member gradient's ``(offset, numel)`` in the packed buffer; None when the pack casts or pads."""
    grads = _member_gradients(pack)
    numels = []
    for grad in grads:
        val = grad.meta.get("val") if isinstance(grad, fx.Node) else None
        if not isinstance(val, torch.Tensor):
            return None
        numels.append(val.numel())
    if pack.target is pack_gradients:
        world, specs, dtype = pack.args[:3]
        if dtype is not None or world != 1 or any(spec[2] != n for spec, n in zip(specs, numels)):
            return None
    elif pack.target is pack_whole_gradients:
        padded, dtype = pack.args[:2]
        if dtype is not None or padded != sum(numels):
            return None
    elif pack.args[0] is not None:
        return None
    offsets = [sum(numels[:i]) for i in range(len(numels))]
    return tuple(zip(offsets, numels)) or None
