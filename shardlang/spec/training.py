"""The spec side of the training features: parameter groups and the training options.

Parameter groups are rules over parameter names, like layout rules: each
trainable parameter belongs to the first group whose pattern matches it, and a
parameter no group matches stays in the default group, which uses the
optimizer's own hyperparameters. A group overrides any of them, as a
``torch.optim`` param group does::

    spec = sl.Spec(
        mesh=sl.Mesh(fsdp=-1),
        param_groups=[
            sl.ParamGroup("*.bias", weight_decay=0.0),        # no weight decay for biases
            sl.ParamGroup("*ln*", weight_decay=0.0, lr=1e-4),  # nor for norms, and their own lr
        ],
        options=sl.Options(clip_grad_norm=1.0, microbatches=4),
    )

The options that go with them (``clip_grad_norm``, ``microbatches``,
``accumulation``, ``random``, ``seed``) live in `shardlang.spec.spec.Options`; the
checks for their values are here. docs/training.md has the whole story.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from fnmatch import fnmatchcase

import attrs

from ..compiler import GROUP_KEYS, Training
from shardlang.spec.vocabulary import Accumulation, RandomScheme
from ..errors import SpecError, member_of

__all__ = ["Accumulation", "ParamGroup", "RandomScheme", "assign_groups", "to_param_groups", "torch_param_groups",
           "training_of"]


def _number_or_none(name: str):
    def check(_inst, _attribute, value):
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or math.isinf(value):
            raise SpecError(f"ParamGroup.{name} is {value!r}; it must be a finite number >= 0 (or left out)")

    return check


def _check_betas(_inst, _attribute, value):
    if value is None:
        return
    ok = (isinstance(value, tuple) and len(value) == 2
          and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in value))
    if not ok:
        raise SpecError(f"ParamGroup.betas is {value!r}; it must be a pair of numbers in [0, 1), e.g. (0.9, 0.95)")


def _check_group_pattern(_inst, _attribute, value):
    if not isinstance(value, str) or not value:
        raise SpecError(f"ParamGroup.pattern is {value!r}; it must be a non-empty glob over parameter names, "
                        "e.g. '*.bias'")


def _check_nesterov(_inst, _attribute, value):
    if value is not None and not isinstance(value, bool):
        raise SpecError(f"ParamGroup.nesterov is {value!r}; it must be True or False (or left out)")


@attrs.frozen(repr=False)
class ParamGroup:
    """Optimizer hyperparameters for the trainable parameters whose names match ``pattern``.

    Fields left as None keep the optimizer's value. ``pattern`` is a glob over
    whole parameter names (as in layout rules). Example:
    ``ParamGroup("*.bias", weight_decay=0.0)``.
    """

    pattern: str = attrs.field(validator=_check_group_pattern)
    lr: float | None = attrs.field(default=None, validator=_number_or_none("lr"))
    weight_decay: float | None = attrs.field(default=None, validator=_number_or_none("weight_decay"))
    momentum: float | None = attrs.field(default=None, validator=_number_or_none("momentum"))
    dampening: float | None = attrs.field(default=None, validator=_number_or_none("dampening"))
    nesterov: bool | None = attrs.field(default=None, validator=_check_nesterov)
    betas: tuple[float, float] | None = attrs.field(
        default=None, converter=lambda v: tuple(v) if isinstance(v, list) else v, validator=_check_betas)
    eps: float | None = attrs.field(default=None, validator=_number_or_none("eps"))

    def __repr__(self) -> str:
        """The constructor call, with the hyperparameters it sets: ``ParamGroup('*.bias', weight_decay=0.0)``."""
        return "ParamGroup(" + ", ".join([repr(self.pattern), *(f"{k}={v!r}" for k, v in self.overrides.items())]) + ")"

    @property
    def overrides(self) -> dict[str, object]:
        """The hyperparameters this group sets. Example: ``{"weight_decay": 0.0}``."""
        return {k: getattr(self, k) for k in GROUP_KEYS if getattr(self, k) is not None}

    def matches(self, name: str) -> bool:
        """Whether ``name`` (a whole parameter name) matches ``pattern``, as in layout rules."""
        return fnmatchcase(name, self.pattern)

    def to_dict(self) -> dict[str, object]:
        """The TOML form: ``{"pattern": "*.bias", "weight_decay": 0.0}``."""
        d: dict[str, object] = {"pattern": self.pattern}
        for k, v in self.overrides.items():
            d[k] = list(v) if isinstance(v, tuple) else v
        return d

    @classmethod
    def from_dict(cls, raw: object, where: str) -> ParamGroup:
        if not isinstance(raw, Mapping):
            raise SpecError(f"{where} is {raw!r}; it must be a table such as {{pattern = '*.bias', weight_decay = 0.0}}")
        valid = ("pattern", *GROUP_KEYS)
        unknown = [k for k in raw if k not in valid]
        if unknown:
            raise SpecError(f"unknown key {unknown[0]!r} in {where}; valid keys are {list(valid)}")
        if "pattern" not in raw:
            raise SpecError(f"{where} has no 'pattern'; e.g. {{pattern = '*.bias', weight_decay = 0.0}}")
        try:
            return cls(**raw)
        except SpecError as exc:
            raise SpecError(f"{where}: {exc}") from None


def to_param_groups(value: object) -> tuple[ParamGroup, ...]:
    """``ParamGroup`` values, ``(pattern, {overrides})`` pairs or dicts -> a tuple of `ParamGroup`."""
    if value is None:
        return ()
    if isinstance(value, (str, ParamGroup, Mapping)) or not hasattr(value, "__iter__"):
        raise SpecError(f"param_groups is {value!r}; it must be a list such as [sl.ParamGroup('*.bias', "
                        "weight_decay=0.0)]")
    groups = []
    for i, item in enumerate(value):
        if isinstance(item, ParamGroup):
            groups.append(item)
        elif isinstance(item, Mapping):
            groups.append(ParamGroup.from_dict(item, f"param_groups[{i}]"))
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], Mapping):
            groups.append(ParamGroup.from_dict({"pattern": item[0], **item[1]}, f"param_groups[{i}]"))
        else:
            raise SpecError(f"param_groups[{i}] is {item!r}; write sl.ParamGroup(pattern, lr=..., weight_decay=...) "
                            "or (pattern, {'weight_decay': 0.0})")
    return tuple(groups)


def assign_groups(params, groups: tuple[ParamGroup, ...]) -> dict[str, int]:
    """The group (1-based; 0 is the default) of every trainable parameter in a group, by name.

    ``params`` are ``(name, trainable)`` pairs. Every group must decide at least
    one trainable parameter: a group matching nothing is a typo, one whose
    parameters earlier groups all take is misplaced, one matching only frozen
    parameters changes nothing; each is a `SpecError` naming it.
    """
    names = [name for name, trainable in params if trainable]
    frozen = [name for name, trainable in params if not trainable]
    group_of: dict[str, int] = {}
    for name in names:
        for g, group in enumerate(groups, start=1):
            if group.matches(name):
                group_of[name] = g
                break
    decided = set(group_of.values())
    for g, group in enumerate(groups, start=1):
        if g in decided:
            continue
        matched = [n for n in names if group.matches(n)]
        where = f"param_groups[{g - 1}] = {group!r}"
        if matched:
            earlier = sorted({group_of[n] - 1 for n in matched})
            raise SpecError(f"{where} decides no parameter: every one it matches ({_some(matched)}) is in an earlier "
                            f"group (param_groups{earlier}); the first match wins, so move it before them or remove it")
        if any(group.matches(n) for n in frozen):
            raise SpecError(f"{where} matches only frozen parameters ({_some([n for n in frozen if group.matches(n)])})"
                            ", which have no optimizer; remove it")
        raise SpecError(f"{where} matches no trainable parameter; patterns match whole parameter names, such as "
                        f"{_some(names)}")
    return group_of


def torch_param_groups(named_params, groups: tuple[ParamGroup, ...]) -> list[dict]:
    """``torch.optim`` param groups equal to shardlang's: the default group first, then one per `ParamGroup`.

    ``named_params`` are the trainable ``(name, parameter)`` pairs. Used as the
    single-process reference (``shardlang check``, the tests). Example::

        torch.optim.AdamW(torch_param_groups(named, spec.param_groups), lr=1e-3, weight_decay=0.1)
    """
    named_params = list(named_params)
    group_of = assign_groups([(n, True) for n, _ in named_params], tuple(groups))
    torch_groups = [{"params": [p for n, p in named_params if group_of.get(n, 0) == 0]}]
    torch_groups += [{"params": [p for n, p in named_params if group_of.get(n) == g], **group.overrides}
                     for g, group in enumerate(groups, start=1)]
    return torch_groups


def training_of(resolved) -> Training:
    """The compiler's `Training` data for a `ResolvedSpec`."""
    o = resolved.options
    return Training(
        clip_grad_norm=o.clip_grad_norm, microbatches=o.microbatches, accumulation=o.accumulation,
        group_overrides=tuple(g.overrides for g in resolved.param_groups), group_of=dict(resolved.group_of),
        random=o.random, seed=o.seed, skip_nonfinite=o.skip_nonfinite,
    )


# -- Options checks -----------------------------------------------------------------------------


def check_clip_grad_norm(_inst, _attribute, value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
        raise SpecError(f"Options.clip_grad_norm is {value!r}; it must be a finite number > 0 (the largest global "
                        "gradient norm, as max_norm in torch.nn.utils.clip_grad_norm_), or None for no clipping")


def check_microbatches(_inst, _attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"Options.microbatches is {value!r}; it must be an int >= 1 (the micro-batches per optimizer "
                        "step; the per-rank batch must divide by it)")


def check_seed(_inst, _attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SpecError(f"Options.seed is {value!r}; it must be an int >= 0")


def to_accumulation(value: object) -> Accumulation:
    return _to_enum(Accumulation, value, "Options.accumulation")


def to_random(value: object) -> RandomScheme:
    return _to_enum(RandomScheme, value, "Options.random")


def _to_enum(cls, value, where):
    return member_of(cls, value, where, hint=f" (or {cls.__name__}.<NAME>)")


def _some(names: list[str], shown: int = 8) -> str:
    text = ", ".join(repr(n) for n in names[:shown])
    return text + (f", ... ({len(names)} in all)" if len(names) > shown else "")


def enum_repr(value: enum.Enum) -> str:
    """An option's enum in a repr, as the string the converter takes: ``'keep'``."""
    return repr(value.value)
