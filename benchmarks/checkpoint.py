"""``python -m benchmarks.checkpoint``: checkpoint save, load, async-save overhead and bytes, shardlang vs FSDP2 + DCP.

Both systems train the same GPT (`benchmarks.modes`: shardlang ZeRO-3 with one
unit per block, FSDP2 ``fully_shard`` per block and on the root, AdamW) in the
same N processes, one after the other, and each is measured the same way:

- save: ``step.save(dir)`` against ``dcp.save({"model": get_model_state_dict,
  "optimizer": get_optimizer_state_dict})``, wall time on the slowest rank, from a
  barrier to the end of the save (both include every rank's write and the metadata);
- load: ``step.load(dir)`` against ``get_*_state_dict`` + ``dcp.load`` +
  ``set_*_state_dict`` (shardlang's includes checking every file's digest);
- async-save overhead: the mean time of ``--steps`` training steps right after
  ``step.save_async`` / ``dcp.async_save`` (on a gloo group of its own), minus the
  mean of the same number of steps with no save in flight; the call itself
  (shardlang's copy of the state; DCP's staging) is reported apart;
- bytes on disk: the checkpoint directory's files;
- the digests' cost, apart (shardlang only): reading this rank's files back
  and digesting them (what the manifest cost before the writer threads
  digested as they wrote), and the load's share of the digests.

Each measurement is repeated ``--repeats`` times and the median is reported (the
machine is shared: timings are noisy). Writes JSON to ``--out`` and prints a table.

Example::

    python -m benchmarks.checkpoint --size 100M --world 4 --out docs/benchmarks/checkpoint/100M-n4.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardlang.checkpoint import store
from shardlang.runtime import WorkerPool

from .modes import SIZES, RunSpec, build_trainer

TIMEOUT_S = 3600.0


def _barrier_time(fn) -> float:
    """Wall time of ``fn()`` from a barrier to its end on the slowest rank."""
    dist.barrier()
    started = time.perf_counter()
    fn()
    elapsed = torch.tensor(time.perf_counter() - started, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _steps(trainer, batches, n: int) -> list[float]:
    times = []
    for k in range(n):
        dist.barrier()
        started = time.perf_counter()
        trainer.step(batches[k % len(batches)])
        elapsed = torch.tensor(time.perf_counter() - started, dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
    return times


def _fsdp_state(trainer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(trainer.module),
            "optimizer": get_optimizer_state_dict(trainer.module, trainer.optimizer)}


def measure_rank(ctx, size: str, root: str, steps: int, repeats: int, partial: str | None = None,
                 checkpointer: str = "thread") -> dict:
    """One rank: build both systems, warm up, then time save, load and async save for each.

    ``checkpointer`` is DCP's for both systems' async saves: a thread, or a process per rank (the first
    async save starts it, and the median of the repeats leaves that out when there are three or more).

    Rank 0 writes what it has so far to ``partial`` after each system (a run killed midway keeps it).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    spec = RunSpec(SIZES[size], ("shardlang", "fsdp2"), ctx.world_size, warmup=1, steps=steps)
    batches = spec.batches(ctx.rank)
    root_path = Path(root)
    async_group = dist.new_group(backend="gloo")
    out: dict[str, dict] = {}
    for mode in ("shardlang", "fsdp2"):
        trainer = build_trainer(mode, spec, ctx, batches[0])
        _steps(trainer, batches, 2)  # warm-up: lazily created state (torch's AdamW moments) exists
        result: dict[str, list[float]] = {"save_s": [], "load_s": [], "async_call_s": [], "async_steps_s": [],
                                          "plain_steps_s": []}
        for r in range(repeats):
            path = root_path / f"{mode}-{r}"
            if mode == "shardlang":
                step = trainer.step_fn
                result["save_s"].append(_barrier_time(lambda: step.save(path)))
                result["load_s"].append(_barrier_time(lambda: step.load(path)))
                files = store.own_files(path, ctx.rank, ctx.world_size)
                result.setdefault("read_back_checksums_s", []).append(_barrier_time(lambda: store.describe(files)))
                manifest = store.read_manifest(path)
                result.setdefault("load_checksums_s", []).append(
                    _barrier_time(lambda: store.damaged_files(path, manifest, ctx.rank, ctx.world_size)))
            else:
                result["save_s"].append(_barrier_time(lambda: dcp.save(_fsdp_state(trainer), checkpoint_id=str(path))))

                def load():
                    sd = _fsdp_state(trainer)
                    dcp.load(sd, checkpoint_id=str(path))
                    set_model_state_dict(trainer.module, sd["model"])
                    set_optimizer_state_dict(trainer.module, trainer.optimizer, sd["optimizer"])

                result["load_s"].append(_barrier_time(load))
            result["plain_steps_s"].append(statistics.mean(_steps(trainer, batches, steps)))
            apath = root_path / f"{mode}-async-{r}"
            pending = []

            def start():
                if mode == "shardlang":
                    pending.append(trainer.step_fn.save_async(apath, checkpointer=checkpointer))
                else:
                    pending.append(dcp.async_save(_fsdp_state(trainer), checkpoint_id=str(apath),
                                                  process_group=async_group,
                                                  async_checkpointer_type=AsyncCheckpointerType(checkpointer)))

            result["async_call_s"].append(_barrier_time(start))
            result["async_steps_s"].append(statistics.mean(_steps(trainer, batches, steps)))
            (pending[0].wait() if mode == "shardlang" else pending[0].result())
            dist.barrier()
        if ctx.rank == 0:
            result["bytes"] = _dir_bytes(root_path / f"{mode}-0")
            for p in root_path.iterdir():
                shutil.rmtree(p, ignore_errors=True)
        dist.barrier()
        out[mode] = result
        if partial and ctx.rank == 0:
            Path(partial).write_text(json.dumps(out, indent=1))
        del trainer, pending
        gc.collect()  # the compiled step's graph holds cycles: free this system before building the next
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.checkpoint", description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="100M")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="training steps per timing of the async overhead")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--checkpointer", choices=("thread", "process"), default="thread",
                        help="who writes both systems' async saves: a thread of each rank, or DCP's process per rank")
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary directory)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    root = Path(args.dir or tempfile.mkdtemp(prefix="shardlang-ckpt-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with WorkerPool(args.world, timeout=TIMEOUT_S, threads=1) as pool:
        partial = str(Path(args.out).with_suffix(".partial.json")) if args.out else None
        per_rank = pool.run(measure_rank, args.size, str(root), args.steps, args.repeats, partial, args.checkpointer)
    result = {"size": args.size, "world": args.world, "steps": args.steps, "repeats": args.repeats,
              "checkpointer": args.checkpointer,
              "loadavg": os.getloadavg()[0], "wall_s": time.perf_counter() - started, "modes": per_rank[0]}
    print(report(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


def report(result: dict) -> str:
    """The results as a Markdown table (medians over the repeats)."""
    lines = [f"{result['size']} GPT, N={result['world']}, async saves by a {result.get('checkpointer', 'thread')}, "
             f"medians of {result['repeats']} (load average "
             f"{result['loadavg']:.1f} at the end)", "",
             "| system | save | load | async call | step with async save in flight | step without | overhead | "
             "bytes on disk |", "|---|---|---|---|---|---|---|---|"]
    for mode, r in result["modes"].items():
        med = {k: statistics.median(v) for k, v in r.items() if isinstance(v, list)}
        lines.append(f"| {mode} | {med['save_s']:.2f} s | {med['load_s']:.2f} s | {med['async_call_s']:.2f} s | "
                     f"{med['async_steps_s']:.2f} s | {med['plain_steps_s']:.2f} s | "
                     f"{med['async_steps_s'] - med['plain_steps_s']:+.2f} s | {r['bytes'] / 1e6:.0f} MB |")
    for mode, r in result["modes"].items():
        if "read_back_checksums_s" in r:
            lines.append(f"\n{mode} digests, apart: reading its files back and digesting them "
                         f"{statistics.median(r['read_back_checksums_s']):.2f} s (avoided: the writer digests as "
                         f"it writes); a load's share {statistics.median(r['load_checksums_s']):.2f} s (on a thread "
                         "while DCP reads)")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
