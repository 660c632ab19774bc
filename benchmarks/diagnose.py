"""Where a shardlang step's memory and time go, and what schedule changes would save: a diagnostic.

    python -m benchmarks.diagnose --size 100M --world 2              # state, peak, the op at the peak
    python -m benchmarks.diagnose --size 100M --world 2 --timeline   # memory after every graph node
    python -m benchmarks.diagnose --size 100M --world 2 --early-reduce-waits --updates-after-reduction
    python -m benchmarks.diagnose --size 100M --world 1 --mode single --profile     # top ops by CPU time
    python -m benchmarks.diagnose --retention        # what a pending gloo collective keeps alive

It runs one mode of the benchmark (``--mode``, default ``shardlang``: full
sharding) on N local ranks and reports, on rank 0, the memory in use between
steps and its peak during a step, both above the rank's baseline (Note [memory
in use] in `probes.py`), the step's wall and CPU time, and the losses; with
``--timeline`` (shardlang modes) the memory after every graph node, with
``--profile`` torch.profiler's top ops.

The other flags are *what-if* rewrites of the bound graph, applied here, in the
benchmark process, to measure a proposed compiler change before anyone makes
it (they are not part of shardlang, and they read its private graph):

- ``--early-reduce-waits``: wait for each reduce-scatter just after the next one
  is issued (at most two in flight). A pending functional collective keeps its
  full-size input alive until its wait (and gloo's reduce-scatter adds a
  full-size all-reduce buffer), so waits at the end of backward kept every
  unit's whole gradient alive until then. (The compiler has done the same
  since ``passes/limit_reductions_in_flight.py``, waiting before the next issue.)
- ``--updates-after-reduction``: also move each flat parameter's optimizer update
  to just after its reduction's wait (dependencies first, in-place order kept),
  so its gradient shard dies there instead of living to the end of the step.
(Two earlier what-ifs, each gloo reduce-scatter as an all-to-all plus a local sum
and no division by one at N = 1, are now what the compiler does: Note
[reduce-scatter as all-to-all] in `compiler/lower/emit.py`, `passes/reduce_gradients.py`.)

Check that a rewrite keeps the numbers: the loss it prints must equal the one
without it.

``--retention`` measures, on 2 ranks, the memory a functional reduce-scatter and
all-gather on gloo hold between issue and wait, after the caller has dropped
its input: the reason late waits cost memory.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import statistics
import sys
import time

import torch
import torch.fx as fx

from shardlang.runtime.launcher import WorkerPool

from .modes import MODES, SHARDLANG_MODES, SIZES, RunSpec, _join_group, build_trainer
from .probes import StepProbe, give_memory_back, memory_in_use

MiB = 2**20


def _kind(node: fx.Node) -> str | None:
    return node.meta.get("sl", {}).get("kind")


def _flat(node: fx.Node) -> str | None:
    return node.meta.get("sl", {}).get("flat") or node.meta.get("custom", {}).get("flat")


def _phase(node: fx.Node) -> str | None:
    return node.meta.get("custom", {}).get("phase")


def early_reduce_waits(gm: fx.GraphModule) -> fx.GraphModule:
    """Move each reduction's wait to just after the next reduction is issued (the last one stays)."""
    nodes = list(gm.graph.nodes)
    issues = [n for n in nodes if _kind(n) in ("reduce_scatter", "all_reduce") and _phase(n) == "backward"]
    waits = {n.args[0]: n for n in nodes if _kind(n) == "wait_reduce"}
    for issue, following in zip(issues, issues[1:]):
        wait = waits.get(issue)
        if wait is not None:
            following.append(wait)
    gm.graph.lint()
    gm.recompile()
    return gm


def updates_after_reduction(gm: fx.GraphModule) -> fx.GraphModule:
    """Reorder so each flat parameter's optimizer nodes follow its reduction's wait.

    A topological sort by priority: every node keeps its position as priority,
    except a flat's optimizer nodes, which take their wait's; a node's priority is
    lowered to its earliest user's, so dependencies move up with it; and every
    user of a mutated input (through its views) stays ordered after the previous
    one, so in-place updates keep their order.
    """
    graph = gm.graph
    nodes = list(graph.nodes)
    pos = {n: float(i) for i, n in enumerate(nodes)}
    wait_of = {_flat(n): n for n in nodes if _kind(n) == "wait_reduce"}
    prio = dict(pos)
    for n in nodes:
        if _phase(n) == "optimizer" and _flat(n) in wait_of and n is not wait_of[_flat(n)]:
            prio[n] = pos[wait_of[_flat(n)]] + pos[n] / (10 * len(nodes))
    deps = {n: set(n.all_input_nodes) for n in nodes}
    for placeholder in (n for n in nodes if n.op == "placeholder"):
        readers = sorted({u for a in _aliases(placeholder) for u in a.users if not _is_alias(u)}, key=pos.get)
        last_write, since = None, []
        for reader in readers:  # reads may reorder among themselves, never across a write
            if last_write is not None:
                deps[reader].add(last_write)
            if _mutates(reader):
                deps[reader].update(since)
                last_write, since = reader, []
            else:
                since.append(reader)
    users = {n: set() for n in nodes}
    for n, ds in deps.items():
        for d in ds:
            users[d].add(n)
    for n in reversed(nodes):
        for u in users[n]:
            prio[n] = min(prio[n], prio[u])
    order = _priority_sort(nodes, deps, users, prio)
    output = next(n for n in nodes if n.op == "output")
    for n in order:
        if n.op not in ("placeholder", "output"):
            output.prepend(n)
    graph.lint()
    gm.recompile()
    return gm


def _mutates(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(getattr(node.target, "_schema", None), "is_mutable", False)


def _is_alias(node: fx.Node) -> bool:
    target = node.target
    return node.op == "call_function" and (
        getattr(target, "is_view", False) or _kind(node) == "unpack" or getattr(target, "__name__", "") == "getitem")


def _aliases(root: fx.Node) -> list[fx.Node]:
    seen, stack = [root], [root]
    while stack:
        for u in stack.pop().users:
            if u not in seen and _is_alias(u) and u.args and u.args[0] is root:
                seen.append(u)
                stack.append(u)
    return seen


def _priority_sort(nodes, deps, users, prio) -> list[fx.Node]:
    waiting = {n: len(deps[n]) for n in nodes}
    index = {n: i for i, n in enumerate(nodes)}
    ready = [(prio[n], index[n], n) for n in nodes if waiting[n] == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        _, _, n = heapq.heappop(ready)
        out.append(n)
        for u in users[n]:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, (prio[u], index[u], u))
    if len(out) != len(nodes):
        raise RuntimeError("updates_after_reduction: the dependencies have a cycle")
    return out


class _Timeline(fx.Interpreter):
    """Runs the graph node by node (freeing values after their last use) and records memory after each."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.samples: list[tuple[str, str, int]] = []

    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        self.samples.append((n.name, _kind(n) or _phase(n) or "", memory_in_use()))
        return out


def diagnose(ctx, size: str, mode: str, early: bool, updates: bool, timeline: bool, profile: bool,
             steps: int) -> dict:
    torch.set_num_threads(1)
    _, own_group = _join_group(RunSpec(SIZES[size], (mode,), ctx.world_size), ctx)  # gloo: no swap to undo
    spec = RunSpec(SIZES[size], (mode,), ctx.world_size, warmup=1, steps=steps)
    batches = spec.batches(ctx.rank)
    gc.collect()
    give_memory_back()
    base = memory_in_use()
    trainer = build_trainer(mode, spec, ctx, batches[0])
    step = getattr(trainer, "step_fn", None)
    if early or updates:
        step._graph = early_reduce_waits(step._graph)
    if updates:
        step._graph = updates_after_reduction(step._graph)
    losses, times, cpu = [], [], []
    for batch in batches[:-1]:
        started, cpu_started = time.perf_counter(), time.process_time()
        losses.append(float(trainer.step(batch)))
        times.append(time.perf_counter() - started)
        cpu.append(time.process_time() - cpu_started)
    gc.collect()
    state = memory_in_use() - base
    with StepProbe() as probe:
        losses.append(float(trainer.step(batches[-1])))
    out = {"state": state, "peak": probe.peak - base, "losses": losses, "step": statistics.median(times[1:] or times),
           "cpu": statistics.median(cpu[1:] or cpu)}
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            trainer.step(batches[0])
        out["profile"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    if own_group:
        torch.distributed.destroy_process_group()
    if timeline:
        from shardlang.step.batch import batch_leaves

        leaves = batch_leaves(batches[0], step.compiled.traced.batch_shapes, step.dist.device)
        recorder = _Timeline(step._graph)
        with torch.no_grad():
            recorder.run(*step.flat_tensors, *step.optimizer_state, step.step_count, *step.hyper.values(),
                         *step.buffers, *leaves)
        out["timeline"] = [(name, kind, used - base) for name, kind, used in recorder.samples]
    return out


def retention(ctx, mib: int = 100) -> dict[str, int]:
    """MiB in use around one functional reduce-scatter and one all-gather of ``mib`` MiB on gloo."""
    group = torch.distributed.group.WORLD.group_name
    c10d = torch.ops._c10d_functional
    n = ctx.world_size
    base = memory_in_use()
    points = {}
    x = torch.ones(mib * MiB // 4)
    out = c10d.reduce_scatter_tensor(x, "sum", n, group)
    points["reduce-scatter issued (input, output, gloo's buffer)"] = memory_in_use()
    del x
    time.sleep(1.0)  # long done by now
    points["input dropped, done, not waited"] = memory_in_use()
    out = c10d.wait_tensor(out)
    points["reduce-scatter waited"] = memory_in_use()
    del out
    y = torch.ones(mib * MiB // 4)
    gathered = c10d.all_gather_into_tensor(y, n, group)
    points[f"all-gather of {mib} MiB issued"] = memory_in_use()
    del y
    time.sleep(1.0)
    points["shard dropped, done, not waited"] = memory_in_use()
    gathered = c10d.wait_tensor(gathered)
    points["all-gather waited"] = memory_in_use()
    return {k: round((v - base) / MiB) for k, v in points.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.diagnose", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="10M", choices=list(SIZES))
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--mode", default="shardlang", choices=list(MODES[1:]) + ["single"],
                   help="the mode to look at (the rewrites and --timeline need a shardlang mode)")
    p.add_argument("--profile", action="store_true", help="torch.profiler's top ops by self CPU time, one step")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--early-reduce-waits", action="store_true")
    p.add_argument("--updates-after-reduction", action="store_true")
    p.add_argument("--timeline", action="store_true", help="memory after every graph node (an fx.Interpreter run)")
    p.add_argument("--retention", action="store_true", help="what pending gloo collectives hold (2 ranks)")
    args = p.parse_args(argv)
    if args.retention:
        with WorkerPool(2, threads=1) as pool:
            for what, used in pool.run(retention)[0].items():
                print(f"{used:6d} MiB  {what}")
        return 0
    rewrites = args.early_reduce_waits or args.updates_after_reduction
    if args.mode not in SHARDLANG_MODES and (rewrites or args.timeline):
        p.error(f"the what-if rewrites and --timeline need a shardlang mode, not {args.mode}")
    with WorkerPool(args.world, threads=1, timeout=None) as pool:
        pool.run(diagnose, "tiny", args.mode, False, False, False, False, 1)  # imports, one-time caches
        out = pool.run(diagnose, args.size, args.mode, args.early_reduce_waits, args.updates_after_reduction,
                       args.timeline, args.profile, args.steps)[0]
    print(f"{args.size} N={args.world} {args.mode} early_reduce_waits={args.early_reduce_waits} "
          f"updates_after_reduction={args.updates_after_reduction}")
    print(f"state {out['state'] / MiB:.1f} MiB, peak {out['peak'] / MiB:.1f} MiB, step {out['step']:.3f} s "
          f"(CPU {out['cpu']:.3f} s), "
          f"losses {' '.join(f'{x:.6f}' for x in out['losses'])}")
    if args.profile:
        print(out["profile"])
    if args.timeline:
        samples = out["timeline"]
        top = max(range(len(samples)), key=lambda i: samples[i][2])
        print(f"peak of the node-by-node run: {samples[top][2] / MiB:.1f} MiB after node {samples[top][0]} "
              f"({samples[top][1]})")
        for i, (name, kind, used) in enumerate(samples):
            print(f"{i:5d}  {used / MiB:9.1f} MiB  {kind:14s} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
