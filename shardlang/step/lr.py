"""Learning-rate schedules: any ``torch.optim.lr_scheduler`` drives the step's lr inputs, with no retracing.

Every parameter group's learning rate is a 0-d input of the compiled graph
(`compiler.layout.optim.hyper_name`: ``lr``, ``lr/group1``, ...). A schedule is given
as a *factory*: a function that takes a ``torch.optim.Optimizer`` and returns an
``LRScheduler`` on it, exactly what one writes for ``torch.optim``::

    step = sl.compile(model, loss_fn, spec, optimizer=sl.AdamW(lr=1e-3), example_batch=batch,
                      lr_schedule=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100))

The step builds a stand-in ``torch.optim.SGD`` with one param group per
shardlang parameter group (same order, same initial lr, no real parameters),
calls the factory on it, and after every step calls ``scheduler.step()`` and
copies each group's ``lr`` into the graph's lr inputs. So the learning rates
are exactly the ones torch's scheduler gives a ``torch.optim`` optimizer with
the same param groups, stepped once per optimizer step (warm-up, cosine,
``SequentialLR``, ``LambdaLR`` ... all work). Only ``lr`` is read back: a
scheduler that also cycles momentum (``OneCycleLR``) changes the stand-in's
momentum, not the compiled optimizer's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import SpecError


class LRSchedule:
    """A torch LR scheduler on a stand-in optimizer whose param groups mirror the step's lr inputs.

    ``lr_inputs`` maps each lr input name (in group order) to its initial value.
    Example: ``LRSchedule(lambda opt: LambdaLR(opt, lambda k: 0.9 ** k), {"lr": 0.1}).lrs()``.
    """

    def __init__(self, factory: Callable, lr_inputs: dict[str, float]):
        if not callable(factory):
            raise SpecError(
                f"lr_schedule is {factory!r}; it must be a function that takes a torch optimizer and returns an "
                "LRScheduler, e.g. lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)"
            )
        self.names = list(lr_inputs)
        groups = [{"params": [torch.nn.Parameter(torch.zeros(0))], "lr": lr} for lr in lr_inputs.values()]
        self.optimizer = torch.optim.SGD(groups, lr=next(iter(lr_inputs.values())))
        scheduler = factory(self.optimizer)
        if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            raise SpecError(
                f"lr_schedule returned {scheduler!r}; it must return a torch.optim.lr_scheduler.LRScheduler built "
                "on the optimizer it is given, e.g. lambda opt: LambdaLR(opt, lambda k: min(1.0, (k + 1) / 100))"
            )
        if scheduler.optimizer is not self.optimizer:
            raise SpecError("lr_schedule returned a scheduler of another optimizer; build it on the one it is given")
        self.scheduler = scheduler

    def lrs(self) -> dict[str, float]:
        """The learning rate of every lr input for the next step."""
        return {name: float(group["lr"]) for name, group in zip(self.names, self.optimizer.param_groups)}

    def advance(self) -> None:
        """One optimizer step done: step the scheduler (after the stand-in's no-op step, as torch expects)."""
        self.optimizer.step()  # no parameter has a gradient: nothing changes but torch's step counter
        self.scheduler.step()
