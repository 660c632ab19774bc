"""The words of the spec language that the compiler also speaks: strategies, recompute, accumulation, random
numbers, backends.

A user writes these (`sl.ZeRO3`, `sl.Recompute.FULL`, `sl.Accumulation.KEEP`);
the compiler decides by them. They are defined here, with the language, and
this module imports nothing of shardlang, so the compiler can read them
without depending on the rest of the front end.
"""

from __future__ import annotations

import enum


class Strategy(enum.Enum):
    """What a unit shards over its layout's mesh axis (see docs/strategies.md).

    ============  ==========  =========  ===============  ==============================
    strategy      parameters  gradients  optimizer state  communication per step
    ============  ==========  =========  ===============  ==============================
    ``ZERO3``     sharded     sharded    sharded          all-gather twice, reduce-scatter
    ``ZERO2``     sharded     sharded    sharded          all-gather once, reduce-scatter
    ``ZERO1``     whole       sharded    sharded          reduce-scatter, all-gather the update
    ``DDP``       whole       whole      whole            all-reduce
    ============  ==========  =========  ===============  ==============================

    ZERO3 frees a unit's gathered parameters after forward and gathers them
    again for backward; ZERO2 keeps them from forward to backward. A replicated
    parameter (layout ``replicate()``) is always handled as DDP.
    """

    ZERO3 = "zero3"
    ZERO2 = "zero2"
    ZERO1 = "zero1"
    DDP = "ddp"

    @property
    def shards_parameters(self) -> bool:
        """Whether a rank holds only a shard of the parameters (and gathers them to compute)."""
        return self in (Strategy.ZERO3, Strategy.ZERO2)

    @property
    def shards_gradients(self) -> bool:
        """Whether gradients are reduce-scattered (each rank keeps and updates one shard)."""
        return self is not Strategy.DDP


class Recompute(enum.Enum):
    """What a unit keeps of its forward for backward, and what it computes again (docs/spec.md, "Recompute").

    - ``NONE``: keep every activation backward reads (the default).
    - ``FULL``: keep only the unit's inputs (and outputs, which the next unit
      keeps anyway); run its forward again just before its backward.
    - ``SELECTIVE``: keep the outputs of matmuls and attention, recompute the
      cheap ops between them (torchtitan's op-level policy).

    The pass is `compiler.passes.recompute_activations`.
    """

    NONE = "none"
    FULL = "full"
    SELECTIVE = "selective"


class Accumulation(enum.Enum):
    """How k micro-batches share one optimizer step (docs/training.md, "Gradient accumulation").

    - ``PER_MICROBATCH``: each micro-batch gathers, frees and reduce-scatters on
      its own, and each rank adds the reduced gradient shard into an accumulator:
      k times the collectives of one step, the memory of one micro-batch step.
    - ``KEEP``: the parameters are gathered once and kept for all k micro-batches;
      unreduced full gradients are summed across micro-batches and reduced once:
      the collectives of one step, plus the gathered parameters and the full
      gradients held for the whole step.
    """

    PER_MICROBATCH = "per_microbatch"
    KEEP = "keep"


class RandomScheme(enum.Enum):
    """How each rank draws random numbers (dropout); docs/training.md, "Dropout and random numbers".

    - ``PER_RANK``: rank r draws from its own generator, seeded with
      ``seed * 1_000_003 + r``; ranks draw different masks for their rows, as
      under DDP. Cheap; statistically, not bitwise, what one process does.
    - ``GLOBAL``: every rank draws the mask of the whole global batch from a
      generator seeded with ``seed`` and keeps its own rows: bitwise the masks one
      process seeded with ``seed`` draws, at N times the random numbers and the
      mask memory. For checking parity, not for scale.
    """

    PER_RANK = "per_rank"
    GLOBAL = "global"


class StepBackend(enum.Enum):
    """What runs the bound step graph (`Options(backend=...)`). Example: ``StepBackend("inductor")``."""

    EAGER = "eager"
    INDUCTOR = "inductor"
