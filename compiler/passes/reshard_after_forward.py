"""Free each gathered unit after its last forward use, and re-gather it for backward.

Before: each sharded flat parameter is gathered once (`gather_parameters`) and
its rebuilt parameters, with every view taken of them, are used by forward and
backward alike, so the gathered memory lives from its gather to the end of
backward.

After, for each flat parameter whose strategy is ZERO3 (full sharding; the
decision is per flat parameter, so per unit):
  - a ``free`` node follows the last forward use of the gathered buffer and of
    everything that aliases it;
  - a second ``all_gather -> wait -> unpack`` is issued before the first
    backward use, and a ``free`` follows the last backward use;
  - Note [backward views]: backward often reads *views* that forward took of a
    weight (``t(w)`` for a linear layer). Those views alias the forward-gathered
    storage and would keep it alive; the pass rebuilds each such view chain from
    the re-gathered tensor and points backward at the rebuilt chain.
Under ZERO2 (no resharding), one ``free`` follows the last use in backward.

Note [keep the last unit]: a unit whose last forward use and first backward
use have no other gather between them (typically the last block and the root,
which holds the output head) is not freed and re-gathered: nothing else could
use the memory in between, so resharding would only add a collective. FSDP2
leaves the same choice to the user (``reshard_after_forward=False`` on the
root); the compiler sees it in the graph. A unit whose parameters backward
never reads (the first layer, when the input needs no gradient) is not
re-gathered either. Both show in the schedule as a missing "re-gather".

Invariant: every ``wait_gather`` node's alias closure is used only between it
and exactly one ``free`` node (kind "free") that names it.
"""

from __future__ import annotations

import torch.fx as fx

from ..ir import collectives
from ..context import CompileContext
from ..ir.graph_utils import alias_closure, unpack_copies, first_user, last_user, phase_is, positions
from ..ir.tags import NodeKind, gathers_parameters, kind_of, node_tag, set_phase, tag
from shardlang.spec.vocabulary import Strategy
from ..ir.trace import Phase, phase_of
from .contract import GraphProperty, graph_pass


@graph_pass(requires={GraphProperty.PARAMETERS_GATHERED}, establishes={GraphProperty.GATHERS_FREED})
def reshard_after_forward(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    graph = gm.graph
    resharded = {f.name for f in ctx.flats if f.strategy is Strategy.ZERO3}
    regathered = False
    for wait in _gathered(graph):
        if node_tag(wait).flat in resharded:
            _regather_for_backward(graph, wait, alias_closure(wait), node_tag(wait).flat)
            regathered = True
    if regathered:
        collectives.eliminate_dead_code(graph)  # forward views that only backward read
    for wait in _gathered(graph):
        _insert_free(graph, alias_closure(wait), node_tag(wait).flat)
    gm.recompile()
    return gm


def _gathered(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if kind_of(n) is NodeKind.WAIT_GATHER and gathers_parameters(n)]


def _regather_for_backward(graph: fx.Graph, wait: fx.Node, closure: list[fx.Node], flat: str) -> fx.Node | None:
    """Issue a second gather before the first backward use and move backward's reads onto it."""
    order = positions(graph)
    in_closure = set(closure)
    is_backward_reader = lambda u: u not in in_closure and phase_is(Phase.BACKWARD)(u)  # noqa: E731
    anchor = first_user(closure, order, is_backward_reader)
    if anchor is None:
        return None  # backward never reads these parameters: no re-gather at all
    last_forward = last_user(closure, order, lambda u: u not in in_closure and not is_backward_reader(u))
    if last_forward is not None and not _gathers_between(order, last_forward, anchor):
        return None  # Note [keep the last unit]
    issue = wait.args[0]
    with graph.inserting_before(anchor):
        args = issue.args
        if kind_of(args[0]) is NodeKind.CAST:  # mixed precision: cast the shard again, don't keep the copy
            args = (graph.node_copy(args[0]), *args[1:])
            set_phase(args[0], Phase.BACKWARD)
        reissued = tag(graph.call_function(collectives.all_gather, args), NodeKind.ALL_GATHER, flat, Phase.BACKWARD,
                       regather=True)
        rewait = tag(graph.call_function(collectives.wait, (reissued,)), NodeKind.WAIT_GATHER, flat, Phase.BACKWARD)
        copies = {wait: rewait}
        for node in closure[1:]:
            if not _reaches_backward(node, in_closure, is_backward_reader):
                continue
            copy = graph.node_copy(node, lambda arg: copies.get(arg, arg))
            set_phase(copy, Phase.BACKWARD)
            copies[node] = copy
    for node, copy in copies.items():
        for user in list(node.users):
            if is_backward_reader(user):
                user.replace_input_with(node, copy)
    return rewait


def _gathers_between(order, start: fx.Node, end: fx.Node) -> bool:
    """Whether an all-gather comes strictly between ``start`` and ``end`` in graph order."""
    if not order[start] < order[end]:
        return False
    node = start.next
    while node is not end and node.op != "root":
        if kind_of(node) is NodeKind.ALL_GATHER and gathers_parameters(node):
            return True
        node = node.next
    return False


def _reaches_backward(node: fx.Node, in_closure, is_backward_reader) -> bool:
    """Whether a backward node reads ``node`` directly or through further views in the closure."""
    stack = [node]
    while stack:
        n = stack.pop()
        for user in n.users:
            if is_backward_reader(user):
                return True
            if user in in_closure:
                stack.append(user)
    return False


def _insert_free(graph: fx.Graph, closure: list[fx.Node], flat: str) -> None:
    """A ``free`` right after the last read of anything in ``closure``, in that read's phase."""
    order = positions(graph)
    members = set(closure)
    last = last_user(closure, order, lambda u: u not in members)
    if last is None:
        last = closure[-1]
    with graph.inserting_after(last):
        tag(graph.call_function(collectives.free, tuple(_kept_until_free(closure))), NodeKind.FREE, flat,
            phase_of(last) or Phase.FORWARD)


def _kept_until_free(closure: list[fx.Node]) -> list[fx.Node]:
    """What the unit's ``free`` holds on to: all of it, but the gathered buffer when nothing views it.

    Note [copy-out frees the buffer]: when every member is copied out of the
    gathered buffer (a unit of several parameters), nothing needs the buffer
    after the last copy, so the free does not name it and the generated code
    drops it right after unpacking, as FSDP2 frees its all-gather output after
    copy-out. The unit then costs its parameters once, not twice.
    """
    buffer = closure[0]
    readers = list(buffer.users)
    if readers and all(kind_of(u) is NodeKind.UNPACK and unpack_copies(u) for u in readers):
        return closure[1:]
    return closure
