"""The traced logical step made tp-local: what compile_step hands FSDP's passes on a mesh with a tensor axis.

`tensor_parallel_step` places the traced step on the tensor axis
(`propagate`), writes the graph each rank of that axis runs (`localize`), and
returns it as a `TracedStep` with the same inputs: its flats are the tp-local
flats, so every pass after it works as on a mesh of data axes alone, on smaller
parameters, with the tensor axis's collectives already in the graph
(Note [tp-local flats] in `compiler.config`).
"""

from __future__ import annotations

import attrs
import torch

from shardlang.errors import CompileError
from ..ir.provenance import site_of_node
from ..ir.trace import TracedStep
from .placements import Partial, Replicate, Shard
from .localize import localize
from .propagate import propagate

__all__ = ["tensor_parallel_step"]

aten = torch.ops.aten


def tensor_parallel_step(traced: TracedStep, axis) -> TracedStep:
    """``traced`` as each rank of ``axis`` (a `compiler.config.TensorAxis`) runs it, with its placement plan.

    Example: ``local = tensor_parallel_step(traced, TensorAxis("tp", 2, 1, {"fc1.weight": Shard(0)}))``.
    """
    plan = propagate(traced, axis.placements, axis.name, axis.size, axis.sequence_dim, axis.loss_parallel)
    if plan.sequence_dim is not None:
        _check_sequence_divides(traced, plan)
    if plan.loss_parallel:
        _check_loss_runs_on_blocks(traced, plan)
    return attrs.evolve(traced, graph_module=localize(traced.graph_module, plan), placements=plan)


def _check_sequence_divides(traced: TracedStep, plan) -> None:
    """Under sequence parallelism, each activation reduced over the axis has a sequence the axis divides.

    An activation whose sequence the axis does not divide cannot be split on it:
    its reduction stays an all-reduce, and the step would be exact but not
    sequence parallel. FSDP2 + TP mis-shapes such activations silently
    (torchtitan#1306); here it is an error naming the value, its shape and its line.
    """
    dim, n = plan.sequence_dim, plan.size
    nodes = {node.name: node for node in traced.graph_module.graph.nodes}
    for r in plan.redistributions:
        if not (isinstance(r.source, Partial) and isinstance(r.target, Replicate) and len(r.shape) > dim + 1):
            continue
        if r.shape[dim] > 1 and r.shape[dim] % n:
            consumer = nodes[r.consumer]
            site = site_of_node(consumer)
            where = f"\n  made at {site}" if site is not None else ""
            raise CompileError(
                f"Options.sequence_parallel splits activations on their sequence (dim {dim}) over "
                f"{plan.axis}={n}, but {r.arg} of shape {list(r.shape)}, reduced for {consumer.target}, has "
                f"sequence length {r.shape[dim]}, which is not a multiple of {n}; make the sequence length a "
                f"multiple of {n} (pad it), or turn sequence_parallel off{where}")


def _check_loss_runs_on_blocks(traced: TracedStep, plan) -> None:
    """Under loss parallelism, some negative log-likelihood of the step takes its log-probabilities split.

    Otherwise the option did nothing (no cross-entropy, or logits that reach the
    loss whole), which a user who asked for it should hear before training.
    """
    losses = traced.graph_module.graph.find_nodes(op="call_function", target=aten.nll_loss_forward.default)
    if any(isinstance(plan.strategies[node.name].inputs[0], Shard) for node in losses):
        return
    why = ("the step has no cross-entropy (nll_loss_forward)" if not losses else
           f"the log-probabilities reach {losses[0].name} as {plan.placement(losses[0].args[0])!r}, not split by "
           f"vocabulary; split the output head's weight on its vocabulary over {plan.axis} "
           f"(shard({plan.axis!r}, dim=0)), or turn loss_parallel off")
    raise CompileError(f"Options.loss_parallel computes a cross-entropy on logits split by vocabulary over "
                       f"{plan.axis}={plan.size}, but {why}")
