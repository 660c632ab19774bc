"""``python -m benchmarks.checkpoint_load``: checkpoint load, shardlang vs FSDP2 + DCP, interleaved, with its phases.

Both systems are built side by side in the same N processes (`benchmarks.modes`:
shardlang ZeRO-3 with one unit per block, FSDP2 ``fully_shard`` per block and on
the root, AdamW), trained two steps, and saved once each. Then each repeat loads
both, one after the other, the order alternating from repeat to repeat, so that
drift in the machine's load falls on both alike; the ratio is taken per pair,
and of the medians.

- shardlang: ``step.load(dir)``, every check included (manifest and sizes,
  ``.metadata``'s digest, each item's segment digests, keys, shapes and dtypes);
- FSDP2: ``get_model_state_dict`` / ``get_optimizer_state_dict``, ``dcp.load``,
  ``set_model_state_dict`` / ``set_optimizer_state_dict``.

Each is timed on the slowest rank, from a barrier to its end. shardlang's load
is also cut into its phases, each summed over the load on rank 0 (the rest is
DCP's planning and the collectives between the ranks): the manifest, the
``.metadata`` read, reading the items' bytes, their digests, reading the tensor
records (Note [tensor records]), the copy into the step's own tensors, and the
non-tensor values (``torch.load(weights_only=True)``).

Example::

    python -m benchmarks.checkpoint_load --size 100M --world 2 --repeats 7 --out docs/benchmarks/checkpoint/load-100M-n2.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from shardlang.runtime import WorkerPool

from .checkpoint import TIMEOUT_S, _barrier_time, _fsdp_state, _steps
from .modes import SIZES, RunSpec, build_trainer

#: shardlang's load phases: (label, module, attribute) of the function each one's time is spent in.
PHASES = (
    ("manifest and sizes", "shardlang.checkpoint.store", "read_manifest"),
    ("manifest and sizes", "shardlang.checkpoint.store", "check_sizes"),
    (".metadata read", "shardlang.checkpoint.untrusted", "SafeReader._read_metadata"),
    ("item bytes read", "shardlang.checkpoint.untrusted", "SafeReader._read_item"),
    ("segment digests", "shardlang.checkpoint.untrusted", "_check_segments"),
    ("tensor records", "shardlang.checkpoint.untrusted", "tensor_of"),
    ("copy into the step", "shardlang.checkpoint.untrusted", "_copy_into"),
    ("non-tensor values", "shardlang.checkpoint.planner", "EntryLoadPlanner.load_bytes"),
)


def _timed_phases() -> dict[str, float]:
    """Wrap each phase's function so that its seconds add up in the returned dict (this process only)."""
    import importlib

    spent: dict[str, float] = {}
    for label, module_name, attribute in PHASES:
        owner = importlib.import_module(module_name)
        *path, name = attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        original = getattr(owner, name, None)
        if original is None:  # a version of shardlang without this phase's function (measured before it)
            continue

        @functools.wraps(original)
        def timed(*args, _original=original, _label=label, **kwargs):
            started = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                spent[_label] = spent.get(_label, 0.0) + time.perf_counter() - started

        setattr(owner, name, timed)
    return spent


def measure_rank(ctx, size: str, root: str, repeats: int) -> dict:
    """One rank: both systems built, saved once each, then loaded ``repeats`` times, interleaved."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    spec = RunSpec(SIZES[size], ("shardlang", "fsdp2"), ctx.world_size, warmup=1, steps=2)
    batches = spec.batches(ctx.rank)
    trainers = {mode: build_trainer(mode, spec, ctx, batches[0]) for mode in ("shardlang", "fsdp2")}
    for trainer in trainers.values():
        _steps(trainer, batches, 2)  # lazily created state (torch's AdamW moments) exists
    root_path = Path(root)
    step = trainers["shardlang"].step_fn
    step.save(root_path / "shardlang")
    dcp.save(_fsdp_state(trainers["fsdp2"]), checkpoint_id=str(root_path / "fsdp2"))

    def fsdp2_load():
        fsdp2 = trainers["fsdp2"]
        sd = _fsdp_state(fsdp2)
        dcp.load(sd, checkpoint_id=str(root_path / "fsdp2"))
        set_model_state_dict(fsdp2.module, sd["model"])
        set_optimizer_state_dict(fsdp2.module, fsdp2.optimizer, sd["optimizer"])

    loads = {"shardlang": lambda: step.load(root_path / "shardlang"), "fsdp2": fsdp2_load}
    spent = _timed_phases()
    pairs, phases = [], []
    for r in range(repeats):
        order = ("shardlang", "fsdp2") if r % 2 == 0 else ("fsdp2", "shardlang")
        seconds = {}
        for mode in order:
            spent.clear()
            seconds[mode] = _barrier_time(loads[mode])
            if mode == "shardlang":
                phases.append(dict(spent))
        pairs.append({"shardlang_s": seconds["shardlang"], "fsdp2_s": seconds["fsdp2"], "first": order[0]})
    return {"pairs": pairs, "phases": phases}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.checkpoint_load", description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="100M")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary directory)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    root = Path(args.dir or tempfile.mkdtemp(prefix="shardlang-load-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with WorkerPool(args.world, timeout=TIMEOUT_S, threads=1) as pool:
        per_rank = pool.run(measure_rank, args.size, str(root), args.repeats)
    result = {"size": args.size, "world": args.world, "repeats": args.repeats, "loadavg": os.getloadavg()[0],
              "wall_s": time.perf_counter() - started, **per_rank[0]}
    print(report(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


def report(result: dict) -> str:
    """Every pair, the medians and their ratio, and the median of each phase of shardlang's load."""
    pairs = result["pairs"]
    lines = [f"{result['size']} GPT, N={result['world']}, {len(pairs)} interleaved repeats (load average "
             f"{result['loadavg']:.1f} at the end)", "",
             "| repeat | first | shardlang | FSDP2 + DCP | ratio |", "|---|---|---|---|---|"]
    for i, p in enumerate(pairs, start=1):
        lines.append(f"| {i} | {p['first']} | {p['shardlang_s']:.3f} s | {p['fsdp2_s']:.3f} s | "
                     f"{p['shardlang_s'] / p['fsdp2_s']:.2f} |")
    ours = statistics.median(p["shardlang_s"] for p in pairs)
    theirs = statistics.median(p["fsdp2_s"] for p in pairs)
    lines.append(f"| median | | {ours:.3f} s | {theirs:.3f} s | {ours / theirs:.2f} |")
    labels = list(dict.fromkeys(label for label, _, _ in PHASES))
    medians = {label: statistics.median(p.get(label, 0.0) for p in result["phases"]) for label in labels}
    # the item reads include their digests (`_check_segments` runs inside `_read_item`): shown apart
    medians["item bytes read"] -= medians["segment digests"]
    lines += ["", "shardlang's load on rank 0, median of each phase:", "", "| phase | seconds | share |", "|---|---|---|"]
    for label in labels:
        lines.append(f"| {label} | {medians[label]:.3f} s | {medians[label] / ours:.0%} |")
    rest = ours - sum(medians.values())
    lines.append(f"| DCP's planning, the collectives, the rest | {rest:.3f} s | {rest / ours:.0%} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
