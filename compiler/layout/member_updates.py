"""Where nothing is reduced, the optimizer reads each member's own gradient instead of a packed copy.

Note [updates from member gradients]: a trainable flat parameter's gradient is
packed into one flat buffer (`flat.pack_gradients` and its kin) because a
collective needs one contiguous tensor. When that collective runs over a group
of one rank (a world of one) it is an identity, and the pack is only a copy of
every gradient: one read and one write of the whole parameter per step, about
4% of a 100M step at N = 1 and more where the step is short. The optimizer
update is elementwise (Note [elementwise updates] in `compiler.layout.optim`), so each
of its in-place ops that reads the flat gradient, ``exp_avg.lerp_(grad, w)``
say, can run member by member instead: on the member's slice of the flat
state, ``exp_avg[o:o+n]``, with the member's own gradient. Each element sees
the same op and the same operands, so the result is the same to the bit, and
the copy is gone.

The pass `passes.elide_local_reductions` makes that rewrite, last in the
pipeline, for every flat whose packed gradient reaches only such ops; any
other reader (a norm for clipping, a functional op such as L2 weight decay's
``grad.add(param)``, a cast for mixed precision, micro-batch accumulation)
keeps the pack for that flat, so the rewrite never changes what is computed.
Being a pass, the schedule, memory plan and verifier read the graph that runs:
an elided flat has no pack, no reduction and no wait in the plan (the verifier
and `compiler.analysis.formulas` accept no reduction for a trainable flat only in a
world of one), and its member gradients live until its update.

`update_members_` is what the rewritten graph calls.
"""

from __future__ import annotations

import torch
import torch.fx as fx

GRAD, FLAT, SAME = "grad", "flat", "same"  # what each argument of a rewritten op is (`update_members_`)
_VALUES = 5  # update_members_'s arguments before the op's own: op, spans, roles, kwargs, n_args


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
        op(*[grad.reshape(-1) if role == GRAD else arg.narrow(0, offset, numel) if role == FLAT else arg
             for role, arg in zip(roles, args)], **kwargs)
    return args[0]


def member_gradients_of(node: fx.Node) -> tuple:
    """The member gradients an `update_members_` node reads (the memory plan counts them as gradients)."""
    return node.args[_VALUES + node.args[4]:]


def written_in_place(node: fx.Node):
    """The argument an in-place node writes: ``args[0]`` of a mutable aten op, the flat one of `update_members_`.

    None for any other node (the schedule counts an optimizer op's elements by it).
    """
    if node.op != "call_function" or not node.args:
        return None
    if node.target is update_members_:
        return node.args[_VALUES]
    schema = getattr(node.target, "_schema", None)
    return node.args[0] if schema is not None and schema.is_mutable else None
