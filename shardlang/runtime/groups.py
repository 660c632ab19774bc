"""Process groups for the axes of a mesh: one subgroup per group key, per rank.

A compiled graph names its collectives' groups by key (`MeshShape.group_key`):
a mesh axis (``"fsdp"``), several axes joined by ``+``, or ``"*"`` for every
rank. On a ``replicate=2 x fsdp=2`` mesh (row-major: rank = 2 * replicate +
fsdp) the key ``"fsdp"`` is the groups [0, 1] and [2, 3], the key
``"replicate"`` the groups [0, 2] and [1, 3].

`torch.distributed.new_group` is collective over the whole world: every rank
must create every subgroup, in the same order, even those it is not in.
`mesh_groups` does that for each key in the order given (every rank compiles
the same graph, so every rank asks for the same keys in the same order), and
keeps the groups it made for later steps (Note [group cache]).

Note [group cache]: a step compiled twice, or two steps on the same mesh,
reuse the subgroups made the first time instead of creating new ones (each
gloo group holds sockets and threads). The cache belongs to one default
process group: when the world group is another object (torch.distributed was
shut down and initialised again; group names restart then), the cache starts
afresh. Every rank fills it in the same order because every rank compiles the
same programs.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from ..compiler import MeshShape, WORLD

__all__ = ["mesh_groups"]

class _Cache:
    """Subgroups by their ranks, for one world group (Note [group cache])."""

    world: object = None
    groups: dict[tuple[int, ...], dist.ProcessGroup] = {}


def mesh_groups(mesh: MeshShape, keys, rank: int, timeout_s: float | None = None) -> dict[str, dist.ProcessGroup]:
    """This rank's process group for each group key in ``keys`` (a collective: every rank calls it alike).

    A key that spans every rank gets the default (world) group. Subgroups are made
    with ``timeout_s`` (the world's, from `DistContext.timeout_s`; torch would give
    them its backend default instead). Example::

        groups = mesh_groups(MeshShape((("replicate", 2), ("fsdp", 2))), ["fsdp", "replicate"], rank=1)
        dist.get_process_group_ranks(groups["fsdp"])        # [0, 1]
    """
    world = dist.group.WORLD
    out: dict[str, dist.ProcessGroup] = {}
    for key in dict.fromkeys(keys):
        if key == WORLD or mesh.group_size(key) == mesh.size:
            out[key] = world
            continue
        for ranks in mesh.groups(key):
            group = _subgroup(world, ranks, timeout_s)
            if rank in ranks:
                out[key] = group
    return out


def _subgroup(world: dist.ProcessGroup, ranks: list[int], timeout_s: float | None) -> dist.ProcessGroup:
    if _Cache.world is not world:
        _Cache.world, _Cache.groups = world, {}
    group = _Cache.groups.get(tuple(ranks))
    if group is None:
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        group = dist.new_group(ranks, timeout=timeout)
        _Cache.groups[tuple(ranks)] = group
    return group
