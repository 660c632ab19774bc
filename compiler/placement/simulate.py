"""Run a localized graph for every rank of its tensor axis in one process, in lockstep.

The tensor axis's collectives are computed across the simulated ranks (a sum
in rank order, a concatenation), and the ops that depend on a rank's
coordinate (`local_block`, `local_partial`) get each rank's. This is how
propagation is tested against the logical step without processes, and how a
plan's placements can be checked on a laptop: exactly what each rank would
compute, one rank after another.

Example::

    outputs = simulate(localize(gm, plan), plan.size, [inputs_of_rank(r) for r in range(plan.size)])
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..ir import collectives

__all__ = ["simulate"]


def simulate(graph_module: fx.GraphModule, n: int, inputs: list[list]) -> list:
    """Each rank's outputs of ``graph_module``, run on its ``inputs[rank]``, its collectives over the ``n`` ranks."""
    envs: list[dict[fx.Node, object]] = [{} for _ in range(n)]
    placeholders = iter(range(len(inputs[0])))
    for node in graph_module.graph.nodes:
        if node.op == "placeholder":
            i = next(placeholders)
            for r in range(n):
                envs[r][node] = inputs[r][i]
            continue
        if node.op == "output":
            return [fx.node.map_arg(node.args[0], lambda a, r=r: envs[r][a]) for r in range(n)]
        values = [fx.node.map_arg((node.args, node.kwargs), lambda a, r=r: envs[r][a]) for r in range(n)]
        for r, value in enumerate(_run(node, values, n)):
            envs[r][node] = value
    raise ValueError("the graph has no output node")


def _summed(values: list, n: int) -> torch.Tensor:
    """The sum in rank order of every rank's first argument (what a reduction over the axis computes)."""
    total = values[0][0][0].clone()
    for r in range(1, n):
        total += values[r][0][0]
    return total


def _run(node: fx.Node, values: list, n: int) -> list:
    target = node.target
    if target is collectives.all_reduce:
        total = _summed(values, n)
        return [total.clone() for _ in range(n)]
    if target is collectives.reduce_scatter:
        return [block.clone() for block in _summed(values, n).chunk(n, dim=0)]
    if target is collectives.all_gather:
        whole = torch.cat([values[r][0][0] for r in range(n)], dim=0)
        return [whole.clone() for _ in range(n)]
    if target is collectives.local_block:
        out = []
        for r in range(n):
            (full, dim, _, size), _ = values[r]
            block = full.shape[dim] // size
            out.append(full.narrow(dim, r * block, block).contiguous())
        return out
    if target is collectives.local_partial:
        return [values[r][0][0] if r == 0 else torch.zeros_like(values[r][0][0]) for r in range(n)]
    if target is operator.getitem or callable(target):
        return [target(*args, **kwargs) for args, kwargs in values]
    raise ValueError(f"cannot simulate {node.op} {target}")
