"""Mixed precision: the dtype parameters are gathered and computed in, and the dtype gradients are reduced in.

Master parameter shards and optimizer state keep the model's dtype (fp32).
Before each all-gather a rank casts its shard to ``param_dtype``, so the
gather moves half the bytes for bf16 and forward and backward compute in
``param_dtype``; floating batch leaves are cast too, as FSDP2 casts forward
inputs. Gradients are cast to ``reduce_dtype`` before the reduce-scatter and
to the master dtype after it. This is FSDP2's ``MixedPrecisionPolicy``.

Example::

    spec = sl.Spec(sl.Mesh(fsdp=-1),
                   options=sl.Options(mixed_precision=sl.MixedPrecision(torch.bfloat16, torch.float32)))
"""

from __future__ import annotations

import attrs
import torch

from ..errors import SpecError

_NAMES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
          "float64": torch.float64, "fp64": torch.float64, "double": torch.float64}


def to_dtype(value: object, where: str) -> torch.dtype | None:
    """A floating torch dtype from a dtype or its name; None stays None."""
    if value is None:
        return None
    if isinstance(value, str):
        name = value.removeprefix("torch.")
        if name not in _NAMES:
            raise SpecError(f"{where} is {value!r}; valid dtype names are {sorted(set(_NAMES))}")
        return _NAMES[name]
    if isinstance(value, torch.dtype) and value.is_floating_point:
        return value
    raise SpecError(f"{where} is {value!r}; it must be a floating torch dtype such as torch.bfloat16, or its name")


def dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


@attrs.frozen
class MixedPrecision:
    """Gather and compute in ``param_dtype``; reduce gradients in ``reduce_dtype`` (None: the model's dtype).

    Example: ``MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``.
    """

    param_dtype: torch.dtype | None = attrs.field(
        default=None, converter=lambda v: to_dtype(v, "MixedPrecision.param_dtype"))
    reduce_dtype: torch.dtype | None = attrs.field(
        default=None, converter=lambda v: to_dtype(v, "MixedPrecision.reduce_dtype"))

    def to_dict(self) -> dict[str, str | None]:
        return {"param_dtype": dtype_name(self.param_dtype), "reduce_dtype": dtype_name(self.reduce_dtype)}

    @classmethod
    def from_dict(cls, raw: object) -> MixedPrecision:
        if not isinstance(raw, dict) or set(raw) - {"param_dtype", "reduce_dtype"}:
            raise SpecError(f"options.mixed_precision is {raw!r}; it must be a table with keys "
                            "'param_dtype' and/or 'reduce_dtype', e.g. {param_dtype = 'bfloat16'}")
        return cls(**raw)
