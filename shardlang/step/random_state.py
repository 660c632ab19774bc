"""The generator a step draws its random numbers from (`compiler.ir.rng`, docs/training.md).

A compiled step's random ops (dropout's ``bernoulli_``) read the default
generator of their device. `StepRandom` keeps the step's own generator state
and swaps it in around each call of the graph, so a step's masks follow from
``Options.seed`` (and the rank, under ``random="per_rank"``) alone, and the
program's own use of the generator is left as it was.
"""

from __future__ import annotations

import torch

from ..compiler import has_random_ops, per_rank_seed
from shardlang.spec.vocabulary import RandomScheme


class StepRandom:
    """A context manager: inside it, the default CPU generator (and the step's CUDA device's) is the step's.

    Example::

        random = StepRandom(seed=0, device=torch.device("cpu"))
        with random:
            torch.rand(2)        # drawn from the step's stream; the caller's stream is untouched
    """

    def __init__(self, seed: int, device: torch.device):
        self.device = device
        self.seed = seed
        self.cpu_state = torch.Generator().manual_seed(seed).get_state()
        self.cuda_state = torch.Generator(device).manual_seed(seed).get_state() if device.type == "cuda" else None

    @classmethod
    def for_step(cls, graph: torch.fx.GraphModule, training, rank: int, device: torch.device) -> StepRandom | None:
        """The step's generator, or None when its graph draws no random numbers."""
        if not has_random_ops(graph):
            return None
        seed = training.seed if training.random is RandomScheme.GLOBAL else per_rank_seed(training.seed, rank)
        return cls(seed, device)

    def __enter__(self) -> StepRandom:
        self._caller_cpu = torch.get_rng_state()
        torch.set_rng_state(self.cpu_state)
        if self.cuda_state is not None:
            self._caller_cuda = torch.cuda.get_rng_state(self.device)
            torch.cuda.set_rng_state(self.cuda_state, self.device)
        return self

    def __exit__(self, *exc) -> None:
        self.cpu_state = torch.get_rng_state()
        torch.set_rng_state(self._caller_cpu)
        if self.cuda_state is not None:
            self.cuda_state = torch.cuda.get_rng_state(self.device)
            torch.cuda.set_rng_state(self._caller_cuda, self.device)
