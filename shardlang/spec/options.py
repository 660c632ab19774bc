"""`Options`: how the compiled step trades memory for overlap, and the training features it runs.

One flat record of keywords, as FSDP2's and DeepSpeed's options are, read from
Python (``Options(prefetch=2)``) or from a spec's ``[options]`` table
(`options_from_dict`). `ResolvedSpec.config` sorts them into the compiler's
records by concern (`compiler.config.StepConfig`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

import attrs

from shardlang.errors import SpecError, member_of
from shardlang.spec import training
from shardlang.spec.precision import MixedPrecision
from shardlang.spec.vocabulary import StepBackend

__all__ = ["Options", "options_from_dict"]

_OPTION_KEYS = ("reshard_after_forward", "prefetch", "mixed_precision", "clip_grad_norm", "microbatches", "accumulation",
                "random", "seed", "bucket_bytes", "memory_budget", "skip_nonfinite", "backend",
                "keep_reduction_buffers", "buffer_pool", "sequence_parallel",
                "loss_parallel")


def _check_bool(_instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, bool):
        raise SpecError(f"Options.{attribute.name} is {value!r}; it must be True or False")


def _count(meaning: str):
    """A validator: the option is an int >= 0; ``meaning`` says what its values do."""
    def check(_instance: object, attribute: attrs.Attribute, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise SpecError(f"Options.{attribute.name} is {value!r}; it must be an int >= 0 ({meaning})")
    return check


_check_prefetch = _count("0: gather each unit when it is needed; k: gather up to k units ahead")
_check_bucket_bytes = _count("0: one collective per flat parameter; b: merge consecutive flat parameters smaller "
                             "than b bytes into buckets of about b bytes")


def _check_mixed_precision(_instance: object, _attribute: object, value: object) -> None:
    if value is not None and not isinstance(value, MixedPrecision):
        raise SpecError(
            f"Options.mixed_precision is {value!r}; it must be None or "
            "sl.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)"
        )


def _check_memory_budget(_instance: object, _attribute: object, value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise SpecError(
            f"Options.memory_budget is {value!r}; it must be None or a positive int, the bytes one rank may use "
            "at its peak (the compiler then picks the deepest prefetch whose planned peak fits)"
        )


def _to_backend(value: object) -> StepBackend:
    return member_of(StepBackend, value, "Options.backend",
                     hint=" ('inductor': compile the step with torch.compile's inductor, collectives included)")


@attrs.frozen
class Options:
    """How the compiled step trades memory for overlap.

    - ``reshard_after_forward``: free each unit's gathered parameters after its
      forward and gather them again for its backward (ZeRO-3, least memory); False
      keeps them from forward to backward (ZeRO-2-like, one gather fewer per unit).
    - ``prefetch``: how many units ahead to issue the next all-gather, so it overlaps
      the current unit's compute; 0 gathers each unit only when it is needed.
    - training (docs/training.md): ``clip_grad_norm`` (clip the global gradient
      norm, None: off), ``microbatches`` and ``accumulation`` (k micro-batches per
      optimizer step, `Accumulation.PER_MICROBATCH` or `Accumulation.KEEP`),
      ``random`` and ``seed`` (how ranks draw dropout masks, `RandomScheme`).
    - ``memory_budget``: bytes per rank; the compiler picks the deepest prefetch
      whose planned peak fits (``prefetch`` is then ignored).
    - ``bucket_bytes``: merge consecutive small flat parameters into one
      collective (docs/plan.md, "Bucketing"); 0 (the default) keeps one per unit.
    - ``skip_nonfinite``: a step whose global gradient norm is inf or nan leaves the
      parameters and optimizer state as they were, and is counted, as AMP's
      GradScaler skips ``optimizer.step()`` (docs/training.md).
    - ``backend``: what runs the compiled graph: ``"eager"`` (the default, node by
      node) or ``"inductor"`` (torch.compile's inductor compiles the whole step,
      collectives included; `compiler.lower.backend`, docs/spec.md).
    - ``keep_reduction_buffers``: the full-size all-reduce buffer of each replicated
      gradient (the DDP strategy, ``replicate()`` parameters) is kept between steps
      and refilled, as torch DDP keeps its buckets (True, the default: no fresh
      pages every step); False frees it after each step, a full gradient fewer held
      between steps. Eager backend only (docs/spec.md).
    - ``buffer_pool``: gathered units and gradient packs write into a pool of
      buffers the step holds from one step to the next, each slot shared by buffers
      of one size whose lives do not overlap (True, the default; kept only where
      the planned peak does not rise). False makes each anew every step. Eager
      backend only (docs/memory.md).
    - ``sequence_parallel``: on a mesh with a tensor axis, activations between tp
      regions (norms, residual adds, dropout) are split on the sequence dim (dim 1)
      over tp: a reduce-scatter after each row-parallel product and an all-gather
      before each column-parallel one take the place of the all-reduce, and those
      activations take 1/tp of the memory (docs/tensor_parallel.md). The sequence
      length must be a multiple of tp.
    - ``loss_parallel``: on a mesh with a tensor axis, the cross-entropy of logits
      split by vocabulary over tp (a column-parallel head) runs on each rank's
      block: the rows' max, sum of exponentials and target logit cross the axis,
      never the logits (docs/tensor_parallel.md).

    Example: ``Options(reshard_after_forward=False, prefetch=2)``.
    """

    reshard_after_forward: bool = attrs.field(default=True, validator=_check_bool)
    prefetch: int = attrs.field(default=1, validator=_check_prefetch)
    mixed_precision: MixedPrecision | None = attrs.field(default=None, validator=_check_mixed_precision)
    clip_grad_norm: float | None = attrs.field(default=None, validator=training.check_clip_grad_norm)
    microbatches: int = attrs.field(default=1, validator=training.check_microbatches)
    accumulation: training.Accumulation = attrs.field(default=training.Accumulation.PER_MICROBATCH,
                                                      converter=training.to_accumulation, repr=training.enum_repr)
    random: training.RandomScheme = attrs.field(default=training.RandomScheme.PER_RANK, converter=training.to_random,
                                                repr=training.enum_repr)
    seed: int = attrs.field(default=0, validator=training.check_seed)
    bucket_bytes: int = attrs.field(default=0, validator=_check_bucket_bytes)
    memory_budget: int | None = attrs.field(default=None, validator=_check_memory_budget)
    skip_nonfinite: bool = attrs.field(default=False, validator=_check_bool)
    backend: StepBackend = attrs.field(default=StepBackend.EAGER, converter=_to_backend, repr=training.enum_repr)
    keep_reduction_buffers: bool = attrs.field(default=True, validator=_check_bool)
    buffer_pool: bool = attrs.field(default=True, validator=_check_bool)
    sequence_parallel: bool = attrs.field(default=False, validator=_check_bool)
    loss_parallel: bool = attrs.field(default=False, validator=_check_bool)

    def to_dict(self) -> dict[str, object]:
        """The plain-dict (TOML) form. Example: ``{'reshard_after_forward': True, 'prefetch': 1}``."""
        d: dict[str, object] = {"reshard_after_forward": self.reshard_after_forward, "prefetch": self.prefetch}
        if self.mixed_precision is not None:
            d["mixed_precision"] = {k: v for k, v in self.mixed_precision.to_dict().items() if v is not None}
        for name in ("clip_grad_norm", "microbatches", "accumulation", "random", "seed", "bucket_bytes",
                     "memory_budget", "skip_nonfinite", "backend", "keep_reduction_buffers", "buffer_pool",
                     "sequence_parallel", "loss_parallel"):  # if not default
            value = getattr(self, name)
            if value != _OPTION_DEFAULTS[name]:
                d[name] = value.value if isinstance(value, enum.Enum) else value
        return d


_OPTION_DEFAULTS = {a.name: a.default for a in attrs.fields(Options)}


def options_from_dict(raw: object) -> Options:
    """`Options` from the ``[options]`` table of a spec; unknown keys are errors that list the valid ones."""
    if not isinstance(raw, Mapping):
        raise SpecError(f"options is {raw!r}; it must be a table with keys {list(_OPTION_KEYS)}")
    for key in raw:
        if key not in _OPTION_KEYS:
            raise SpecError(f"unknown key {key!r} in options; valid keys are {list(_OPTION_KEYS)}")
    raw = dict(raw)
    if raw.get("mixed_precision") is not None:
        raw["mixed_precision"] = MixedPrecision.from_dict(dict(raw["mixed_precision"]))
    return Options(**raw)
