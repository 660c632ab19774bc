"""Re-derive every node's shape after the passes, with fake tensors of the local sizes.

After sharding, a flat parameter's placeholder and its optimizer state hold a
shard (``S`` elements) rather than the whole flat tensor. Running the graph
under `FakeTensorProp` with such inputs refreshes ``meta["val"]`` on every node,
which the schedule reads for bytes, and fails loudly if any op still expects a
whole-size tensor.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from .context import CompileContext
from .trace import InputRole


def local_numel(ctx: CompileContext, flat_name: str) -> int:
    """Elements of a flat parameter's optimizer shard (and of each of its state tensors) on one rank."""
    flat = ctx.flat(flat_name)
    return flat.shard_numel if flat.sharded else flat.numel


def held_numel(ctx: CompileContext, flat_name: str) -> int:
    """Elements of the parameter tensor a rank holds for a flat parameter (the whole, padded, under ZERO1)."""
    return ctx.flat(flat_name).storage_numel


def propagate_shapes(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = []
    for spec, node in zip(ctx.inputs, placeholders):
        old = node.meta["val"]
        if spec.role is InputRole.FLAT:
            shape = (held_numel(ctx, spec.flat),)
        elif spec.role is InputRole.STATE:
            shape = (local_numel(ctx, spec.flat),)
        else:
            shape = tuple(old.shape)
        with mode:
            inputs.append(torch.empty(shape, dtype=old.dtype, device=old.device))
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)
    return gm
