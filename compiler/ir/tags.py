"""The compiler's annotations on the nodes it inserts: one frozen `NodeTag` per node, its kind a `NodeKind`.

Two kinds of annotation live on a node's meta:

- ``meta["custom"]``: what the trace knew (the phase, the unit, the optimizer's
  flat parameter, the micro-batch), written by fx's ``annotate`` while tracing
  and read through `compiler.ir.trace.phase_of` / `tag_of`;
- ``meta["sl"]``: a `NodeTag`, on every node a pass inserts (a collective, its
  wait, a free, a pack, an unpack, a cast, an average, a clipping or skipping
  op). The schedule, the memory plan and the later passes read these tags,
  never node names.

A tag is frozen: a pass that marks a node again replaces its tag
(`retag`), so a graph copied with shallow meta copies stays as it was.
`verify_tags` checks every tag of a graph against the flat parameters and the
collectives' pairing; the pass pipeline runs it after its last pass.

Example::

    issued = tag(graph.call_function(collectives.all_gather, (shard, "fsdp", 4)), NodeKind.ALL_GATHER,
                 "layers.0", Phase.FORWARD)
    kind_of(issued) is NodeKind.ALL_GATHER
"""

from __future__ import annotations

import enum

import attrs
import torch.fx as fx

from shardlang.errors import CompileError
from . import collectives
from .trace import Phase, phase_of


class NodeKind(enum.Enum):
    """What an inserted node does. The values are the names the JSON and the docs use."""

    ALL_GATHER = "all_gather"  # issue of a gather (also ZERO1's gather of updated shards: ``update=True``)
    REDUCE_SCATTER = "reduce_scatter"  # issue of a sharded gradient's reduction
    ALL_REDUCE = "all_reduce"  # issue of a replicated gradient's, a norm's or batch statistics' reduction
    WAIT_GATHER = "wait_gather"  # the gathered buffer is ready
    WAIT_REDUCE = "wait_reduce"  # the reduced gradient (or statistic) is ready
    WAIT_UPDATE = "wait_update"  # ZERO1's updated shards are all gathered
    FREE = "free"  # the gathered buffer (and its copies) end their life
    PACK = "pack"  # member gradients concatenated into the reduction's layout
    UNPACK = "unpack"  # one member parameter out of the gathered buffer
    CAST = "cast"  # the shard cast to the compute dtype before its gather
    AVERAGE = "average"  # the reduced gradient divided by the ranks (or summed over micro-batches)
    CLIP = "clip"  # the global norm and the clipping of the gradients by it
    SKIP = "skip"  # whether this step's update runs (Note [skip by select])
    SLOT = "slot"  # a buffer of the step's pool, held between steps (Note [buffer assignment])

    @property
    def is_collective(self) -> bool:
        return self in _COLLECTIVES

    @property
    def is_wait(self) -> bool:
        return self in _WAITS


_COLLECTIVES = frozenset({NodeKind.ALL_GATHER, NodeKind.REDUCE_SCATTER, NodeKind.ALL_REDUCE})
_WAITS = frozenset({NodeKind.WAIT_GATHER, NodeKind.WAIT_REDUCE, NodeKind.WAIT_UPDATE})


@attrs.frozen
class NodeTag:
    """One inserted node's annotation.

    ``flat`` is the flat parameter it serves (None for a norm or batch
    statistics). The rest say more about some kinds: ``member`` names an
    unpack's member parameter; ``detail`` is what the schedule shows beside a
    collective ("gradient norm", "batch statistics"); ``regather`` marks a
    backward re-gather, ``update`` ZERO1's gather of updated shards; ``norm``
    marks the global gradient norm and ``flats`` orders its per-flat vector;
    ``kept`` marks a pack whose buffer the bound step keeps between steps
    (Note [kept reduction buffers]).
    """

    kind: NodeKind = attrs.field(validator=attrs.validators.instance_of(NodeKind))
    flat: str | None = None
    member: str | None = None
    detail: str = ""
    regather: bool = False
    update: bool = False
    norm: bool = False
    flats: tuple[str, ...] = ()
    kept: bool = False


#: node meta: the bytes of logits a loss on vocabulary blocks never gathers (Note [loss parallelism])
LOGITS_NEVER_GATHERED = "sl_logits_never_gathered"


def tag(node: fx.Node, kind: NodeKind, flat: str | None, phase: Phase | None, **fields) -> fx.Node:
    """Mark an inserted node for the schedule and for later passes; set its phase when given."""
    node.meta["sl"] = NodeTag(kind, flat, **fields)
    if phase is not None:
        set_phase(node, phase)
    return node


def retag(node: fx.Node, **changes) -> None:
    """Replace some fields of ``node``'s tag (a new frozen tag: copies of the graph keep the old one)."""
    node.meta["sl"] = attrs.evolve(node.meta["sl"], **changes)


def set_phase(node: fx.Node, phase: Phase) -> None:
    """Set a node's phase tag (a fresh dict: traced nodes may share one ``custom`` dict)."""
    node.meta["custom"] = {**node.meta.get("custom", {}), "phase": phase.value}


def node_tag(node: fx.Node) -> NodeTag | None:
    """The tag a pass put on ``node``; None for a node the trace made."""
    return node.meta.get("sl")


def kind_of(node: fx.Node) -> NodeKind | None:
    """The kind of the node a pass inserted; None for a node the trace made."""
    t = node.meta.get("sl")
    return t.kind if t is not None else None


def is_kept(node: fx.Node) -> bool:
    """Whether ``node`` is a pack whose buffer the bound step keeps between steps (Note [kept reduction buffers])."""
    t = node.meta.get("sl")
    return t is not None and t.kept


def writes_into_slot(node: fx.Node) -> bool:
    """Whether ``node``'s value lies in a slot of the step's pool (Note [buffer assignment]): a gather or a pack
    that an argument of kind SLOT receives."""
    return any(kind_of(a) is NodeKind.SLOT for a in node.all_input_nodes)


def gathers_parameters(node: fx.Node) -> bool:
    """Whether ``node`` issues or waits for a gather of a flat parameter (FSDP's), not of an activation.

    A tensor axis's redistributions (`compiler.placement.localize`) gather
    activations: they carry no flat, are never freed, and no prefetch moves them.
    """
    t = node.meta.get("sl")
    return t is not None and t.flat is not None and t.kind in (NodeKind.ALL_GATHER, NodeKind.WAIT_GATHER)


def is_inserted(node: fx.Node) -> bool:
    """Whether a pass inserted ``node`` (it carries a `NodeTag`)."""
    return "sl" in node.meta


_WAIT_OF = {NodeKind.ALL_GATHER: (NodeKind.WAIT_GATHER, NodeKind.WAIT_UPDATE),
            NodeKind.REDUCE_SCATTER: (NodeKind.WAIT_REDUCE,), NodeKind.ALL_REDUCE: (NodeKind.WAIT_REDUCE,)}


def verify_tags(graph: fx.Graph, flat_names) -> None:
    """Every tag is a `NodeTag` on a node with a phase, names a known flat parameter, and pairs as it should.

    Pairing: a collective's issue is read by exactly one wait of its kind
    (`_WAIT_OF`), and every wait reads a tagged collective; an unpack names its
    member. Raises `CompileError` naming the node.
    """
    known = set(flat_names)
    for node in graph.nodes:
        if "sl" not in node.meta:
            continue
        t = node.meta["sl"]
        if not isinstance(t, NodeTag):
            raise CompileError(f"{node.name}: meta['sl'] is {type(t).__name__}, not a NodeTag")
        if phase_of(node) is None:
            raise CompileError(f"{node.name} ({t.kind.value}) has no phase")
        if t.flat is not None and t.flat not in known:
            raise CompileError(f"{node.name} ({t.kind.value}) names flat parameter {t.flat!r}, which this step lacks")
        if t.kind is NodeKind.UNPACK and not t.member:
            raise CompileError(f"{node.name} unpacks no named member")
        if t.kind.is_collective:
            _check_issue(node, t)
        elif t.kind.is_wait:
            issue = node.args[0] if node.args else None
            issued = issue.meta.get("sl") if isinstance(issue, fx.Node) else None
            if issued is None or not issued.kind.is_collective or t.kind not in _WAIT_OF[issued.kind]:
                raise CompileError(f"{node.name} ({t.kind.value}) waits for {getattr(issue, 'name', issue)}, "
                                   "which is not a collective of its kind")


def _check_issue(node: fx.Node, t: NodeTag) -> None:
    if collectives.group_of(node) is None:
        raise CompileError(f"{node.name} is tagged {t.kind.value} but runs {node.target}, not a collective")
    waits = [u for u in node.users if kind_of(u) in _WAIT_OF[t.kind]]
    if len(waits) != 1:
        raise CompileError(f"{node.name} ({t.kind.value}) is waited for {len(waits)} times; it must be once")
