"""Bucketing: merge small flat parameters into one collective.

A collective costs a fixed latency (alpha) on top of its bytes; for a small
flat parameter (a unit of norms and biases, a replicated bias) the latency
dominates. `bucket_flat_params` merges runs of consecutive small flat
parameters that are alike (same axis, trainability, dtypes, strategy) into one
flat parameter, so they are gathered, reduced and updated together. A flat
parameter at least ``bucket_bytes`` large is left alone; a bucket grows until
it reaches ``bucket_bytes``. Consecutive means in parameter order, which is
close to use order, so a bucket's units are used close together and keeping
them gathered together costs little memory.

The merged flat parameter's unit is its units joined with "+"
(``blocks.0.ln1+blocks.0.ln2``), which is how the schedule shows it. The
numbers behind the default are in docs/plan.md ("Bucketing").
"""

from __future__ import annotations

import attrs

from .flat import FlatParam

_IDENTITY = ("name", "unit", "members")


def bucket_flat_params(flats: tuple[FlatParam, ...], bucket_bytes: int) -> tuple[FlatParam, ...]:
    """Merge runs of consecutive, alike flat parameters smaller than ``bucket_bytes``; 0 turns it off."""
    if bucket_bytes <= 0:
        return flats
    out: list[FlatParam] = []
    run: list[FlatParam] = []

    def close_run() -> None:
        if run:
            out.append(_merge(run) if len(run) > 1 else run[0])
            run.clear()

    for flat in flats:
        small = _bytes(flat) < bucket_bytes
        if not small:
            close_run()
            out.append(flat)
            continue
        if run and (not _alike(run[0], flat) or sum(map(_bytes, run)) >= bucket_bytes):
            close_run()
        run.append(flat)
    close_run()
    return tuple(out)


def _bytes(flat: FlatParam) -> int:
    return flat.padded_numel * flat.element_size if flat.sharded else flat.numel * flat.element_size


def _alike(a: FlatParam, b: FlatParam) -> bool:
    return all(getattr(a, f.name) == getattr(b, f.name) for f in attrs.fields(FlatParam) if f.name not in _IDENTITY)


def _merge(run: list[FlatParam]) -> FlatParam:
    members, offset = [], 0
    for flat in run:
        for m in flat.members:
            members.append(attrs.evolve(m, offset=offset))
            offset += m.piece_numel
    units = "+".join(f.unit or "<root>" for f in run)
    suffix = run[0].name[len(run[0].unit or "<root>"):]  # "#frozen", "#replicated", ...
    return attrs.evolve(run[0], name=units + suffix, unit=units, members=tuple(members))
