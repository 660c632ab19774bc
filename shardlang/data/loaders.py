"""Loaders users already have: a job's ``data``, any iterable of global batches, as ``make_batch``.

Note [loader batches]: a job may define ``data`` instead of ``make_batch``: a
``torch.utils.data.DataLoader``, torchdata's ``StatefulDataLoader`` (over a
Hugging Face ``datasets`` dataset, ``IterableDataset`` included, with a collate
function), or any iterable whose items are global batches. `LoaderBatches`
turns it into ``make_batch(k)``: it reads the loader in order (a later ``k``
reads and drops the batches between; an earlier one starts the loader over), an
exhausted loader starts its next epoch, and every rank reads the same global
batches and keeps its rows, so the loader must give the same batches on every
rank (a shuffling loader takes a seeded ``generator=``).

Epochs: each epoch's order is a function of the epoch, as ``DistributedSampler.set_epoch`` makes
it: before an epoch starts, a loader's ``generator`` (a seeded ``torch.Generator``) is reseeded
from its initial seed and the epoch, and a sampler's or dataset's ``set_epoch(e)`` is called. A
resumed run then shuffles the epochs after the one it resumed in as an uninterrupted run does
(a StatefulDataLoader restores the order of the epoch it was saved in, not its generator's state
for the next one).

Resuming: when the loader has ``state_dict()``, the checkpoint keeps it
(``shardlang.data_state``, JSON: never a pickle) with the position, and
``--resume`` gives it back with ``load_state_dict``: the run goes on from the
same batch. A loader without state resumes by reading and dropping the batches
before the position, and says so once.

Example (a job file)::

    from torchdata.stateful_dataloader import StatefulDataLoader
    data = StatefulDataLoader(dataset, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0))
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ..errors import DataError


class LoaderBatches:
    """``make_batch(k)`` over ``loader``, an iterable of global batches (Note [loader batches])."""

    def __init__(self, loader: Iterable, where: str = "data"):
        if not hasattr(loader, "__iter__"):
            raise DataError(f"{where} is {type(loader).__name__}, not an iterable of global batches; give a "
                            "DataLoader, a StatefulDataLoader or any iterable of batches")
        self.loader, self.where = loader, where
        self.stateful = callable(getattr(loader, "state_dict", None)) and callable(
            getattr(loader, "load_state_dict", None))
        generator = getattr(loader, "generator", None)
        self._seed = generator.initial_seed() if isinstance(generator, torch.Generator) else None
        self._initial = self.loader.state_dict() if self.stateful else None
        self._restored = False  # the loader's state was just loaded: its iterator resumes the epoch as saved
        self._iterator = None
        self.position = 0  # batches read so far: the next step's index
        self.epoch = 0
        self._last: tuple[int, object] | None = None  # the batch read last (a run reads batch 0 twice)

    def __call__(self, step: int):
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise DataError(f"{self.where}: step {step!r}; expected an integer >= 0")
        if self._last is not None and self._last[0] == step:
            return self._last[1]
        if step < self.position:
            self._start_over()
        while self.position < step:
            self._next()
        self._last = (step, self._next())
        return self._last[1]

    def state(self) -> dict | None:
        """What a checkpoint keeps to resume here: the position and the loader's ``state_dict()``; None without one."""
        if not self.stateful:
            return None
        return {"position": self.position, "epoch": self.epoch, "loader": self.loader.state_dict()}

    def restore(self, position: int, state: dict | None, say: Callable[[str], None] = print) -> None:
        """Continue at batch ``position``: from the checkpoint's loader state when there is one, else by skipping."""
        if state is not None and self.stateful and state.get("position") == position:
            self.loader.load_state_dict(state["loader"])
            self._iterator, self._last, self._restored = None, None, True
            self.position, self.epoch = position, int(state.get("epoch", 0))
            return
        if position:
            why = ("has no state_dict()" if not self.stateful else
                   "state was not in the checkpoint")
            say(f"{self.where} ({type(self.loader).__name__}) {why}: resuming by reading and dropping its first "
                f"{position} batches")
        self._start_over()
        while self.position < position:
            self._next()

    def _start_over(self) -> None:
        if self.stateful:
            self.loader.load_state_dict(self._initial)
        self._iterator, self._last, self._restored, self.position, self.epoch = None, None, False, 0, 0

    def _begin_epoch(self) -> None:
        """Make the coming epoch's order a function of the epoch (Note [loader batches], "Epochs")."""
        generator = getattr(self.loader, "generator", None)
        if isinstance(generator, torch.Generator):
            if self._seed is None:
                self._seed = generator.initial_seed()
            generator.manual_seed((self._seed + 1_000_003 * self.epoch) % (1 << 63))
        for owner in (getattr(self.loader, "sampler", None), getattr(self.loader, "dataset", None)):
            if callable(getattr(owner, "set_epoch", None)):
                owner.set_epoch(self.epoch)

    def _next(self):
        if self._iterator is None:
            if not self._restored:
                self._begin_epoch()
            self._restored = False
            self._iterator = iter(self.loader)
        try:
            batch = next(self._iterator)
        except StopIteration:
            self.epoch += 1
            self._begin_epoch()
            self._iterator = iter(self.loader)  # the next epoch
            try:
                batch = next(self._iterator)
            except StopIteration:
                raise DataError(f"{self.where} ({type(self.loader).__name__}) gave no batch in epoch {self.epoch}; "
                                "a loader must give at least one global batch an epoch") from None
        self.position += 1
        return batch

    def __repr__(self) -> str:
        return f"LoaderBatches({type(self.loader).__name__}, position={self.position})"
