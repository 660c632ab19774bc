"""The step's scalar arithmetic, split off the graph that inductor compiles.

Note [step scalars before inductor]: the optimizer's step-dependent factors
are 0-d tensors computed from 0-d inputs (`optim.Adam.update_`: ``t = step +
1``, ``1 - beta1 ** t``, ``sqrt(1 - beta2 ** t)``, ``-(lr / bc1)``, ``eps /
step_size``; AdamW's ``1 - lr * wd``). Inductor inlines a 0-d pointwise value
into every consumer, so its C++ kernel for the update evaluated them once per
vector of 8 elements: two ``std::pow(double, double)``, a ``std::sqrt`` and
three divisions per iteration, which g++ may not hoist out of the loop
(inductor compiles with ``-fmath-errno``: libm calls may write errno). On the
10M GPT at N = 1 the fused update took 65 ms of a 0.54 s step, against 29 ms
for the eager update's aten ops (`torch.profiler` with
``TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1``).

`split_step_scalars` moves every such node into a small prologue graph that
runs eagerly (aten, once per step) and hands its results to the compiled graph
as extra 0-d inputs, which its kernels read with one load. The values are the
eager backend's to the bit: the same aten ops on the same 0-d tensors.

What is moved: a functional aten op (no mutation, no alias of an input, not
random) whose result is 0-d and whose inputs are 0-d graph inputs or nodes
moved before it, none of them written in place earlier in the graph (the step
count is incremented in place at the end; a node after that reads the new
value, so it stays). Example::

    split = split_step_scalars(gm, example_inputs)
    extra = split.prologue(*split.scalar_inputs(example_inputs))   # 0-d tensors
    loss = split.graph_module(*example_inputs, *extra)
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import attrs
import torch
import torch.fx as fx

from ..ir.mutations import alias_base, written_args


@attrs.frozen
class StepScalars:
    """A step graph with its scalar arithmetic split off (Note [step scalars before inductor]).

    ``graph_module`` takes the original inputs and then one 0-d input per
    ``prologue`` output; ``prologue`` takes the original inputs at
    ``scalar_indices``. ``moved`` names the nodes that went to the prologue.

    Example::

        split = split_step_scalars(gm, inputs)
        run = lambda *xs: split.graph_module(*xs, *split.prologue(*split.scalar_inputs(xs)))
    """

    graph_module: fx.GraphModule
    prologue: fx.GraphModule
    scalar_indices: tuple[int, ...]
    moved: tuple[str, ...]

    def scalar_inputs(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [inputs[i] for i in self.scalar_indices]


def split_step_scalars(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> StepScalars | None:
    """``gm`` with its 0-d step arithmetic moved to an eager prologue, or None when there is none.

    ``gm`` is left as it is; ``example_inputs`` are in placeholder order and
    only their dimensions are read.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    scalar_inputs = {p for p, x in zip(placeholders, example_inputs) if isinstance(x, torch.Tensor) and x.dim() == 0}
    moved = _movable_nodes(gm.graph, scalar_inputs)
    frontier = [n for n in moved if any(u not in moved for u in n.users)]
    if not frontier:
        return None
    used_inputs = [p for p in placeholders if p in scalar_inputs and any(u in moved for u in p.users)]

    prologue_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for p in used_inputs:
        env[p] = prologue_graph.placeholder(p.name)
        env[p].meta = dict(p.meta)
    for n in moved:
        env[n] = prologue_graph.node_copy(n, lambda a: env[a])
    prologue_graph.output(tuple(env[n] for n in frontier))

    main = copy.deepcopy(gm)
    by_name = {n.name: n for n in main.graph.nodes}
    anchor = [n for n in main.graph.nodes if n.op == "placeholder"][-1]
    for n in frontier:  # each new input after the one before: the prologue's outputs, in order
        with main.graph.inserting_after(anchor):
            anchor = main.graph.placeholder(f"{n.name}_scalar")
        anchor.meta = {k: v for k, v in n.meta.items() if k in ("val", "tensor_meta")}
        by_name[n.name].replace_all_uses_with(anchor)
    for n in reversed(list(moved)):
        main.graph.erase_node(by_name[n.name])
    main.recompile()
    return StepScalars(main, fx.GraphModule(gm, prologue_graph),
                       tuple(placeholders.index(p) for p in used_inputs), tuple(n.name for n in moved))


def _movable_nodes(graph: fx.Graph, scalar_inputs: set[fx.Node]) -> dict[fx.Node, None]:
    """The nodes that go to the prologue, in graph order: one pass, since a node's inputs come before it.

    A node moves when it is a movable op, never written in place itself, and each of its inputs is a
    0-d graph input or a moved node, not written in place before the node reads it.
    """
    first_write: dict[fx.Node, int] = {}  # each written tensor, by the index of the first node that writes it
    for index, node in enumerate(graph.nodes):
        for base in _written_bases(node):
            first_write.setdefault(base, index)
    moved: dict[fx.Node, None] = {}
    for index, node in enumerate(graph.nodes):
        inputs = node.all_input_nodes
        if inputs and _movable(node) and node not in first_write and all(
                (a in moved or a in scalar_inputs) and first_write.get(a, index) >= index for a in inputs):
            moved[node] = None
    return moved


def _movable(node: fx.Node) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    schema = target._schema
    if schema.is_mutable or any(r.alias_info is not None for r in schema.returns):
        return False
    if torch.Tag.nondeterministic_seeded in target.tags:
        return False
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() == 0


def _written_bases(node: fx.Node) -> list[fx.Node]:
    """The tensors ``node`` writes in place, each as the node it is a view of (`mutations.alias_base`).

    A call of anything but an aten op (shardlang's own helpers) may write any input it is given.
    """
    if node.op == "call_function" and not isinstance(node.target, torch._ops.OpOverload):
        return list(node.all_input_nodes)
    return [alias_base(arg) for arg in written_args(node)]
