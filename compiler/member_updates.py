"""Where nothing is reduced, the optimizer reads each member's own gradient instead of a packed copy.

Note [updates from member gradients]: a trainable flat parameter's gradient is
packed into one flat buffer (`flat.pack_gradients` and its kin) because a
collective needs one contiguous tensor. When that collective runs over a group
of one rank (a world of one, or a mesh axis of size one for that flat) it is
an identity, and the pack is only a copy of every gradient: one read and one
write of the whole parameter per step, about 4% of a 100M step at N = 1 and
more where the step is short. The optimizer update is elementwise (Note
[elementwise updates] in `compiler.optim`), so each of its in-place ops that
reads the flat gradient, ``exp_avg.lerp_(grad, w)`` say, can run member by
member instead: on the member's slice of the flat state, ``exp_avg[o:o+n]``,
with the member's own gradient. Each element sees the same op and the same
operands, so the result is the same to the bit, and the copy is gone.

`update_from_member_gradients` makes that rewrite at emission, on the bound
graph, for every flat whose packed gradient reaches only such ops; any other
reader (a norm for clipping, a functional op such as L2 weight decay's
``grad.add(param)``, a cast for mixed precision, micro-batch accumulation)
keeps the pack for that flat, so the rewrite never changes what is computed.
The compiled graph, and the schedule, memory plan and verifier that read it,
are unchanged: they still describe the pack, which is an upper bound on what
the rewritten step allocates (the member gradients live until the update, as
the packed buffer did, and the transient of both at once is gone).
"""

from __future__ import annotations

import copy

import torch
import torch.fx as fx

from . import collectives
from .flat import flatten_gradients, pack_gradients, pack_whole_gradients

_aten = torch.ops.aten

#: In-place elementwise ops that may read the flat gradient in any argument but the first (the one written).
_ELEMENTWISE_INPLACE = frozenset({
    _aten.lerp_.Scalar, _aten.lerp_.Tensor, _aten.addcmul_.default, _aten.addcdiv_.default,
    _aten.add_.Tensor, _aten.sub_.Tensor, _aten.mul_.Tensor, _aten.div_.Tensor, _aten.copy_.default,
})
_PACKS = (pack_gradients, flatten_gradients, pack_whole_gradients)
_GRAD, _FLAT, _SAME = "grad", "flat", "same"


def update_members_(op, spans: tuple, roles: tuple, kwargs: dict, n_args: int, *values: torch.Tensor):
    """Run the in-place elementwise ``op`` once per member: on each member's slice of every flat-sized argument.

    ``values`` holds the op's ``n_args`` arguments, then one gradient per
    member; ``roles[i]`` says what argument i is: ``"grad"`` (the packed
    gradient: each call gets the member's own, flattened), ``"flat"`` (a flat
    tensor: each call gets ``narrow(0, offset, numel)`` of it) or ``"same"``
    (a 0-d tensor or a number, given as is). ``spans`` holds one ``(offset,
    numel)`` per member. Returns the first argument, as the in-place op would.

    Example: ``update_members_(aten.lerp_.Scalar, ((0, 6), (6, 3)), ("flat", "grad", "same"), {}, 3,
    exp_avg, None, 0.1, g0, g1)`` is ``exp_avg[:6].lerp_(g0.view(-1), 0.1); exp_avg[6:].lerp_(g1.view(-1), 0.1)``.
    """
    args, grads = values[:n_args], values[n_args:]
    for (offset, numel), grad in zip(spans, grads):
        op(*[grad.reshape(-1) if role == _GRAD else arg.narrow(0, offset, numel) if role == _FLAT else arg
             for role, arg in zip(roles, args)], **kwargs)
    return args[0]


def update_from_member_gradients(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm``, or a rewritten copy where Note [updates from member gradients] applies to some flat.

    Example::

        bound = update_from_member_gradients(bind(compiled.graph_module, None))   # a world of one
    """
    found = [chain for chain in map(_local_chain, gm.graph.nodes) if chain is not None]
    if not any(_readers(chain) is not None for chain in found):
        return gm
    out = copy.deepcopy(gm)
    graph = out.graph
    for pack in [n for n in graph.nodes if n.target in _PACKS]:
        chain = _local_chain(pack)
        readers = _readers(chain) if chain is not None else None
        if readers is None:
            continue
        spans, grads = _spans(pack), _member_gradients(pack)
        total = spans[-1][0] + spans[-1][1]
        for reader in readers:
            roles = tuple(_role(arg, chain, total) for arg in reader.args)
            args = tuple(None if role == _GRAD else arg for role, arg in zip(roles, reader.args))
            with graph.inserting_before(reader):
                new = graph.call_function(update_members_, (reader.target, spans, roles, dict(reader.kwargs),
                                                            len(args), *args, *grads))
            new.meta = dict(reader.meta)
            reader.replace_all_uses_with(new)
            graph.erase_node(reader)
            new.name = reader.name  # the schedule's ops name their nodes: the profiler's ranges still find it
        for node in reversed(chain):  # average, wait, identity collective, pack: now unread
            graph.erase_node(node)
    graph.lint()
    out.recompile()
    return out


def _local_chain(pack: fx.Node) -> list[fx.Node] | None:
    """``[pack, collective, wait, *aliases]`` when ``pack`` feeds an identity (one-rank) reduction, else None.

    Only packs that are pure concatenations qualify: no dtype cast, no padding.
    """
    if pack.op != "call_function" or pack.target not in _PACKS or _spans(pack) is None:
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
        if any(_role(arg, chain, total) is None for arg in reader.args) or _role(reader.args[0], chain, total) != _FLAT:
            return None
        if any(isinstance(v, fx.Node) for v in reader.kwargs.values()):
            return None
    return readers or None


def _role(arg, chain: list[fx.Node], total: int) -> str | None:
    """What ``arg`` of a reader is for `update_members_`; None when it cannot be split by member."""
    if arg is chain[-1]:
        return _GRAD
    if not isinstance(arg, fx.Node):
        return _SAME if isinstance(arg, (int, float, bool)) else None
    val = arg.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    if val.dim() == 0:
        return _SAME
    if val.dim() == 1 and val.numel() == total:
        return _FLAT
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
