"""Issue each all-gather ``prefetch`` units early, so it runs while earlier units compute.

Before: every gather is issued right before its own wait, just ahead of the
unit's first use, so the compute waits for the whole transfer.
After: within forward, and within backward, the gathers form a sequence
g0, g1, g2, ... in the order their waits appear. With depth d, the issue of
g(j) moves to just after the wait of g(j-d) (of g0 when j <= d): while unit i
computes, the next d units are already in flight. A depth beyond the number
of gathers prefetches everything after the first, so memory never falls as
the depth grows (what `Options.memory_budget`'s search relies on). Waits stay where they are (just before first
use), so correctness is untouched; memory grows by up to d gathered units,
which the schedule shows. Depth 0 leaves the graph as it is.

Invariant: every gather is still issued after its input exists and before its
wait; only the issue nodes move, and only earlier.
"""

from __future__ import annotations

import torch.fx as fx

from ..context import CompileContext
from ..ir.graph_utils import positions
from ..ir.tags import NodeKind, gathers_parameters, kind_of
from ..ir.trace import Phase, phase_of
from .contract import GraphProperty, graph_pass


@graph_pass(requires={GraphProperty.PARAMETERS_GATHERED, GraphProperty.GATHERS_FREED},
            establishes={GraphProperty.GATHERS_PREFETCHED})
def prefetch_gathers(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    if ctx.prefetch <= 0:
        return gm
    for phase in (Phase.FORWARD, Phase.BACKWARD):
        waits = [n for n in gm.graph.nodes if kind_of(n) is NodeKind.WAIT_GATHER and gathers_parameters(n)
                 and phase_of(n) is phase]
        order = positions(gm.graph)
        for j in range(1, len(waits)):
            # Gather j is issued right after the wait of gather j - d (the first one's, for j <= d).
            wait, issue = waits[max(j - ctx.prefetch, 0)], waits[j].args[0]
            # Only move earlier: the target spot must precede the issue's current place.
            if order[wait] < order[issue]:
                source = issue.args[0]
                if kind_of(source) is NodeKind.CAST and len(source.users) == 1:
                    wait.append(source)  # mixed precision: the shard's cast moves with its gather
                    source.append(issue)
                else:
                    wait.append(issue)
    gm.recompile()
    return gm
