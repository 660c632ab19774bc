"""Async saves on DCP's ``async_save``: stage between two steps, write in the background, publish when written.

Note [async saves]: `save_async` runs four stages, of which only the first two
hold up training:

1. every rank makes the checkpoint's temporary directory (`store.prepare`, a
   barrier over a gloo group that only checkpoints use);
2. ``dcp.async_save`` stages the state dict with DCP's ``DefaultStager``: each
   storage the state lives in is copied once into CPU memory that the stager
   keeps from one save to the next (pinned where there is a GPU, shared with
   the process checkpointer), so later saves neither allocate nor fault pages;
3. DCP's checkpointer writes the staged copy with `ChecksummingWriter`: a
   thread of this process (``Checkpointer.THREAD``), or a process of its own per
   rank (``Checkpointer.PROCESS``), started by the first save, which never holds
   the training process's GIL;
4. a publisher thread waits for that write, then writes the manifest and
   renames the directory into place (`store.publish`, a collective on the same
   gloo group).

A crash anywhere before the rename of stage 4 leaves only a temporary
directory, which the next run removes: the previous checkpoint stays complete.
At most one async save is in flight per step; the next waits for it, so the
staged copy is never overwritten while it is written.

Note [the checkpointer process's rendezvous]: DCP's checkpointer processes form a
gloo group of their own. Left to itself, DCP opens a new TCPStore on rank 0 that
listens on every interface; shardlang has them join the store the ranks already
met at instead (``DCP_USE_PREFIX_STORE``): the local launcher's, on loopback, or
torchrun's. Nothing new listens.

Example::

    pending = step.save_async("ckpt/step-6")                 # stages now, writes in the background
    pending = step.save_async("ckpt/step-8", checkpointer="process")
    pending.wait()                                            # the path, once the checkpoint is complete
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import enum
import multiprocessing
import os
import time
import uuid
import warnings
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from ..errors import CheckpointError, member_of
from ..runtime.child_output import stderr_through_sys_stderr
from . import store
from .checksums import ChecksummingWriter
from .planner import EntrySavePlanner


class Checkpointer(enum.Enum):
    """Who writes an async save: a thread of the training process, or a process of its own per rank."""

    THREAD = "thread"
    PROCESS = "process"

    @classmethod
    def parse(cls, value) -> Checkpointer:
        return member_of(cls, value, "checkpointer", error=CheckpointError)


class AsyncSave:
    """A checkpoint being written in the background. ``wait()`` returns its path (or raises its error)."""

    def __init__(self, future: concurrent.futures.Future, path: Path):
        self._future = future
        self.path = path

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> Path:
        return self._future.result()


class Saves:
    """What a step's checkpoints keep from one save to the next (owned by the step, made by its first save).

    ``plan_key`` names the step's save plan in DCP's cache (Note [cached save plans] in `planner`); the
    rest serves async saves: their gloo group, one stager per checkpointer, the publisher, the save in flight.
    """

    def __init__(self, ctx):
        self.ctx = ctx
        self.plan_key = f"shardlang-{uuid.uuid4().hex}"
        self._group = None
        self._stagers: dict[Checkpointer, DefaultStager] = {}
        self._publisher = None
        self.pending: AsyncSave | None = None

    @classmethod
    def of(cls, step) -> Saves:
        saves = step.__dict__.get("_saves")
        if saves is None:
            saves = step._saves = cls(step.dist)
        return saves

    @property
    def group(self):
        """The gloo group async saves collect over, apart from training's (None in a world of one)."""
        if self._group is None and self.ctx.world_size > 1:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def stager(self, checkpointer: Checkpointer) -> DefaultStager:
        if checkpointer not in self._stagers:
            on_gpu = self.ctx.device.type == "cuda"
            self._stagers[checkpointer] = DefaultStager(StagingOptions(
                use_pinned_memory=on_gpu, use_shared_memory=checkpointer is Checkpointer.PROCESS,
                use_async_staging=False, use_non_blocking_copy=on_gpu))
        return self._stagers[checkpointer]

    def submit(self, fn, *args) -> concurrent.futures.Future:
        if self._publisher is None:
            self._publisher = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardlang-ckpt")
        return self._publisher.submit(fn, *args)

    def settle(self) -> None:
        """Wait for the save in flight, if any."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.wait()


STARTING_S = 30.0  # how long the first process save waits for DCP to start its process (it takes ms)


def save_async(step, sd: dict, path: Path, checkpointer: Checkpointer, *, threads: int, publish) -> AsyncSave:
    """Stage ``sd`` and write it to ``path`` in the background (Note [async saves]); a collective.

    ``threads`` writer threads per rank; ``publish(wait, path, tmp, writer, group)``, on the publisher
    thread, waits for DCP's write (``wait()``) and publishes the checkpoint.
    """
    saves = Saves.of(step)
    saves.settle()
    ctx, group = step.dist, saves.group
    if checkpointer is Checkpointer.PROCESS:
        _checkpointer_process_environment(ctx)
    tmp, writer, planner = start_write(step, path, group, threads=threads,
                                       digests_file=checkpointer is Checkpointer.PROCESS)
    starts = checkpointer is Checkpointer.PROCESS and not _checkpointer_process_running()
    known = set(multiprocessing.active_children()) if starts else set()
    # Note [children's output]: the checkpointer process the first save starts logs through this rank's stderr
    try:
        with stderr_through_sys_stderr() if starts else contextlib.nullcontext():
            upload = dcp.async_save(sd, storage_writer=writer, planner=planner,
                                    process_group=group, async_stager=saves.stager(checkpointer),
                                    async_checkpointer_type=AsyncCheckpointerType(checkpointer.value),
                                    no_dist=not ctx.has_process_group)
            if starts:
                _until_a_process_starts(known, upload)
    except Exception as exc:
        upload = concurrent.futures.Future()
        upload.set_exception(exc)
    saves.pending = AsyncSave(saves.submit(publish, upload.result, path, tmp, writer, group), path)
    return saves.pending


def start_write(step, path: Path, group, *, threads: int, digests_file: bool = False):
    """What every save starts with, synchronous or not: the temporary directory (a barrier over ``group``), the
    writer that digests as it writes, and the planner under the step's cached plan. Returns (tmp, writer,
    planner)."""
    ctx = step.dist
    single_process_is_intended(ctx)
    tmp = store.prepare(path, ctx.rank, ctx.world_size, group)
    writer = ChecksummingWriter(str(tmp), thread_count=threads, digests_file=digests_file)
    return tmp, writer, EntrySavePlanner(Saves.of(step).plan_key)


def wait_for_saves(step) -> None:
    """Wait for ``step``'s async save in flight, if any (before exiting, or before reading the directory)."""
    saves = step.__dict__.get("_saves")
    if saves is not None:
        saves.settle()


def single_process_is_intended(ctx) -> None:
    """Without a process group DCP warns, on whichever thread saves, that it assumes one process: that is the
    intent whenever shardlang passes ``no_dist``. Warning filters are global to the process, so the filter
    is for that message alone (adding it again replaces it)."""
    if not ctx.has_process_group:
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                                category=UserWarning)


def _checkpointer_process_running() -> bool:
    from torch.distributed.checkpoint import _async_process_executor as executor  # its one handle on it

    return executor._CHECKPOINT_PROCESS is not None


def _until_a_process_starts(known: set, upload, timeout_s: float = STARTING_S) -> None:
    """Wait until a child process other than ``known`` has started, or ``upload`` has ended: DCP starts its
    checkpointer process on a thread of its own, after ``async_save`` returns, and the process must inherit
    the pipe of Note [children's output]. Past ``timeout_s`` its lines go straight to the terminal instead."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not upload.done():
        if set(multiprocessing.active_children()) - known:
            return
        time.sleep(0.005)


def stop_checkpointer_process() -> None:
    """End this rank's DCP checkpointer process, if a save started one (a rank that leaves with ``os._exit``
    would otherwise leave it to find its pipe closed)."""
    from torch.distributed.checkpoint import _async_process_executor as executor  # its one handle on it

    process, executor._CHECKPOINT_PROCESS = executor._CHECKPOINT_PROCESS, None
    if process is not None:
        process.__del__()  # sends TERMINATE and joins; idempotent when the object is collected later


def check_checkpointer(checkpointer: Checkpointer, ctx) -> None:
    """Refuse a checkpointer this world cannot have, before anything trains."""
    if checkpointer is Checkpointer.PROCESS and not ctx.has_process_group:
        raise CheckpointError("the process checkpointer needs a process group (more than one rank, or a job "
                              "started by torchrun); in a world of one use the thread checkpointer "
                              "(checkpointer='thread', or --async-save without a value)")


def _checkpointer_process_environment(ctx) -> None:
    """Point DCP's checkpointer processes at the store the ranks met at (Note [the checkpointer process's
    rendezvous])."""
    check_checkpointer(Checkpointer.PROCESS, ctx)
    os.environ["DCP_USE_PREFIX_STORE"] = "1"
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        address = _store_address()
        if address is None:
            raise CheckpointError("the process checkpointer needs the address of the ranks' TCPStore "
                                  "(MASTER_ADDR and MASTER_PORT), and this process group has none")
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address[0], str(address[1])


def _store_address() -> tuple[str, int] | None:
    """Host and port of the TCPStore under the default process group's store, if it is one."""
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return store.host, store.port
    return None


__all__ = ["AsyncSave", "Checkpointer", "Saves", "check_checkpointer", "save_async", "single_process_is_intended",
           "start_write", "stop_checkpointer_process", "wait_for_saves"]
