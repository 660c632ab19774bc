"""Trace a model of many identical layers once: replicate a short model's graph to the full depth.

Note [replicated trace]: tracing costs about a millisecond per op in torch's
fake-tensor dispatch, so an 80-layer model spends most of its plan tracing 80
identical layers. `trace_step_replicated` traces the model cut to 3 and to 4
of its ``n`` repeated layers (a ``ModuleList`` whose children have the same
class, parameters and buffers, each flat parameter inside one of them or
outside all), and writes the ``n``-layer graph from the 3-layer one:

* the 4-layer graph is the 3-layer one with one block of nodes inserted at a
  few points (parameter placeholders, optimizer state, forward, backward,
  optimizer updates); at each point the 3-layer graph holds three equal blocks
  (layers 0, 1, 2; ascending or descending);
* the ``n``-layer graph keeps layer 0's block and the last layer's (layer 2's,
  renamed ``n - 1``) and repeats the middle one (layer 1) for layers
  ``1 .. n - 2``. A node of a copy for layer ``j`` made from the block of layer
  ``t`` reads, for a node of layer ``t + d`` in the template, the node of layer
  ``j + d``; layer names in its tags (``unit``, ``member``, ``flat``) shift by
  ``j - t``; its fake value gets a storage of its own exactly where the
  template's has one, and is a view of the mapped node's storage elsewhere.

The rule is used only after it is checked: the 3-layer graph replicated to 4
layers must equal the traced 4-layer graph node for node (names, ops, targets,
arguments, tags, stack traces, and per value its sizes, strides, offset, dtype,
storage bytes and which storages are shared). Anything else (layers that
differ, a flat parameter across layers, a graph that is not periodic) falls
back to tracing the whole model, with the same result but slower. Layers
count as identical when their module classes, parameters (names, shapes,
dtypes, requires_grad), buffers and plain attributes (ints, strings, flags:
what a layer's code may branch on) are the same and they have no hooks.

On a tensor axis, `tensor_parallel_step` localizes the 3- and 4-layer traces
before the check (``then``), so propagation and localization see 4 layers,
not 80; the tp collectives are part of each layer's block, and a collective
between the layers (the embedding's reduce-scatter, consumed by layer 0) is
a fixed node tagged with the first or the last layer.

What the check cannot see: code outside the layers that treats a layer by its
index from the fifth on (``if i == 40``), or a layer's code that reads state
other than its attributes. ``meta["seq_nr"]`` (autograd's counter, which no
pass reads) is the template's, not the one a full trace would number.
Planning uses it (`compile_step` on a model with fake parameters); a real
compile traces in full.
"""

from __future__ import annotations

import contextlib
import difflib
import re
from collections.abc import Callable

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree

from shardlang.errors import TraceError
from .graph_utils import storage_key, tensor_layout
from .lazy_code import graph_module
from .trace import TracedStep, graph_inputs, trace_step

MIN_UNITS = 8  # fewer repeated layers trace in full: tracing 3 + 4 layers saves little below this


class NotReplicable(Exception):
    """The graph of the short models is not periodic as Note [replicated trace] needs (falls back)."""


def trace_step_replicated(model: torch.nn.Module, loss_fn, flats, optimizer, batch, *, min_units: int | None = None,
                          then: Callable[[TracedStep], TracedStep] | None = None, **kwargs) -> TracedStep:
    """``then(trace_step(...))`` of ``model``, from traces of 3 and 4 of its repeated layers when that is exact.

    Used by planning (fake parameters): ``kwargs`` are `trace_step`'s. Falls
    back to the full trace when the model has fewer than ``min_units``
    identical repeated layers or the check of Note [replicated trace] fails.
    ``then`` (a tensor axis's `tensor_parallel_step`) rewrites each short trace
    before the check, so it runs on 3 and 4 layers rather than on all of them;
    a step built so carries no placement plan (``placements`` is None).

    Example::

        traced = trace_step_replicated(model, loss_fn, flats, AdamW(lr=1e-3), batch)  # = trace_step(...)
    """
    repeated = repeated_layers(model, flats, MIN_UNITS if min_units is None else min_units)
    if repeated is not None:
        prefix, n = repeated
        try:
            return _replicated(model, loss_fn, flats, optimizer, batch, prefix, n, kwargs, then or _unchanged)
        except (NotReplicable, TraceError):  # a model that fails to trace reports it from its full trace
            pass
    return (then or _unchanged)(trace_step(model, loss_fn, flats, optimizer, batch, **kwargs))


def _unchanged(traced: TracedStep) -> TracedStep:
    return traced


def repeated_layers(model: torch.nn.Module, flats, min_units: int) -> tuple[str, int] | None:
    """The ``ModuleList`` of identical layers (its name and length) the replication can use, or None."""
    best = None
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) < max(min_units, 5) or not name:
            continue
        if not all(_same_layer(module[0], m) for m in module) or not _flats_per_layer(flats, name, len(module)):
            continue
        if best is None or len(module) > best[1]:
            best = (name, len(module))
    return best


_PLAIN = (int, float, bool, str, type(None), tuple, torch.dtype)


def _same_layer(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Same module classes, parameters, buffers and plain attributes (a flag a layer's code reads), and no hooks."""
    def described(m):
        return ([(type(x), n, sorted((k, v) for k, v in vars(x).items() if isinstance(v, _PLAIN) and k != "training"),
                  bool(x._forward_hooks or x._forward_pre_hooks or x._backward_hooks or x._backward_pre_hooks))
                 for n, x in m.named_modules()],
                [(n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in m.named_parameters(remove_duplicate=False)],
                [(n, tuple(t.shape), t.dtype) for n, t in m.named_buffers()])
    mine = described(a)
    return mine == described(b) and not any(hooked for *_, hooked in mine[0])


def _layer_of(name: str, prefix: str) -> int | None:
    match = re.match(re.escape(prefix) + r"\.(\d+)(\.|#|$)", name)  # "layers.3#tp": a tensor axis's flat
    return int(match[1]) if match else None


def _flats_per_layer(flats, prefix: str, n: int) -> bool:
    """Whether each flat parameter lies inside one layer or outside all, and each layer has the same ones."""
    per_layer: dict[int, list] = {}
    for f in flats:
        layers = {_layer_of(m.name, prefix) for m in f.members}
        if len(layers) != 1:
            return False
        layer = layers.pop()
        if layer is not None:
            if _layer_of(f.name, prefix) != layer or _layer_of(f.unit, prefix) != layer:
                return False
            per_layer.setdefault(layer, []).append(_shift(f.name, prefix, -layer))
    return len(per_layer) == n and all(v == per_layer[0] for v in per_layer.values())


def _shift(name, prefix: str, by: int):
    """``name`` with its layer index under ``prefix`` moved by ``by`` (other values unchanged)."""
    if not isinstance(name, str):
        return name
    return re.sub(re.escape(prefix) + r"\.(\d+)(?!\d)", lambda m: f"{prefix}.{int(m[1]) + by}", name)


@contextlib.contextmanager
def _cut(model: torch.nn.Module, prefix: str, k: int):
    """``model`` with only the first ``k`` layers of ``prefix`` for the duration."""
    parent_name, _, attr = prefix.rpartition(".")
    parent = model.get_submodule(parent_name)
    layers = getattr(parent, attr)
    setattr(parent, attr, torch.nn.ModuleList(list(layers)[:k]))
    try:
        yield
    finally:
        setattr(parent, attr, layers)


def _short_trace(model, loss_fn, flats, optimizer, batch, prefix, k, kwargs) -> TracedStep:
    keep = [f for f in flats if (_layer_of(f.name, prefix) or 0) < k]
    short = dict(kwargs)
    if short.get("buffers") is not None:
        short["buffers"] = {b: s for b, s in short["buffers"].items() if (_layer_of(b, prefix) or 0) < k}
    if short.get("tied") is not None:
        short["tied"] = {a: t for a, t in short["tied"].items()
                         if (_layer_of(a, prefix) or 0) < k and (_layer_of(t, prefix) or 0) < k}
    with _cut(model, prefix, k):
        return trace_step(model, loss_fn, tuple(keep), optimizer, batch, **short)


def _replicated(model, loss_fn, flats, optimizer, batch, prefix: str, n: int, kwargs, then) -> TracedStep:
    three = then(_short_trace(model, loss_fn, flats, optimizer, batch, prefix, 3, kwargs))
    four = then(_short_trace(model, loss_fn, flats, optimizer, batch, prefix, 4, kwargs))
    plan = _Periodic(three, four, prefix)
    mine, traced = describe_graph(plan.build(4)), describe_graph(four.graph_module.graph)
    if mine != traced:
        differ = next((i for i, (a, b) in enumerate(zip(mine, traced)) if a != b), min(len(mine), len(traced)))
        raise NotReplicable(f"the 3-layer graph replicated to 4 layers differs from the traced one at node {differ}"
                            f" of {len(traced)}: {mine[differ] if differ < len(mine) else None} vs "
                            f"{traced[differ] if differ < len(traced) else None}")
    graph = plan.build(n)
    full_inputs = graph_inputs(flats, three.optimizer, _buffer_names(model, kwargs), len(three.batch_shapes))
    if len(full_inputs) != sum(1 for node in graph.nodes if node.op == "placeholder"):
        raise NotReplicable("the replicated graph's placeholders are not the model's inputs")
    return TracedStep(graph_module(three.graph_module, graph), full_inputs, three.batch_spec, three.batch_shapes,
                      three.optimizer, replicated_from=3)


def _buffer_names(model, kwargs) -> tuple[str, ...]:
    buffers = kwargs.get("buffers")
    return tuple(buffers) if buffers is not None else tuple(name for name, _ in model.named_buffers())


def _signature(node: fx.Node, role, prefix: str, *, literal: bool):
    """What the alignment compares: op, target (a placeholder: its input), tags (layer indices kept or not), sizes."""
    custom = node.meta.get("custom", {})
    tags = tuple(sorted((k, v if literal else _shift_all(v, prefix)) for k, v in custom.items()))
    if role is None:
        target = str(node.target)
    else:
        target = role.role.value, role.name if literal else _shift_all(role.name, prefix)
    shapes = tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else repr(t)
                   for t in pytree.tree_leaves(node.meta.get("val")))
    return node.op, target, tags, shapes


def _with_inputs(traced: TracedStep):
    """Each node of the graph with the `GraphInput` it receives (None for every node but placeholders)."""
    roles = iter(traced.inputs)
    return [(node, next(roles) if node.op == "placeholder" else None) for node in traced.graph_module.graph.nodes]


def _shift_all(value, prefix: str):
    return re.sub(re.escape(prefix) + r"\.\d+(?!\d)", prefix + ".#", value) if isinstance(value, str) else value


class _Periodic:
    """The 3-layer graph cut into fixed nodes and, at each insertion point, three equal blocks (Note)."""

    def __init__(self, three: TracedStep, four: TracedStep, prefix: str):
        self.prefix = prefix
        self.nodes = list(three.graph_module.graph.nodes)
        a = [_signature(x, r, prefix, literal=True) for x, r in _with_inputs(three)]
        b = [_signature(x, r, prefix, literal=True) for x, r in _with_inputs(four)]
        matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
        points = []
        for tag, i1, i2, j1, j2 in matcher.get_opcodes():
            if tag == "insert":
                points.append((i1, j2 - j1))
            elif tag != "equal":
                raise NotReplicable(f"the 4-layer graph is not the 3-layer one with blocks inserted ({tag})")
        abstract = [_signature(x, r, prefix, literal=False) for x, r in _with_inputs(three)]
        self.block: dict[fx.Node, tuple[int, int, int]] = {}  # node -> (point, layer, offset in block)
        self.regions: dict[int, tuple[int, bool]] = {}  # first index of a region -> (point, ascending)
        for point, (at, size) in enumerate(points):
            start, ascending = self._region(abstract, at, size)
            self.regions[start] = (point, ascending, size)
            for q in range(3 * size):
                layer = q // size if ascending else 2 - q // size
                node = self.nodes[start + q]
                if node in self.block:
                    raise NotReplicable("two insertion points overlap")
                self.block[node] = (point, layer, q % size)

    def _region(self, abstract, at: int, size: int) -> tuple[int, bool]:
        def periodic(start):
            if start < 0 or start + 3 * size > len(abstract):
                return False
            first = abstract[start:start + size]
            return first == abstract[start + size:start + 2 * size] == abstract[start + 2 * size:start + 3 * size]
        options = [(start, asc) for start, asc in ((at - 3 * size, True), (at, False)) if periodic(start)]
        if len(options) != 1:
            where = self.nodes[at].name if at < len(self.nodes) else "the end"
            raise NotReplicable(f"the insertion of {size} nodes before {where} is not next to three equal blocks "
                                f"({len(options)} found)")
        return options[0]

    def build(self, n: int) -> fx.Graph:
        graph = fx.Graph()
        env: dict = {}  # (point, layer, offset) or a fixed node -> the new node
        storages: dict = {}  # (env key of the owner, its leaf) -> the new storage, as a uint8 meta tensor
        self.owners = _storage_owners(self.nodes)
        placeholders = 0
        i = 0
        while i < len(self.nodes):
            region = self.regions.get(i)
            if region is None:
                emitted = [(self.nodes[i], None, None)]
                i += 1
            else:
                point, ascending, size = region
                order = [(0, 0)] + [(1, j) for j in range(1, n - 1)] + [(2, n - 1)]
                if not ascending:
                    order.reverse()
                block = self.nodes[i:i + 3 * size]
                by_layer = {self.block[x][1]: [] for x in block}
                for x in block:
                    by_layer[self.block[x][1]].append(x)
                emitted = [(x, t, j) for t, j in order for x in by_layer[t]]
                i += 3 * size
            for template, t, j in emitted:
                key = template if t is None else (self.block[template][0], j, self.block[template][2])
                env[key] = self._emit(graph, template, t, j, n, env, storages, placeholders)
                if template.op == "placeholder":
                    placeholders += 1
        return graph

    def _target_layer(self, ref: fx.Node, t, j, n: int):
        """The layer of the node ``ref`` stands for, read from a node of layer ``j`` copied from layer ``t``."""
        layer = self.block[ref][1]
        if t is None:  # a fixed node reads layer 0 or the last layer
            if layer == 1:
                raise NotReplicable("a node outside the layers reads the middle layer")
            return 0 if layer == 0 else n - 1
        target = j + layer - t
        if not 0 <= target < n:
            raise NotReplicable("a layer reads one that does not exist")
        return target

    def _key(self, ref: fx.Node, t, j, n: int):
        """The key in ``env`` of the new node that stands for ``ref``, read from layer ``j`` copied from ``t``."""
        if ref not in self.block:
            return ref
        point, _, offset = self.block[ref]
        return point, self._target_layer(ref, t, j, n), offset

    def _mapped(self, ref: fx.Node, t, j, n: int, env):
        key = self._key(ref, t, j, n)
        if key not in env:
            raise NotReplicable("a node reads one that comes after it")
        return env[key]

    def _emit(self, graph: fx.Graph, template: fx.Node, t, j, n: int, env, storages, placeholders: int) -> fx.Node:
        by = 0 if t is None else j - t
        args = fx.node.map_arg(template.args, lambda r: self._mapped(r, t, j, n, env))
        kwargs = fx.node.map_arg(template.kwargs, lambda r: self._mapped(r, t, j, n, env))
        if template.op == "placeholder":
            if not re.fullmatch(r"arg\d+_1", template.name):
                raise NotReplicable(f"placeholder {template.name} is not make_fx's argN_1")
            name = f"arg{placeholders}_1"
            node = graph.create_node("placeholder", name, args, kwargs, name=name, type_expr=template.type)
        else:
            # the template's name without its count ("mm_3" -> "mm", "movedim_int_2" -> "movedim_int"): the graph
            # counts again in creation order, as make_fx and a tensor axis's localize named the traced nodes
            name = re.sub(r"_\d+$", "", template.name)
            node = graph.create_node(template.op, template.target, args, kwargs, name=name, type_expr=template.type)
        meta = dict(template.meta)
        custom = meta.get("custom")
        if custom is not None:
            if t is None:  # a fixed node tagged with the first or last layer (a tp collective between the layers)
                meta["custom"] = {k: self._fixed_tag(v, n) for k, v in custom.items()}
            else:
                meta["custom"] = {k: _shift(v, self.prefix, by) for k, v in custom.items()}  # unit, member, module...
        if "val" in meta:
            meta["val"] = self._value(template, t, j, n, env, storages)
        node.meta = meta
        return node

    def _fixed_tag(self, value, n: int):
        """A fixed node's tag: layer 0's stays, the last layer's (2 of 3) becomes ``n - 1``'s; the middle's cannot."""
        layer = _layer_of(str(value), self.prefix) if isinstance(value, str) else None
        if layer == 1:
            raise NotReplicable(f"a node outside the layers has the middle layer's tag {value!r}")
        return value if layer in (None, 0) else _shift(value, self.prefix, n - 3)

    def _value(self, template: fx.Node, t, j, n: int, env, storages):
        """The template's fake value for the new node: fresh storages where it had its own, views elsewhere."""
        leaves, spec = pytree.tree_flatten(template.meta["val"])
        mine = self._key(template, t, j, n)
        out = []
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                out.append(leaf)
                continue
            if not isinstance(leaf, FakeTensor):
                raise NotReplicable("a value is not a fake tensor")
            owner_node, first = self.owners[storage_key(leaf)]
            owner = (self._key(owner_node, t, j, n), first)  # copies of a block position hold the same leaves
            base = storages.get(owner)
            if base is None:
                if owner[0] != mine:
                    raise NotReplicable(f"a value of {template.name} shares a storage of {owner_node.name}, "
                                        "which the new graph does not have")
                base = torch.empty((leaf.untyped_storage().nbytes(),), dtype=torch.uint8, device="meta")
                storages[owner] = base
            out.append(_view(base, leaf))
        return pytree.tree_unflatten(out, spec)


def _storage_owners(nodes) -> dict:
    """Each storage of the values -> the first node whose value holds it, and the leaf of that value."""
    owners = {}
    for node in nodes:
        for i, leaf in enumerate(pytree.tree_leaves(node.meta.get("val"))):
            if isinstance(leaf, torch.Tensor):
                owners.setdefault(storage_key(leaf), (node, i))
    return owners


def _view(base: torch.Tensor, like: FakeTensor) -> FakeTensor:
    """A fake tensor on ``base``'s (meta) storage with ``like``'s dtype, sizes, strides, offset and device.

    Made from a meta view, not by the fake mode's dispatch (a millisecond an
    op, most of the replication's time): a fake tensor is a meta tensor with a
    device, and its storage is the meta tensor's.
    """
    if base.numel() % like.element_size() or like.requires_grad:
        raise NotReplicable("a value is not a plain view of whole elements")
    elem = base.view(like.dtype).as_strided(like.shape, like.stride(), like.storage_offset())
    return FakeTensor(like.fake_mode, elem, like.device)


def describe_graph(graph: fx.Graph) -> list:
    """Node for node what Note [replicated trace] checks: names, ops, targets, arguments, tags (a tensor axis's
    collectives' too), values.

    A value is, per tensor, its `tensor_layout` and its storage numbered in
    order of first appearance (which values share one).
    """
    storages: dict = {}
    rows = []
    for node in graph.nodes:
        values = []
        for leaf in pytree.tree_leaves(node.meta.get("val")):
            if isinstance(leaf, torch.Tensor):
                values.append((*tensor_layout(leaf), storages.setdefault(storage_key(leaf), len(storages))))
            else:
                values.append(repr(leaf))
        args = fx.node.map_arg((node.args, node.kwargs), lambda r: ("node", r.name))
        rows.append((node.name, node.op, str(node.target), repr(args), node.meta.get("custom"), node.meta.get("sl"),
                     node.meta.get("stack_trace"), "val" in node.meta, tuple(values)))
    return rows
