"""Checkpoints every K steps into one directory, resuming from the latest: what ``shardlang run`` uses.

Example::

    every = Periodic(CheckpointDir("runs/a", keep=2), every=100, asynchronous=True)
    start = every.resume(step)                # 0, or the data position of the latest complete checkpoint
    for k in range(start, total):
        step(batch_for(k))
        every.after_step(step, k + 1, last=k + 1 == total)
    every.finish(step)
"""

from __future__ import annotations

from pathlib import Path

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from . import saving
from .store import CheckpointDir, run_of


class Periodic:
    """Save ``step`` into ``directory`` after every ``every`` steps and after the last; keep the newest ``keep``.

    With ``asynchronous``, saves are written in the background (`save_async`, by ``checkpointer``); a
    save still in flight is waited for before the next one and by `finish`.
    """

    def __init__(self, directory: CheckpointDir, every: int | None, asynchronous: bool = False,
                 overwrite: bool = False, checkpointer: str = "thread"):
        self.directory = directory
        self.every = every
        self.asynchronous = asynchronous
        self.checkpointer = checkpointer
        self.overwrite = overwrite  # remove other runs' checkpoints once this run has one of its own
        self.pending: saving.AsyncSave | None = None
        self.saved: list[Path] = []

    def resume(self, step) -> saving.Restored | None:
        """Load the latest complete checkpoint of the directory into ``step``; None when there is none.

        The run goes on under the run id of the checkpoint it resumed from, so that ``keep`` counts
        the checkpoints of the resumed run as its own."""
        latest = self.directory.latest()
        from .saving import load  # torch.distributed.checkpoint: imported when first used

        if latest is None:
            return None
        restored = load(step, latest)
        resumed_run = run_of(latest)
        if resumed_run is not None:
            self.directory.run_id = resumed_run
        return restored

    def after_step(self, step, steps_done: int, *, last: bool = False, data_state=None) -> Path | None:
        """Save when ``steps_done`` is a multiple of ``every`` or ``last``; the checkpoint's path, or None.

        ``data_state`` gives the data loader's state to keep with it (a function: called only when saving)."""
        if not (last or (self.every and steps_done % self.every == 0)):
            return None
        from .saving import save, save_async  # torch.distributed.checkpoint: imported when first used

        path = self.directory.path_for(steps_done)
        self._settle(step)  # no save in flight from here on
        if step.dist.rank == 0 and not self.saved:  # what a killed run left; this run's failed saves clean up
            self.directory.remove_unfinished()
        run = self.directory.run_id
        loader = data_state() if data_state is not None else None
        if self.asynchronous:
            self.pending = save_async(step, path, data_position=steps_done, run=run, checkpointer=self.checkpointer,
                                      data_state=loader)
        else:
            save(step, path, data_position=steps_done, run=run, data_state=loader)
            self._done(step, path)
        return path

    def finish(self, step) -> None:
        """Wait for a save in flight (and prune after it)."""
        self._settle(step)

    def _settle(self, step) -> None:
        if self.pending is not None:
            path = self.pending.wait()
            self.pending = None
            self._done(step, path)

    def _done(self, step, path: Path) -> None:
        self.saved.append(path)
        if step.dist.rank == 0:
            if self.overwrite and len(self.saved) == 1:
                self.directory.remove_other_runs()
            self.directory.prune(just_saved=path)
