"""Re-derive the shapes the passes changed, with fake tensors of the local sizes.

After sharding, a flat parameter's placeholder and its optimizer state hold a
shard (``S`` elements) rather than the whole flat tensor, and the passes add
nodes (collectives, recomputed forward ops, packs) that have no shape yet.
`propagate_shapes` runs the graph under a `FakeTensorMode` with such inputs and
refreshes ``meta["val"]`` on every node, which the schedule and the memory plan
read for bytes and storage identities; it fails loudly if any op still expects
a whole-size tensor.

Note [incremental shapes]: running every node of a 30k-node step through fake
tensors takes a minute, and the memory budget compiles one trace about ten
times. Most nodes are the trace's own, with the same inputs as when they were
traced, and the trace already gave them their fake tensor. `remember_shapes`
(called by `compile_step` on the graph the passes receive) notes each node's
arguments; `propagate_shapes` then runs only the nodes that are new, whose
arguments a pass replaced, or that read a node whose value changed, and gives
the others the value the trace made, in the trace's fake mode, so storages stay
shared exactly as they would be in one propagation. A re-run node whose new
value is a fresh tensor (its own storage, not a view of an input) of the same
size, strides and dtype as its traced value, which was fresh too, keeps the
traced value, and its readers need no re-run: that is where a changed gather
stops (the matmul reading a re-gathered weight). The result is the same as
`full_propagation` node for node (shapes, strides, dtypes and which values
share a storage), which tests/test_incremental_shapes.py checks on the examples.
Where nothing was remembered (a graph `remember_shapes` never saw) every node
is new, so the same propagation runs every node, in a new fake mode.

Note [shape memo]: the memory budget compiles one trace under several option
sets, and what differs between them (recompute, prefetch) leaves most re-run
nodes alike: a gather of a flat parameter reads the same local-size input each
time, and the matmuls of backward read the same gathered weight. A `ShapeMemo`,
kept with the trace and shared by its compiles, holds for each op run so far
(its target and arguments, with each node replaced by the very value it had)
the values it made, and the local-size inputs by placeholder. A node whose op
and input values are in the memo takes a value made then, without dispatch:
the same op on the same fake tensors makes the same sizes, strides and storage
relations. Several nodes of one graph can ask for the same op on the same
values (the forward and backward gathers of one flat parameter): the memo keeps
every value made for a key, and a value already given to a node in this
propagation (the memo's, the trace's or an input) goes to no other node, but to
an in-place op on it. Without a value left, the node runs and its value joins
the memo. A trace's memo stays with the graph through the passes, so a later
pass that changes a few nodes (`add_gradients_in_place`) re-runs them through
it too, and knows which of the graph's values are fresh without asking again;
`compile_step` drops it from the compiled graph (`drop_shape_memo`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree

from .graph_utils import storage_key, tensor_layout, tensor_leaves
from .trace import InputRole

if TYPE_CHECKING:  # the passes' context; shapes are read by passes, not the other way
    from ..context import CompileContext

_REMEMBERED = "sl_traced_args"  # GraphModule.meta key: node -> (args, kwargs, target, fresh) as traced
_MEMO = "sl_shape_memo"  # GraphModule.meta key: the `ShapeMemo` of a trace and its compiles


def local_numel(ctx: CompileContext, flat_name: str) -> int:
    """Elements of a flat parameter's optimizer shard (and of each of its state tensors) on one rank."""
    flat = ctx.flat(flat_name)
    return flat.shard_numel if flat.sharded else flat.numel


def held_numel(ctx: CompileContext, flat_name: str) -> int:
    """Elements of the parameter tensor a rank holds for a flat parameter (the whole, padded, under ZERO1)."""
    return ctx.flat(flat_name).storage_numel


class ShapeMemo:
    """Values made by earlier propagations of graphs from one trace (Note [shape memo]).

    Example: ``remember_shapes(gm, memo=shape_memo(traced_gm))`` before the
    passes; the compiles of one trace then share it.
    """

    def __init__(self):
        self.values: dict[tuple, list[tuple]] = {}  # op key -> [(input values, value, meta value)]
        self.inputs: dict[tuple, torch.Tensor] = {}  # (placeholder, size, dtype, device) -> local input
        self.fresh: dict[tuple, tuple] = {}  # ids of a traced value and its inputs -> (them, whether it is fresh)


def shape_memo(traced: fx.GraphModule) -> ShapeMemo:
    """The memo kept with ``traced`` (a trace's own graph), made on first use."""
    return traced.meta.setdefault(_MEMO, ShapeMemo())


def remember_shapes(gm: fx.GraphModule, memo: ShapeMemo | None = None) -> None:
    """Note each node's arguments and whether its value is fresh, for `propagate_shapes` (Note [incremental shapes]).

    ``memo``: the trace's `ShapeMemo`; without it, the one an earlier propagation of ``gm`` kept, if any.

    Kept in ``gm.meta`` by node: a node a pass makes (a copy too, whose
    ``meta`` is its original's) is not in it, and a pass that replaces an
    argument gives the node new ``args``, not the tuple noted here.
    """
    remembered = gm.meta[_REMEMBERED] = {}
    if memo is not None:
        gm.meta[_MEMO] = memo
    memo = gm.meta.get(_MEMO)  # given, or left by an earlier propagation of this graph
    known = memo.fresh if memo is not None else {}  # the trace's values are the same in each of its copies
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        leaves = pytree.tree_leaves(val)
        if node.op == "output" or not leaves or not all(isinstance(t, FakeTensor) for t in leaves):
            continue
        inputs = tuple(a.meta.get("val") for a in node.all_input_nodes)
        key = (id(val), *map(id, inputs))
        if key not in known:
            known[key] = (val, inputs, node.op != "placeholder" and _fresh(val, inputs))  # held: ids stay theirs
        remembered[node] = (node.args, node.kwargs, node.target, known[key][2])


def drop_shape_memo(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` without the trace's `ShapeMemo`: a compiled graph keeps no fake tensors of its compile."""
    gm.meta.pop(_MEMO, None)
    return gm


def propagate_shapes(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    """Refresh ``meta["val"]`` for the local sizes, re-running only what changed since `remember_shapes`."""
    remembered = gm.meta.pop(_REMEMBERED, None) or {}
    memo = gm.meta.get(_MEMO) or ShapeMemo()  # a trace's stays: a later pass's propagation reuses it
    mode = (pytree.tree_leaves(next(iter(remembered)).meta["val"])[0].fake_mode if remembered
            else FakeTensorMode(allow_non_fake_inputs=True))
    inputs = _local_inputs(gm, ctx, mode, memo.inputs)
    _IncrementalProp(gm, mode, remembered, memo).propagate_dont_convert_inputs(*inputs)
    return gm


def full_propagation(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    """Every node through plain `FakeTensorProp` in a new mode: the reference `propagate_shapes` is tested against."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*_local_inputs(gm, ctx, mode))
    gm.meta.pop(_REMEMBERED, None)
    return gm


def _local_inputs(gm: fx.GraphModule, ctx: CompileContext, mode: FakeTensorMode,
                  made: dict | None = None) -> list[torch.Tensor]:
    """A fake tensor of the local size for each input of the graph: fresh, or the one in ``made`` (a memo's)."""
    made = {} if made is None else made
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
        key = (node.name, shape, old.dtype, old.device)
        if key not in made:
            with mode:
                made[key] = torch.empty(shape, dtype=old.dtype, device=old.device)
        inputs.append(made[key])
    return inputs


def _objects(*values) -> list:
    """The tensors and tuples among ``values``, and the tensors in those tuples (a node's value may be one)."""
    out = []
    for v in values:
        if isinstance(v, (tuple, list)):
            out.append(v)
            out.extend(tensor_leaves(v))
        elif isinstance(v, torch.Tensor):
            out.append(v)
    return out


def _storage_keys(val) -> list[StorageWeakRef]:
    return [storage_key(t) for t in tensor_leaves(val)]


def _fresh(val, inputs) -> bool:
    """Whether every tensor of ``val`` has a storage of its own: no input's, no other tensor's of ``val``."""
    keys = _storage_keys(val)
    taken = {key for v in inputs for key in _storage_keys(v)}
    return len(set(keys)) == len(keys) and not taken.intersection(keys)


def _same_layout(a, b) -> bool:
    """Whether two values (tensors, or tuples of them) have the same `tensor_layout` leaf for leaf."""
    a_leaves, a_spec = pytree.tree_flatten(a)
    b_leaves, b_spec = pytree.tree_flatten(b)
    return a_spec == b_spec and all(
        isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and tensor_layout(x) == tensor_layout(y)
        for x, y in zip(a_leaves, b_leaves))


class _IncrementalProp(FakeTensorProp):
    """`FakeTensorProp` that re-runs only what changed (Note [incremental shapes])."""

    def __init__(self, gm: fx.GraphModule, mode: FakeTensorMode, remembered: dict, memo: ShapeMemo):
        super().__init__(gm, mode)
        self.remembered = remembered
        self.memo = memo
        self.changed: set[fx.Node] = set()
        self.input_storages: set[StorageWeakRef] = set()  # the placeholders kept so far
        self.handed_out: set[int] = set()  # ids of the memo's values given to nodes in this propagation

    def run_node(self, n: fx.Node):
        remembered = self.remembered.get(n)
        old = n.meta.get("val")
        if n.op == "placeholder":
            return self._placeholder(n, old, remembered)
        unchanged = (remembered is not None and n.args is remembered[0] and n.kwargs is remembered[1]
                     and n.target is remembered[2] and not any(a in self.changed for a in n.all_input_nodes))
        if unchanged:
            return self._hand_out(old)
        key, inputs = self._memo_key(n)
        for made_from, value, meta in self.memo.values.get(key, ()):
            if self._may_hand_out(made_from, value, meta, inputs):
                if value is not old:
                    self.changed.add(n)
                n.meta["val"] = meta
                return self._hand_out(value, meta)
        value = super().run_node(n)
        meta = n.meta.get("val")
        if (remembered is not None and remembered[3] and _same_layout(old, meta)
                and _fresh(meta, [self.env[a] for a in n.all_input_nodes])):
            value = meta = n.meta["val"] = old  # a fresh value like the traced one: keep it, readers need not run
        else:
            self.changed.add(n)
        if key is not None:
            self.memo.values.setdefault(key, []).append((inputs, value, meta))
        return self._hand_out(value, meta)

    def _hand_out(self, value, meta=None):
        """Note that this propagation gave ``value`` (and its meta snapshot) to a node; return it."""
        self.handed_out.update(map(id, _objects(value, meta)))
        return value

    def _memo_key(self, n: fx.Node):
        """(target, arguments with each node as its value's id), and those values; None when not hashable."""
        inputs = tuple(self.env[a] for a in n.all_input_nodes)
        as_ids = lambda a: ("node", id(self.env[a]))  # noqa: E731
        # map_arg returns fx's immutable (hashable) lists and dicts
        key = (n.target, fx.node.map_arg(n.args, as_ids), fx.node.map_arg(n.kwargs, as_ids))
        try:
            hash(key)
        except TypeError:
            return None, inputs
        return key, inputs

    def _may_hand_out(self, made_from, value, meta, inputs) -> bool:
        """Whether a memo entry was made from these very inputs and its value is not another node's here."""
        if len(made_from) != len(inputs) or any(a is not b for a, b in zip(made_from, inputs)):
            return False
        own = {id(v) for v in _objects(*inputs)}  # an in-place op returns its input
        return not any(i in self.handed_out and i not in own for i in map(id, _objects(value, meta)))

    def _placeholder(self, n: fx.Node, old, remembered):
        given = super().run_node(n)  # the fresh local-size input, as a full propagation makes it
        if remembered is not None and _same_layout(old, given):
            key = storage_key(old)
            if key not in self.input_storages:  # a storage shared with another input must be split, as in full
                self.input_storages.add(key)
                n.meta["val"] = old
                return self._hand_out(old)
        self.changed.add(n)
        return self._hand_out(given)
