"""Each strategy's communication formula, computed from a schedule's flat parameters alone.

Per rank per step, for one flat parameter of padded bytes P (``FlatSummary.padded_bytes``),
sharded over an axis of S ranks on a world of N = S * R ranks (R replicas; R = 1
on a 1-D mesh), the payload bytes of each collective are (docs/strategies.md):

=========  ===============================  ==============  ========================
strategy   all_gather                       reduce_scatter  all_reduce
=========  ===============================  ==============  ========================
ZERO3      Pg, plus Pg if re-gathered        Pr              Pr / S across replicas
ZERO2      Pg                               Pr              Pr / S across replicas
ZERO1      P (the updated shards)           Pr              Pr / S across replicas
DDP        0                                0               its unpadded bytes, reduce dtype
=========  ===============================  ==============  ========================

Under mixed precision the bytes follow the dtypes (``FlatSummary.gathered_bytes``,
``reduced_bytes``): Pg is P in ``param_dtype`` (gathers move what is computed
with), Pr in the dtype gradients are reduced in (``reduce_dtype``, else
``param_dtype``); ZERO1 gathers its updated master shards, in the master dtype.
Without mixed precision Pg = Pr = P.

Frozen flat parameters have no reduce-scatter, no all-reduce and (ZERO1) no
gather of updated shards; a frozen ZERO3 / ZERO2 flat parameter is still
gathered. "Re-gathered" is the compiler's choice (Note [keep the last unit]);
the schedule marks those gathers "re-gather for backward". All-reduces of no
flat parameter (BatchNorm statistics, a gradient norm) are added as they are.
Summed over flat parameters this gives the textbook totals: ZERO3 ``M + R``
(``R <= M``) all-gathered and ``M`` reduce-scattered, ZERO2 and ZERO1 ``M`` and
``M``, DDP ``M`` all-reduced.

In a world of one, a flat parameter whose update reads its member gradients
has no reduction at all (Note [updates from member gradients]): the formula
counts a reduction only for those the schedule kept, as it reads re-gathers.

An evaluation schedule (`compiler.evaluate`) gathers each ZERO3 / ZERO2 flat
parameter once, P, and has nothing else: no re-gather, no reduction.

Example::

    assert formula_bytes(schedule) == schedule.summary.bytes_per_rank
"""

from __future__ import annotations

from shardlang.spec.vocabulary import Strategy
from ..schedule.schedule import COLLECTIVE_KINDS, FlatSummary, OpKind, Schedule

REGATHER_DETAIL = "re-gather for backward"


def formula_bytes(schedule: Schedule) -> dict[str, int]:
    """The payload bytes per rank per step by collective kind that the strategies' formulas give."""
    total = {k.value: 0 for k in COLLECTIVE_KINDS}
    for name, row in formula_bytes_by_flat(schedule).items():
        for kind, n in row.items():
            total[kind] += n
    for op in schedule.ops:  # collectives of no flat parameter: BatchNorm statistics, a gradient norm,
        if op.kind in COLLECTIVE_KINDS and op.flat is None:  # a tensor axis's activations
            total[op.kind.value] += op.bytes
    return total


def formula_bytes_by_flat(schedule: Schedule) -> dict[str, dict[str, int]]:
    """The formula's payload bytes per rank per step for each flat parameter, by collective kind."""
    regathered = {op.flat for op in schedule.ops if op.kind is OpKind.ALL_GATHER and op.detail == REGATHER_DETAIL}
    # Note [updates from member gradients]: in a world of one a gradient may go unpacked and unreduced.
    elided = set() if schedule.world_size != 1 else {f.name for f in schedule.flats} - {
        op.flat for op in schedule.ops if op.kind in (OpKind.REDUCE_SCATTER, OpKind.ALL_REDUCE)}
    out = {}
    for f in schedule.flats:
        row = {k.value: 0 for k in COLLECTIVE_KINDS}
        for kind, _group, payload in flat_collectives(f, dict(schedule.mesh), schedule.world_size,
                                                      regathered=f.name in regathered, reduced=f.name not in elided,
                                                      evaluation=schedule.is_evaluation):
            row[kind] += payload
        out[f.name] = row
    return out


def flat_collectives(f: FlatSummary, mesh: dict[str, int], world_size: int, *, regathered: bool,
                     reduced: bool = True, evaluation: bool = False) -> list[tuple[str, int, int]]:
    """The collectives the formula gives one flat parameter per step: ``(kind, group size, payload bytes)``.

    ``mesh`` maps axis names to sizes; ``regathered``: ZeRO-3 gathers it again
    for backward; ``reduced``: its gradient is reduced (False only in a world of one).
    """
    if f.strategy is Strategy.DDP or not f.sharded:
        if f.trainable and not evaluation and reduced:
            return [("all_reduce", world_size, f.numel * (f.reduce_element_size or f.element_size))]
        return []
    if evaluation:
        return [("all_gather", world_size, f.gathered_bytes)] if f.strategy.shards_parameters else []
    shard_group = mesh.get(f.axis, world_size) if f.axis else world_size
    replicas = world_size // shard_group
    out = []
    if f.strategy.shards_parameters:
        out += [("all_gather", shard_group, f.gathered_bytes)] * (2 if regathered else 1)
    if f.trainable and f.strategy is Strategy.ZERO1:
        out.append(("all_gather", shard_group, f.padded_bytes))
    if f.trainable and reduced:
        out.append(("reduce_scatter", shard_group, f.reduced_bytes))
        if replicas > 1:
            out.append(("all_reduce", replicas, f.reduced_bytes // shard_group))
    return out
