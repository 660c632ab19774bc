"""How far sharded training's parameters are from a reference's, relative to what training could move them.

`shardlang check` trains a job sharded and in one process and must tell
rounding from bugs. Measuring each parameter's difference relative to its own
final size fails on parameters that training leaves at (or near) zero: an
attention key bias gets a gradient that is zero in exact arithmetic (softmax
ignores a term added to every score of a row), so in both runs it stays at
rounding noise, about 1e-15, and the difference of two noises is as large as
either: a "relative difference" of 0.5 to 1.0 on a correct run.

Note [scale of a parameter]: rounding in a step's update is a small fraction
of the updates that step makes, whichever parameter it lands in: a sum over
ranks is rounded relative to its terms, and an optimizer's factors relative to
the step size. So each parameter ``p`` is compared at the scale of what
training could move it by::

    scale(p) = max( max|p_0|, max|p_ref|, sum_k u_k )
    diff(p)  = max|p_sharded - p_ref| / scale(p)

with ``p_0`` its initial value, ``p_ref`` the reference's final value and
``u_k`` the largest change the reference's step k made to any trainable
element (Adam moves an element by about lr per step whatever its gradient;
SGD by lr times the gradient and momentum). A parameter whose gradient is
exactly zero then differs by noise over a scale of the run's total movement,
and passes; a bug still shows: it changes some parameter by a fraction of what
a step moves it (a gradient off by 1 + 1e-6 moves it 1e-6 of a step off, an
update applied twice a whole step), which is that fraction of the scale or
more. Where everything is zero (no movement, zero parameters) the difference
is absolute.

Example::

    moves = Movement.start(model)
    ...; moves.record(model)          # after each optimizer step
    worst, name = scaled_difference(sharded, reference, moves)
"""

from __future__ import annotations

import attrs
import torch

from ..errors import ShardlangRuntimeError


@attrs.define
class Movement:
    """A reference run's initial parameters and the largest change any trainable element made at each step."""

    initial: dict[str, torch.Tensor]
    per_step: list[float] = attrs.field(factory=list)
    _before: dict[str, torch.Tensor] = attrs.field(factory=dict, repr=False)

    @classmethod
    def start(cls, model: torch.nn.Module) -> Movement:
        """Remember ``model``'s parameters before training (float64 copies)."""
        initial = {n: p.detach().to(torch.float64, copy=True) for n, p in model.named_parameters()}
        return cls(initial, [], {n: t.clone() for n, t in initial.items()})

    def record(self, model: torch.nn.Module) -> None:
        """After one optimizer step: add the largest change of any trainable element since the last record."""
        largest = 0.0
        for name, p in model.named_parameters():
            now = p.detach().to(torch.float64)
            if p.requires_grad and now.numel():
                largest = max(largest, float((now - self._before[name]).abs().max()))
            self._before[name] = now.clone()
        self.per_step.append(largest)

    @property
    def total(self) -> float:
        """``sum_k u_k``: an upper bound on how far training moved any element."""
        return sum(self.per_step)

    def scale(self, name: str, reference: torch.Tensor) -> float:
        """Note [scale of a parameter]: ``max(max|p_0|, max|p_ref|, sum_k u_k)``."""
        initial = self.initial.get(name)
        sizes = [float(reference.detach().abs().max()), self.total]
        if initial is not None and initial.numel():
            sizes.append(float(initial.abs().max()))
        return max(sizes)


def scaled_difference(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                      movement: Movement) -> tuple[float, str | None]:
    """The largest ``max|a - b| / scale(b)`` over parameters (Note [scale of a parameter]), and which one.

    NaN anywhere is returned at once, never hidden behind ``max``.

    Example::

        >>> m = Movement({"w": torch.tensor([1.0, 2.0])}, [0.5])
        >>> scaled_difference({"w": torch.tensor([1.0, 2.2])}, {"w": torch.tensor([1.0, 2.0])}, m)
        (0.1..., 'w')
    """
    missing = sorted(set(reference) - set(params))
    if missing:
        raise ShardlangRuntimeError(f"the sharded step returned no value for parameters {missing}")
    worst, worst_name = 0.0, None
    for name, ref in reference.items():
        if ref.numel() == 0:
            continue
        ref64, got64 = ref.detach().to(torch.float64), params[name].detach().to(torch.float64)
        diff = float((got64 - ref64).abs().max()) / (movement.scale(name, ref64) or 1.0)
        if diff != diff:
            return diff, name
        if diff > worst or worst_name is None:
            worst, worst_name = diff, name
    return worst, worst_name


def relative_difference(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The old measure, ``max|a - b| / max|b|`` per parameter, and which parameter is worst.

    Kept to show what Note [scale of a parameter] fixes: it flags parameters that
    stay at rounding noise (tests/test_check_noise.py).
    """
    return scaled_difference(params, reference, Movement({}, []))
