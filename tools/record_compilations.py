"""Record what the compiler makes of many configurations, to show that a refactor changes nothing.

For each configuration (an example job, a world size, a mesh, strategies, recompute,
accumulation, backend), the job is planned with fake tensors (no processes, no weights)
and the record keeps: the compiled graph's code, the graph bound to named process groups
(`compiler.lower.emit.bind`, with and without the all-to-all lowering), the schedule as JSON and
the memory plan as JSON. Write the records before a change and compare after::

    python tools/record_compilations.py --out /tmp/before.json
    ... change the code ...
    python tools/record_compilations.py --out /tmp/after.json --compare /tmp/before.json

``--compare`` prints every configuration whose record differs, field by field, and exits 1
if any does.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import pkgutil
import sys
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import shardlang as sl  # noqa: E402
from shardlang import api  # noqa: E402
from shardlang.cli.common import split_for_rank  # noqa: E402
from shardlang.cli.job import build, global_batch, load_job  # noqa: E402

JOBS = ("mlp", "gpt", "llama", "bert", "resnet")


class NamedGroups(dict):
    """Every group key bound to a name of its own (``group:<key>``): binding needs no process group."""

    def __missing__(self, key: str) -> str:
        return f"group:{key}"


def configurations() -> list[tuple[str, str, int, dict]]:
    """(name, job, world size, changes to the job's spec) of every configuration recorded."""
    found = []
    for job in JOBS:
        for world in (2, 4):
            found.append((f"{job} N={world}", job, world, {}))
        found.append((f"{job} N=4 2x2 hybrid", job, 4, {"mesh": sl.Mesh(replicate=2, fsdp=2)}))
        for strategy in ("ZeRO2", "ZeRO1", "DDP"):
            found.append((f"{job} N=2 {strategy}", job, 2, {"strategies": getattr(sl, strategy)}))
        found.append((f"{job} N=2 recompute full", job, 2, {"recompute": [("*", "full")]}))
        found.append((f"{job} N=2 microbatches 2", job, 2, {"options": {"microbatches": 2}}))
        found.append((f"{job} N=2 accumulation keep", job, 2, {"options": {"microbatches": 2,
                                                                            "accumulation": "keep"}}))
        found.append((f"{job} N=2 prefetch 2, no reshard", job, 2, {"options": {"prefetch": 2,
                                                                                "reshard_after_forward": False}}))
        found.append((f"{job} N=2 inductor", job, 2, {"options": {"backend": "inductor"}}))
    return found


def canonical(code: str) -> str:
    """Graph code with the compiler's own functions named without their module (FX names a call
    ``shardlang_compiler_ir_collectives_wait``): a module that moves changes no record."""
    for prefix in _module_prefixes():
        code = code.replace(prefix, "")
    return code


@functools.cache
def _module_prefixes() -> tuple[str, ...]:
    """``shardlang_compiler_<module>_`` for every compiler module, longest first."""
    import shardlang.compiler

    names = [m.name for m in pkgutil.walk_packages(shardlang.compiler.__path__, "shardlang.compiler.")]
    return tuple(name.replace(".", "_") + "_" for name in sorted(names, key=len, reverse=True))


def record(job_name: str, world: int, changes: dict) -> dict[str, object]:
    job = load_job(ROOT / "examples" / f"{job_name}.py")
    spec = job.spec
    options = changes.get("options")
    if options:
        spec = attrs.evolve(spec, options=attrs.evolve(spec.options, **options))
    spec = attrs.evolve(spec, **{k: v for k, v in changes.items() if k != "options"})
    example = split_for_rank(job, global_batch(job, 0), world, 0, 0)
    with contextlib.redirect_stdout(io.StringIO()):
        compiled = api.plan(lambda: build(job), job.loss_fn, spec, optimizer=job.optimizer, example_batch=example,
                            world_size=world)
    from shardlang.compiler.lower.emit import bind

    coordinates = dict(compiled.context.mesh.coordinate(0))
    return {
        "graph": canonical(compiled.graph_module.code),
        "bound": canonical(bind(compiled.graph_module, NamedGroups(), coordinates).code),
        "bound all-to-all": canonical(bind(compiled.graph_module, NamedGroups(), coordinates,
                                           reduce_scatter_as_all_to_all=True).code),
        "schedule": compiled.schedule.to_json(),
        "memory": compiled.memory.to_json(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the records (JSON)")
    parser.add_argument("--compare", default=None, help="records written before, to compare with")
    args = parser.parse_args(argv)
    os.environ.setdefault("LLAMA_SIZE", "tiny")
    records = {}
    for name, job, world, changes in configurations():
        records[name] = record(job, world, changes)
        print(f"recorded {name}", file=sys.stderr, flush=True)
    Path(args.out).write_text(json.dumps(records, indent=1, sort_keys=True))
    print(f"{len(records)} configurations written to {args.out}")
    if args.compare is None:
        return 0
    before = json.loads(Path(args.compare).read_text())
    differ = [(name, field) for name in sorted(set(before) | set(records))
              for field in sorted(set(before.get(name, {})) | set(records.get(name, {})))
              if before.get(name, {}).get(field) != records.get(name, {}).get(field)]
    for name, field in differ:
        print(f"differs: {name}: {field}")
    print(f"{len(records)} configurations, {len({n for n, _ in differ})} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
