"""The pass pipeline: a plain list of passes, run in order, each named on failure.

Mirrors torch.fx's pass manager: a failing pass is reported as
``pass X failed after [a, b]``, and ``dump_dir`` writes the graph before and
after every pass for debugging. ``check`` runs after each pass (tests pass the
schedule verifier here).

Before anything runs, the order is checked against the passes' contracts
(`passes.contract`): each pass's requirements are established by a pass
before it, and no pass breaks what an earlier one established. After the
last pass every node's tag is verified (`compiler.ir.tags.verify_tags`).

The graph is linted (`fx.Graph.lint`: every argument defined before its use,
every target resolvable) once, after the last pass: on the 80-layer 70B
graph a lint takes a tenth of a second, and the memory budget compiles a
step several times. With ``check`` (``check_each_pass``) it is linted after
every pass, so a malformed graph is blamed on the pass that made it.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Sequence

import torch.fx as fx

from ..context import CompileContext
from shardlang.errors import CompileError
from ..ir.provenance import failing_node, site_of_node
from ..ir.tags import verify_tags
from .contract import GraphProperty, contract_of, order_error
from .accumulate_microbatches import accumulate_microbatches
from .add_gradients_in_place import add_gradients_in_place
from .clip_gradients import clip_gradients
from .elide_local_reductions import elide_local_reductions
from .gather_parameters import gather_parameters
from .gather_updated_shards import gather_updated_shards
from .keep_reduction_buffers import keep_reduction_buffers
from .limit_reductions_in_flight import limit_reductions_in_flight
from .prefetch_gathers import prefetch_gathers
from .recompute_activations import recompute_activations
from .reduce_gradients import reduce_gradients
from .reduce_in_place import reduce_in_place
from .reshard_after_forward import reshard_after_forward
from .shard_optimizer import shard_optimizer
from .skip_nonfinite_updates import skip_nonfinite_updates
from .split_batch_stat_reductions import split_batch_stat_reductions

Pass = Callable[[fx.GraphModule, CompileContext], fx.GraphModule]

DEFAULT_PASSES: tuple[Pass, ...] = (
    split_batch_stat_reductions,
    gather_parameters,
    recompute_activations,
    reshard_after_forward,
    prefetch_gathers,
    reduce_gradients,
    accumulate_microbatches,
    clip_gradients,
    skip_nonfinite_updates,
    limit_reductions_in_flight,
    gather_updated_shards,
    shard_optimizer,
    add_gradients_in_place,
    elide_local_reductions,
    keep_reduction_buffers,
    reduce_in_place,
)


def run_passes(gm: fx.GraphModule, ctx: CompileContext, passes: Sequence[Pass] = DEFAULT_PASSES, *,
               check: Callable[[fx.GraphModule, CompileContext, frozenset[GraphProperty]], None] | None = None,
               dump_dir: str | pathlib.Path | None = None) -> fx.GraphModule:
    """Run ``passes`` over ``gm`` in order; wrap any failure with the pass's name and its predecessors."""
    wrong_order = order_error(passes)
    if wrong_order is not None:
        raise CompileError(wrong_order)
    done: list[str] = []
    established: set[GraphProperty] = set()
    for index, p in enumerate(passes):
        name = p.__name__
        if dump_dir is not None:
            _dump(gm, dump_dir, f"{index:02d}_before_{name}")
        try:
            gm = p(gm, ctx)
            established |= contract_of(p).establishes
            if check is not None:
                check(gm, ctx, frozenset(established))
        except CompileError as exc:
            if exc.pass_name is None:
                exc.pass_name, exc.passes_before = name, tuple(done)
                exc.site = exc.site or _site(exc, gm)
                exc.args = (f"pass {name} failed after {done}{_at(exc.site)}: {exc}",)
            raise
        except Exception as exc:
            site = _site(exc, gm)
            raise CompileError(f"pass {name} failed after {done}{_at(site)}: {type(exc).__name__}: {exc}",
                               pass_name=name, passes_before=tuple(done), site=site) from exc
        done.append(name)
    try:
        gm.graph.lint()
        verify_tags(gm.graph, (f.name for f in ctx.flats))
    except Exception as exc:
        raise CompileError(f"the graph after passes {done} is malformed: {exc} (compile with check_each_pass=True "
                           "to find the pass that made it)", passes_before=tuple(done)) from exc
    if dump_dir is not None:
        _dump(gm, dump_dir, f"{len(passes):02d}_final")
    return gm


def _site(exc: BaseException, gm: fx.GraphModule):
    """The user's line and module behind the node the pass was visiting, if it was visiting one."""
    node = failing_node(exc, gm.graph)
    return site_of_node(node) if node is not None else None


def _at(site) -> str:
    return f", on the op made at {site}\n" if site else ""


def _dump(gm: fx.GraphModule, dump_dir, stem: str) -> None:
    path = pathlib.Path(dump_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"{stem}.py").write_text(gm.code)
