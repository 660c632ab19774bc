"""Abstract collectives: the graph's communication nodes before process groups exist.

The compiler works against an abstract mesh (axis names and sizes). A gather in
the graph is ``all_gather(shard, axis, group_size)``; `emit.bind` later swaps
each of these targets for the matching ``torch.ops._c10d_functional`` op on a
real process group. Until then these functions compute shapes only, which is
what planning with fake tensors needs, and at group size 1 they are the exact
identity, which is how a world of one runs with no process group at all.

Each collective is issued by one node and completed by a separate ``wait`` node,
so that later passes can move the issue early (prefetch) and the wait late
(overlap). Note [collectives are effects]: fx considers functional collectives
pure and would delete one whose result looks unused, so every pass here removes
dead code only through `is_effectful`.
"""

from __future__ import annotations

import functools

import torch
from torch._subclasses.fake_tensor import FakeTensor

from shardlang.errors import CompileError


def _abstract_only(name: str, x: torch.Tensor, group_size: int) -> None:
    if group_size > 1 and not isinstance(x, FakeTensor) and x.device.type != "meta":
        raise CompileError(
            f"{name} over {group_size} ranks ran on a real tensor before emit.bind() gave it a process group"
        )


def all_gather(shard: torch.Tensor, axis: str, group_size: int) -> torch.Tensor:
    """Concatenate every rank's shard along dim 0: ``(S,) -> (N * S,)``. Issue only; see `wait`."""
    _abstract_only("all_gather", shard, group_size)
    if group_size == 1:
        return shard
    return shard.new_empty((shard.shape[0] * group_size,) + tuple(shard.shape[1:]))


def reduce_scatter(buffer: torch.Tensor, axis: str, group_size: int) -> torch.Tensor:
    """Sum ``(N * S,)`` over ranks and keep this rank's ``(S,)`` block. Issue only; see `wait`."""
    _abstract_only("reduce_scatter", buffer, group_size)
    if group_size == 1:
        return buffer
    return buffer.new_empty((buffer.shape[0] // group_size,) + tuple(buffer.shape[1:]))


def all_reduce(buffer: torch.Tensor, axis: str, group_size: int) -> torch.Tensor:
    """Sum ``buffer`` over ranks. Issue only; see `wait`."""
    _abstract_only("all_reduce", buffer, group_size)
    return buffer if group_size == 1 else torch.empty_like(buffer)


def all_reduce_(buffer: torch.Tensor, axis: str, group_size: int) -> torch.Tensor:
    """Sum ``buffer`` over ranks in place; returns ``buffer``. Issue only; see `wait`.

    `passes.reduce_in_place` uses it for a buffer made for this reduction alone (Note [reductions in place]).
    """
    _abstract_only("all_reduce_", buffer, group_size)
    return buffer


def all_gather_into(shard: torch.Tensor, out: torch.Tensor, axis: str, group_size: int) -> torch.Tensor:
    """Gather every rank's ``(S,)`` shard into ``out`` (``(N * S,)``) in place; returns ``out``. Issue only.

    ZERO1's gather of updated shards (Note [whole-flat shards]): ``shard`` is
    this rank's slice of ``out`` itself, so at group size 1 there is nothing to do.
    """
    _abstract_only("all_gather_into", shard, group_size)
    return out


def local_shard(full: torch.Tensor, axis: str, group_size: int) -> torch.Tensor:
    """This rank's slice ``[r*S, (r+1)*S)`` of a whole padded flat tensor: a view, so updates land in ``full``.

    Not a collective, but like one it depends on where the rank sits on the
    mesh: `emit.bind` replaces it with ``narrow`` at this rank's coordinate on
    ``axis``. Unbound, it is the slice of coordinate 0 (the right shape, and
    exact at group size 1).
    """
    return full.narrow(0, 0, full.shape[0] // group_size)


def local_block(full: torch.Tensor, dim: int, axis: str, group_size: int) -> torch.Tensor:
    """This rank's block along ``dim`` of a replicated tensor (Replicate -> Shard(dim)), contiguous.

    Not a collective: like `local_shard` it reads the rank's coordinate on
    ``axis``, which `emit.bind` supplies; unbound it is coordinate 0's block.
    """
    if group_size == 1:
        return full
    return full.narrow(dim, 0, full.shape[dim] // group_size).contiguous()


def local_partial(full: torch.Tensor, axis: str, group_size: int) -> torch.Tensor:
    """A replicated tensor as a summand over ``axis`` (Replicate -> Partial): itself on coordinate 0, else zeros.

    Not a collective; unbound it is coordinate 0's summand, ``full`` itself.
    """
    return full


def wait(tensor: torch.Tensor) -> torch.Tensor:
    """Block until the collective that produced ``tensor`` is done; returns it."""
    return tensor


def free(*tensors: torch.Tensor) -> None:
    """Mark the end of life of a gathered unit.

    The node does nothing when it runs: it is the last user of the gathered
    buffer and its rebuilt parameters, so the generated code drops the last
    references right after it, which is when the memory goes back.
    """


COLLECTIVES = (all_gather, reduce_scatter, all_reduce, all_reduce_, all_gather_into)
COORDINATE_DEPENDENT = (local_shard, local_block, local_partial)  # what a rank computes depends on where it is
EFFECTS = COLLECTIVES + (wait, free)


def group_of(node: torch.fx.Node) -> tuple[str, int] | None:
    """``(axis, group_size)`` of an abstract collective (or `local_shard`) node; None for any other node.

    Example: the node ``all_gather(shard, "fsdp", 4)`` gives ``("fsdp", 4)``.
    """
    if node.op != "call_function":
        return None
    if node.target in (all_gather, reduce_scatter, all_reduce, all_reduce_, local_shard):
        return node.args[1], node.args[2]
    if node.target is all_gather_into:
        return node.args[2], node.args[3]
    if node.target is local_block:
        return node.args[2], node.args[3]
    if node.target is local_partial:
        return node.args[1], node.args[2]
    return None


def over_ranks(node) -> bool:
    """Whether ``node`` is a collective over more than one rank (one over a single rank stays an identity)."""
    group = group_of(node) if isinstance(node, torch.fx.Node) else None
    return group is not None and group[1] > 1


def is_effectful(node: torch.fx.Node) -> bool:
    """Whether dead-code elimination must keep ``node`` (collectives, waits, frees, mutations)."""
    if node.op in ("placeholder", "output"):
        return True
    return node.op == "call_function" and _effectful_target(node.target)


@functools.lru_cache(maxsize=None)
def _effectful_target(target) -> bool:
    if target in EFFECTS or getattr(target, "__module__", "") == "torch._ops._c10d_functional":
        return True
    schema = getattr(target, "_schema", None)
    if schema is not None and schema.is_mutable:
        return True
    return "_c10d_functional" in str(target)


def eliminate_dead_code(graph: torch.fx.Graph) -> None:
    """fx dead-code elimination that keeps every effect (Note [collectives are effects]).

    fx's own (`Graph.eliminate_dead_code`, whose loop this is) lints the whole graph first: a tenth of a
    second on the 70B step, three times a compile. The pass pipeline lints once after the last pass, and
    after each with ``check_each_pass``. The step's graph has no subgraphs.
    """
    for node in reversed(graph.nodes):  # reversed: erasing a node frees its inputs' last use
        if not node.users and not is_effectful(node):
            graph.erase_node(node)
