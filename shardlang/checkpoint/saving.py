"""Save and load a step's state with torch.distributed.checkpoint: every rank its own chunks, atomically.

`save` builds the state dict of Note [checkpoint keys] over the step's own
storage (views, no copies), writes it with ``dcp.save`` into a temporary
directory and publishes it (Note [atomic checkpoints]). `save_async` hands the
same state dict to ``dcp.async_save``, which stages a copy between two steps
and writes it while training goes on (Note [async saves] in `background`). `load`
checks the files and the keys, then lets DCP read each rank's chunks straight
into its storage, resharding from whatever layout and world size wrote them.

Note [checksums while writing]: the manifest's CRC-32s are computed by DCP's
writer threads as the bytes go out (`checksums.ChecksummingWriter`), not by
reading the files back.

Note [checksums while loading]: a load first checks that every file is there
with its size, and ``.metadata`` against its digest (nothing is written before
that); then the reader checks each item's bytes against their segment digests
as DCP reads them (Note [segment digests] in `checksums`), so no file is read
twice. Files without segment digests (older manifests) are checked whole, each
rank a share, on a thread while DCP reads. A damaged file is reported on every
rank, ahead of whatever error reading it caused. A load that fails on a digest
has overwritten part of the step's state with what it read: load another
checkpoint, or build the step again.

Example::

    step.save("ckpt/step-3")                  # what `Step.save` calls
    restored = step.load("ckpt/step-3")       # Restored(steps=3, data_position=3, world_size=4, ...)
"""

from __future__ import annotations

import concurrent.futures
import errno
import functools
import json
import shutil
from pathlib import Path

import attrs
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..compiler import hyper_name
from ..errors import CheckpointError
from . import background, store
from .background import AsyncSave, Checkpointer, wait_for_saves
from .checksums import ChecksummingWriter
from .planner import EntryLoadPlanner
from .untrusted import SafeReader
from .state_dict import (DATA_KEY, DATA_STATE_KEY, HYPER_CHECKED, META_KEY, SCHEDULE_KEY, STEP_KEY,
                         data_state_from_json, meta, model_entries, optimizer_entries, own_entries, param_groups, schedule_from_saved,
                         set_rng)

#: DCP writer threads per rank (`FileSystemWriter(thread_count=...)`), chosen by measurement (docs/benchmarks.md).
WRITER_THREADS = 2


@attrs.frozen
class Restored:
    """What `load` restored: the step count, the data position, and the run that wrote the checkpoint.

    ``foreign`` is True for a checkpoint shardlang did not write (FSDP2's, say): it had
    no step count, schedule, RNG or data position of shardlang's, so those were derived
    (the step count from the optimizer's ``step``) or left as they were.
    """

    path: Path
    steps: int
    data_position: int
    world_size: int | None
    spec: dict | None
    foreign: bool
    data_state: dict | None = None  # the data loader's state_dict saved with it (Note [loader batches])


def state_dict(step, data_position: int | None = None, data_state: dict | None = None) -> dict:
    """The state dict `save` writes (Note [checkpoint keys]): views of the step's own storage."""
    position = step.steps_done if data_position is None else data_position
    return {
        "model": model_entries(step),
        "optimizer": {"state": optimizer_entries(step), "param_groups": param_groups(step)},
        "shardlang": own_entries(step, position, data_state),
    }


def save(step, path, *, data_position: int | None = None, run: str | None = None,
         data_state: dict | None = None) -> Path:
    """Write ``step``'s state to the checkpoint directory ``path`` (a collective: every rank calls it).

    ``data_position`` is the job's position in its data (default: the steps done); ``data_state`` its
    data loader's ``state_dict()`` (saved as JSON, given back by `load`); ``run`` the id of the run
    that saves, recorded in the manifest (Note [replacing a checkpoint] in `store`).
    """
    path, ctx = Path(path), step.dist
    sd = state_dict(step, data_position, data_state)
    tmp, writer, planner = background.start_write(step, path, None, threads=WRITER_THREADS)

    def upload():
        dcp.save(sd, storage_writer=writer, planner=planner, no_dist=not ctx.has_process_group)

    return _publish(upload, path, tmp, writer, None, ctx=ctx, record=_record(sd, ctx, run))


def save_async(step, path, *, data_position: int | None = None, run: str | None = None,
               checkpointer: Checkpointer | str = Checkpointer.THREAD, data_state: dict | None = None) -> AsyncSave:
    """Stage ``step``'s state now and write it in the background (a collective, as `save`; Note [async saves]).

    ``checkpointer`` is ``"thread"`` or ``"process"`` (DCP's checkpointer process per rank). A save
    still in flight is waited for first, so one staged copy of the state serves every save.
    """
    checkpointer = Checkpointer.parse(checkpointer)
    path, ctx = Path(path), step.dist
    sd = state_dict(step, data_position, data_state)
    return background.save_async(step, sd, path, checkpointer, threads=WRITER_THREADS,
                                 publish=functools.partial(_publish, ctx=ctx, record=_record(sd, ctx, run)))


def _record(sd: dict, ctx, run: str | None) -> dict:
    """What the manifest says of the save besides its files."""
    return {"steps": json.loads(sd["shardlang"]["meta"])["steps"], "world_size": ctx.world_size, "run": run}


def _publish(upload, path: Path, tmp: Path, writer: ChecksummingWriter, group, *, ctx, record: dict) -> Path:
    """Wait for ``upload`` (DCP's write of ``tmp``), then publish ``path`` (Note [atomic checkpoints])."""
    try:
        upload()
        store.publish(path, ctx.rank, ctx.world_size, group, record, writer.written_digests(ctx.rank))
    except Exception as exc:  # nothing half-written stays behind; the previous checkpoint is untouched
        if ctx.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise _write_error(exc, path, tmp) from exc
    return path


#: Below this many free bytes, a failed write is taken for a full disk (torch's writer reports ENOSPC as
#: "unexpected pos", without the errno).
NEARLY_FULL_BYTES = 64 * 2**20


def _write_error(exc: Exception, path: Path, tmp: Path) -> CheckpointError:
    """What failed, said so that a user can act: a full disk names ENOSPC and where."""
    detail = _first_failure(exc) if isinstance(exc, CheckpointException) else f"{type(exc).__name__}: {exc}"
    causes = [inner for _rank, inner in _failures(exc)] if isinstance(exc, CheckpointException) else [exc]
    full = any(isinstance(c, OSError) and c.errno in (errno.ENOSPC, errno.EDQUOT) for c in _chain(causes))
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        free = None
    if full or (free is not None and free < NEARLY_FULL_BYTES):
        shown = f"{free / 2**20:.1f} MiB free" if free is not None else "no space left"
        return CheckpointError(f"writing checkpoint {path} failed: no space left on the device that holds "
                               f"{path.parent} (ENOSPC, {shown}); the unfinished {tmp.name} was removed and earlier "
                               f"checkpoints are untouched. Free space or pass another --checkpoint-dir "
                               f"({detail})", path=path)
    return CheckpointError(f"writing checkpoint {path} failed: {detail}; the unfinished {tmp.name} was removed and "
                           "earlier checkpoints are untouched", path=path)


def _chain(errors: list[BaseException]):
    """Each error and its causes."""
    for error in errors:
        seen = set()
        while error is not None and id(error) not in seen:
            seen.add(id(error))
            yield error
            error = error.__cause__ or error.__context__


def load(step, path) -> Restored:
    """Read the checkpoint at ``path`` into ``step``'s state (a collective), resharding as needed.

    Raises `CheckpointError` naming the key or file for a checkpoint of another
    model, a tensor of another shape or dtype, a missing, truncated or corrupt file.
    """
    path = Path(path)
    ctx = step.dist
    own = (path / store.MANIFEST).is_file()
    manifest = store.read_manifest(path) if own else None
    if own:
        store.check_sizes(path, manifest)
    elif not (path / ".metadata").is_file():
        store.read_manifest(path)  # raises: not a directory, or an unfinished save
    reader = SafeReader(str(path), manifest["files"] if own else None)  # Note [checkpoints run no code]
    try:
        saved = reader.read_metadata().state_dict_metadata
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{path / '.metadata'} cannot be read: {exc}", path=path / ".metadata") from None
    _check_no_extra(saved, step, path)
    target, optional = _targets(step, saved)
    # Note [checksums while loading]: the reader checks each item it reads by its segment digests; the files
    # a manifest gives no segments (older checkpoints) are checked whole, this rank's share, on a thread.
    whole = {"files": {n: e for n, e in manifest["files"].items() if store.SEGMENTS not in e}} if own else None
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardlang-verify") as pool:
        checking = pool.submit(store.damaged_files, path, whole, ctx.rank, ctx.world_size) if own else None
        failure = None
        try:
            background.single_process_is_intended(ctx)
            dcp.load(target, storage_reader=reader, planner=EntryLoadPlanner(str(path), frozenset(optional)),
                     no_dist=not ctx.has_process_group)
        except CheckpointException as exc:
            failure = _unwrap(exc, path)
        except CheckpointError as exc:  # every rank still takes part in the agreement below
            failure = exc
        except Exception as exc:
            failure = CheckpointError(f"reading checkpoint {path} failed: {type(exc).__name__}: {exc}", path=path)
            failure.__cause__ = exc
        if checking is not None:  # a damaged file explains a failed read better than the read's own error
            untiled = {"files": {n: manifest["files"][n] for n in sorted(reader.unverified)}}
            problems = checking.result() + store.damaged_files(path, untiled, 0, 1)
            store.agree_on_damage(path, problems, ctx.world_size, None)
    if failure is not None:
        raise failure
    return _apply(step, target, saved, path)


def _targets(step, saved) -> tuple[dict, set[str]]:
    """The state dict to load into (views of the step's storage) and the keys a checkpoint may lack."""
    optim = optimizer_entries(step)
    optional: set[str] = set()
    for name, per in optim.items():
        if "step" in per:
            key = f"optimizer.state.{name}.step"
            dtype = saved[key].properties.dtype if key in saved else torch.float32
            per["step"] = torch.zeros((), dtype=dtype)
            optional.add(key)
    groups = param_groups(step)
    for g, group in enumerate(groups):
        optional.update(f"optimizer.param_groups.{g}.{k}" for k in group)
    own: dict[str, object] = {"step_count": torch.zeros((), dtype=torch.float64), "data_position": 0, "meta": "",
                              "lr_schedule": "", "data_state": ""}
    optional.update(f"shardlang.{k}" for k in own)
    if step.random is not None:
        key = next((k for k in (f"shardlang.rng.rank{step.dist.rank}", "shardlang.rng.rank0") if k in saved), None)
        if key is not None:
            own["rng"] = {key.rsplit(".", 1)[1]: torch.zeros(tuple(saved[key].size), dtype=torch.uint8)}
    return {"model": model_entries(step), "optimizer": {"state": optim, "param_groups": groups},
            "shardlang": own}, optional


def _check_no_extra(saved, step, path: Path) -> None:
    """Tensors the checkpoint has and this model lacks mean another model: an error, not a partial load."""
    mine = {f"model.{n}" for n in (*step.names.parameters, *step.names.aliases, *step.names.persistent_buffers)}
    extra = sorted(k for k in saved if k.startswith("model.") and k not in mine)
    if extra:
        shown = ", ".join(repr(k) for k in extra[:6]) + (f", ... ({len(extra)} in all)" if len(extra) > 6 else "")
        raise CheckpointError(f"{path} has tensors this model does not: {shown}; it was written for another model",
                              path=path, key=extra[0])
    groups = {k.split(".")[2] for k in saved if k.startswith("optimizer.param_groups.")}
    expected = len(step.compiled.traced.optimizer.groups)
    if groups and len(groups) != expected:
        raise CheckpointError(f"{path} has {len(groups)} optimizer param groups and this step {expected}; the "
                              "param_groups of the spec must be the same", path=path, key="optimizer.param_groups")


def _apply(step, target: dict, saved, path: Path) -> Restored:
    """After DCP has filled ``target``: the step count, learning rates, schedule, RNG; the `Restored` record."""
    own = target["shardlang"]
    foreign = META_KEY not in saved
    if STEP_KEY in saved:
        step.state.step_count.copy_(own["step_count"])
    else:
        counts = [per["step"] for name, per in target["optimizer"]["state"].items()
                  if "step" in per and f"optimizer.state.{name}.step" in saved]
        if counts:
            step.state.step_count.copy_(counts[0].to(torch.float64))
    _apply_param_groups(step, target["optimizer"]["param_groups"], saved, path)
    if step.lr_schedule is not None:
        if SCHEDULE_KEY in saved:
            step.lr_schedule.scheduler.load_state_dict(schedule_from_saved(own["lr_schedule"], str(path)))
        for g, name in enumerate(step.lr_schedule.names):
            group = step.lr_schedule.optimizer.param_groups[g]
            group["lr"] = float(step.hyper[name])
            loaded = target["optimizer"]["param_groups"][g]
            if f"optimizer.param_groups.{g}.initial_lr" in saved:
                group["initial_lr"] = loaded["initial_lr"]
    if "rng" in own:
        set_rng(step.random, next(iter(own["rng"].values())))
    record = json.loads(own["meta"]) if not foreign else {}
    steps = step.steps_done
    data_state = data_state_from_json(own["data_state"], str(path)) if DATA_STATE_KEY in saved else None
    return Restored(path=path, steps=steps, data_position=own["data_position"] if DATA_KEY in saved else steps,
                    world_size=record.get("world_size"), spec=record.get("spec"), foreign=foreign,
                    data_state=data_state)


def _apply_param_groups(step, groups: list[dict], saved, path: Path) -> None:
    """Each group's lr into the step's lr input; the hyperparameters compiled into the graph must agree."""
    mine = param_groups(step)
    for g, (loaded, expected) in enumerate(zip(groups, mine)):
        def present(k):
            return f"optimizer.param_groups.{g}.{k}" in saved

        if present("params") and list(loaded["params"]) != expected["params"]:
            raise CheckpointError(f"{path}: optimizer param group {g} holds {_few(loaded['params'])} there and "
                                  f"{_few(expected['params'])} here", path=path, key=f"optimizer.param_groups.{g}")
        for k in HYPER_CHECKED:
            if k in expected and present(k) and _value(loaded[k]) != _value(expected[k]):
                raise CheckpointError(
                    f"{path}: optimizer param group {g} has {k}={loaded[k]!r} there and {expected[k]!r} here; "
                    "only lr is a graph input, so compile with the checkpoint's value",
                    path=path, key=f"optimizer.param_groups.{g}.{k}")
        if present("lr"):
            step.hyper[hyper_name("lr", g)].fill_(float(loaded["lr"]))


def _value(v):
    return tuple(v) if isinstance(v, (list, tuple)) else v


def _few(names) -> str:
    names = list(names)
    return "[" + ", ".join(repr(n) for n in names[:4]) + (f", ... ({len(names)} in all)]" if len(names) > 4 else "]")


def _failures(exc: CheckpointException) -> list[tuple[int, BaseException]]:
    """(rank, exception) for every rank DCP reports failed; its failures are (exception, stack) pairs."""
    failures = getattr(exc, "failures", {}) or {}
    return [(rank, f[0] if isinstance(f, tuple) else f) for rank, f in sorted(failures.items())]


def _first_failure(exc: CheckpointException) -> str:
    for rank, inner in _failures(exc):
        return f"rank {rank}: {type(inner).__name__}: {inner}"
    return str(exc)


def _unwrap(exc: CheckpointException, path: Path) -> CheckpointError:
    """A `CheckpointError` raised in a rank's planner, or one that names the rank and what DCP raised."""
    for _rank, inner in _failures(exc):
        if isinstance(inner, CheckpointError):
            return inner
    return CheckpointError(f"reading checkpoint {path} failed: {_first_failure(exc)}", path=path)


__all__ = ["AsyncSave", "Checkpointer", "Restored", "load", "meta", "save", "save_async", "state_dict",
           "wait_for_saves"]
