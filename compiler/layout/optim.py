"""Optimizers as traceable, in-place update rules over flat tensors.

An optimizer here is a frozen description (its hyperparameters) plus an
`update_` that mutates one flat parameter and its state in place, written only
with elementwise ops. Elementwise is what makes sharding the update free: the
same traced ops run unchanged on a rank's shard instead of the whole flat
parameter (see `passes/shard_optimizer.py`).

Hyperparameters that users change while training (the learning rate) enter the
graph as 0-d float64 tensors, so a schedule can change them every step without
retracing. The formulas follow `torch.optim` (single-tensor, capturable path) so
that one process with `torch.optim` and N ranks with shardlang agree to rounding.
"""

from __future__ import annotations

import attrs
import torch

from shardlang.errors import SpecError


def _check_nonneg(name: str):
    def check(_inst, attribute, value):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise SpecError(f"{attribute.name}={value!r} for {name} must be a non-negative number")

    return check


def _check_betas(_inst, _attribute, value):
    ok = isinstance(value, tuple) and len(value) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in value)
    if not ok:
        raise SpecError(f"betas={value!r} must be a pair of numbers in [0, 1), e.g. (0.9, 0.999)")


@attrs.frozen
class SGD:
    """Stochastic gradient descent with optional momentum, dampening, nesterov and weight decay.

    Same semantics as ``torch.optim.SGD``. Example: ``SGD(lr=0.1, momentum=0.9)``.
    """

    lr: float = attrs.field(validator=_check_nonneg("SGD"))
    momentum: float = attrs.field(default=0.0, validator=_check_nonneg("SGD"))
    dampening: float = attrs.field(default=0.0, validator=_check_nonneg("SGD"))
    weight_decay: float = attrs.field(default=0.0, validator=_check_nonneg("SGD"))
    nesterov: bool = False

    def __attrs_post_init__(self):
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise SpecError(f"{self!r}: nesterov needs momentum > 0 and dampening == 0 (as in torch.optim.SGD)")

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if self.momentum else ()

    def hyper(self) -> dict[str, float]:
        """The hyperparameters that enter the graph as tensors (may change every step)."""
        return {"lr": float(self.lr)}

    def update_(self, param, grad, state, hyper, step) -> None:
        """Update ``param`` (and ``state``) in place; ``step`` is the count before this update."""
        d_p = grad
        if self.weight_decay:
            d_p = d_p.add(param, alpha=self.weight_decay)
        if self.momentum:
            (buf,) = state
            if self.dampening:
                # torch.optim seeds the buffer with the first gradient, undamped.
                first = step == 0
                buf.copy_(torch.where(first, d_p, buf * self.momentum + d_p * (1 - self.dampening)))
            else:
                # buf starts at zero, so 0 * momentum + d_p reproduces the seeding exactly.
                buf.mul_(self.momentum).add_(d_p)
            d_p = d_p.add(buf, alpha=self.momentum) if self.nesterov else buf
        param.sub_(d_p * hyper["lr"])


@attrs.frozen
class Adam:
    """Adam (``torch.optim.Adam`` semantics, L2 weight decay added to the gradient).

    Example: ``Adam(lr=1e-3, betas=(0.9, 0.999))``.
    """

    lr: float = attrs.field(validator=_check_nonneg("Adam"))
    betas: tuple[float, float] = attrs.field(default=(0.9, 0.999), converter=tuple, validator=_check_betas)
    eps: float = attrs.field(default=1e-8, validator=_check_nonneg("Adam"))
    weight_decay: float = attrs.field(default=0.0, validator=_check_nonneg("Adam"))

    decoupled = False

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    def hyper(self) -> dict[str, float]:
        return {"lr": float(self.lr)}

    def update_(self, param, grad, state, hyper, step) -> None:
        exp_avg, exp_avg_sq = state
        beta1, beta2 = self.betas
        lr = hyper["lr"]
        if self.weight_decay:
            if self.decoupled:
                param.mul_(1 - lr * self.weight_decay)
            else:
                grad = grad.add(param, alpha=self.weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        # torch.optim's capturable formula: every step-dependent factor is a tensor.
        t = step + 1
        bias_correction1 = 1 - torch.pow(beta1, t)
        bias_correction2_sqrt = (1 - torch.pow(beta2, t)).sqrt()
        step_size_neg = -(lr / bias_correction1)
        # One parameter-sized temporary, divided in place (same values as sqrt() / ...): a second one costs
        # a pass and, above glibc's mmap threshold, fresh pages every step.
        denom = exp_avg_sq.sqrt().div_(bias_correction2_sqrt * step_size_neg).add_(self.eps / step_size_neg)
        param.addcdiv_(exp_avg, denom)


@attrs.frozen
class AdamW(Adam):
    """AdamW: Adam with decoupled weight decay (``torch.optim.AdamW`` semantics).

    Example: ``AdamW(lr=3e-4, weight_decay=0.01)``.
    """

    weight_decay: float = attrs.field(default=0.01, validator=_check_nonneg("AdamW"))

    decoupled = True


Optimizer = SGD | Adam | AdamW

#: The hyperparameters a parameter group may override, over all optimizers here.
GROUP_KEYS = ("lr", "momentum", "dampening", "nesterov", "betas", "eps", "weight_decay")


def hyper_name(key: str, group: int) -> str:
    """The graph input of hyperparameter ``key`` of parameter group ``group``: ``lr``, ``lr/group1``, ..."""
    return key if group == 0 else f"{key}/group{group}"


@attrs.frozen
class GroupedOptimizer:
    """One optimizer per parameter group: group 0 is the optimizer as given, group g its copy with overrides.

    A flat parameter belongs to one group (`FlatParam.group`), so the update of
    a flat parameter runs with its group's hyperparameters, as ``torch.optim``
    runs each of its ``param_groups``. Every group's lr is a graph input of its
    own (`hyper_name`). Example::

        opt = GroupedOptimizer.build(AdamW(lr=1e-3, weight_decay=0.1), ({"weight_decay": 0.0},))
        opt.groups[1]          # AdamW(lr=0.001, ..., weight_decay=0.0)
        opt.hyper()            # {'lr': 0.001, 'lr/group1': 0.001}
    """

    groups: tuple[Optimizer, ...]

    @classmethod
    def build(cls, optimizer, overrides=()) -> GroupedOptimizer:
        """The base optimizer plus one copy per entry of ``overrides`` (SpecError naming a bad entry)."""
        if isinstance(optimizer, GroupedOptimizer):
            return optimizer
        if not isinstance(optimizer, (SGD, Adam)):
            raise SpecError(f"optimizer is {optimizer!r}; it must be sl.SGD(...), sl.Adam(...) or sl.AdamW(...)")
        groups = [optimizer]
        valid = [f.name for f in attrs.fields(type(optimizer))]
        for g, override in enumerate(overrides, start=1):
            unknown = sorted(set(override) - set(valid))
            if unknown:
                raise SpecError(
                    f"param_groups[{g - 1}] sets {unknown}, which {type(optimizer).__name__} does not have; "
                    f"its hyperparameters are {valid}"
                )
            try:
                groups.append(attrs.evolve(optimizer, **override))
            except SpecError as exc:
                raise SpecError(f"param_groups[{g - 1}] = {dict(override)!r}: {exc}") from None
        return cls(tuple(groups))

    @property
    def base(self) -> Optimizer:
        return self.groups[0]

    def of(self, flat) -> Optimizer:
        """The optimizer of ``flat``'s group."""
        return self.groups[flat.group]

    def state_names(self, flat) -> tuple[str, ...]:
        return self.of(flat).state_names

    def hyper(self) -> dict[str, float]:
        """Every group's tensor hyperparameters, by graph input name."""
        return {hyper_name(k, g): v for g, opt in enumerate(self.groups) for k, v in opt.hyper().items()}

    def update_(self, flat, param, grad, state, hyper, step) -> None:
        """Update one flat parameter with its group's optimizer; ``hyper`` holds every group's inputs."""
        opt = self.of(flat)
        opt.update_(param, grad, state, {k: hyper[hyper_name(k, flat.group)] for k in opt.hyper()}, step)


def init_state(optimizer, flat: torch.Tensor, flat_param=None) -> list[torch.Tensor]:
    """Fresh optimizer state for one flat parameter (shard or whole): zeros like it.

    With a `GroupedOptimizer`, ``flat_param`` (the `FlatParam`) picks the group.
    """
    names = optimizer.state_names(flat_param) if isinstance(optimizer, GroupedOptimizer) else optimizer.state_names
    return [torch.zeros_like(flat) for _ in names]


def hyper_tensors(optimizer, overrides: dict[str, float] | None = None) -> dict[str, torch.Tensor]:
    """The hyperparameters as 0-d float64 tensors, the graph inputs an lr schedule writes."""
    values = {**optimizer.hyper(), **(overrides or {})}
    return {k: torch.tensor(v, dtype=torch.float64) for k, v in values.items()}
