"""Training features as plain data: clipping, parameter groups, accumulation, random numbers.

The front end (`shardlang.spec.spec`, `shardlang.groups`) turns a user's spec into one
`Training` value; the compiler reads it from `CompileContext.training` and never
sees the spec syntax. docs/training.md describes each feature, its spec syntax,
what it adds to the schedule and its formulas.

Example::

    Training(clip_grad_norm=1.0, microbatches=4, accumulation=Accumulation.KEEP,
             group_overrides=({"weight_decay": 0.0},), group_of={"fc.bias": 1})
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from shardlang.spec.vocabulary import Accumulation, RandomScheme




def per_rank_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s generator under `RandomScheme.PER_RANK`."""
    return seed * 1_000_003 + rank


@attrs.frozen
class Training:
    """The training features of one compilation.

    - ``clip_grad_norm``: clip the global gradient norm to this value (None: no clipping).
    - ``microbatches`` / ``accumulation``: k micro-batches per optimizer step, and how.
    - ``group_overrides``: for parameter group g >= 1, the optimizer hyperparameters
      it overrides (group 0 is the optimizer as given); ``group_of``: the group of
      each trainable parameter that is not in group 0, by name.
    - ``random`` / ``seed``: how ranks draw random numbers (`RandomScheme`).
    - ``skip_nonfinite``: skip (and count) the optimizer update of a step whose global
      gradient norm is inf or nan, inside the step (`passes/skip_nonfinite_updates`).
    """

    clip_grad_norm: float | None = None
    microbatches: int = 1
    accumulation: Accumulation = Accumulation.PER_MICROBATCH
    group_overrides: tuple[Mapping[str, object], ...] = attrs.field(default=(), converter=tuple)
    group_of: Mapping[str, int] = attrs.field(factory=dict)
    random: RandomScheme = RandomScheme.PER_RANK
    seed: int = 0
    skip_nonfinite: bool = False

    def group(self, param_name: str) -> int:
        return self.group_of.get(param_name, 0)

    @property
    def groups(self) -> int:
        """How many parameter groups there are, the default group 0 included."""
        return 1 + len(self.group_overrides)

    def schedule_options(self) -> dict[str, object]:
        """What the schedule's ``options`` show of these features (only what differs from the defaults)."""
        shown: dict[str, object] = {}
        if self.clip_grad_norm is not None:
            shown["clip_grad_norm"] = self.clip_grad_norm
        if self.microbatches > 1:
            shown["microbatches"] = self.microbatches
            shown["accumulation"] = self.accumulation.value
        if self.group_overrides:
            shown["param_groups"] = len(self.group_overrides)
        if self.skip_nonfinite:
            shown["skip_nonfinite"] = True
        if self.random is not RandomScheme.PER_RANK or self.seed:
            shown["random"] = f"{self.random.value}, seed {self.seed}"
        return shown


def split_by_group(flats, training: Training):
    """Split every trainable flat parameter whose members fall in several parameter groups, one flat per group.

    The optimizer runs on flat parameters, so a group boundary is a flat
    boundary: the members of group g >= 1 form the flat ``<name>#group<g>``
    (members keep their order; offsets are recomputed). Frozen flat parameters
    have no optimizer and stay whole. Example: with ``group_of={"fc.bias": 1}``
    the root flat ``<root>`` becomes ``<root>`` (the weights) and
    ``<root>#group1`` (the bias).
    """
    if not training.group_of:
        return tuple(flats)
    out = []
    for flat in flats:
        by_group: dict[int, list] = {}
        for m in flat.members:
            by_group.setdefault(training.group(m.name) if flat.trainable else 0, []).append(m)
        for g, members in by_group.items():
            offset, placed = 0, []
            for m in members:
                placed.append(attrs.evolve(m, offset=offset))
                offset += m.piece_numel
            name = flat.name if g == 0 else f"{flat.name}#group{g}"
            out.append(attrs.evolve(flat, name=name, members=tuple(placed), group=g))
    return tuple(out)
