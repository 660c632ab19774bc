"""Tensor parallelism: shardlang against FSDP2 + TP and DTensor TP alone, side by side, in one run.

Run from the repository root::

    python -m benchmarks.tensor_parallel                        # 30M Llama, 4 ranks: 2x2 and 1x4
    python -m benchmarks.tensor_parallel --meshes 2x2 --steps 3 --out docs/benchmarks/tp

Every mode trains the same Llama (``examples/llama.py``'s model at a 30M shape, float32)
from the same seed on the same batches, on 4 local CPU ranks over gloo, one torch
thread each. At each mesh ``FxT`` (F data ranks, T tensor ranks):

- ``shardlang``: ``Mesh(fsdp=F, tp=T)`` with Megatron's placements as per-axis layouts
  (docs/tensor_parallel.md) and ZeRO-3 over fsdp, one unit per layer;
- ``fsdp2+tp``: ``parallelize_module`` with torchtitan's Llama plan without sequence
  parallelism, then ``fully_shard`` per layer and on the root over the data mesh
  (at F = 1 that is DTensor TP alone: ``dtensor-tp``), ``torch.optim.AdamW``;
- with ``--sequence-parallel`` and ``--loss-parallel``, also ``shardlang+sp`` and
  ``shardlang+lp``: ``shardlang`` with ``Options(sequence_parallel=True)`` or
  ``Options(loss_parallel=True)``, each with its measured saving of peak memory
  against ``shardlang`` beside the saving its plan predicts.

Each rank first runs one eager step of the plain model (Note [one-time
allocations]), then builds the modes. The modes' steps are interleaved (Note [side
by side] in `benchmarks.modes`): each measured step runs every mode once, in a
rotating order. Reported per mode: the median step time over ranks' medians, the
peak of memory in use above the rank's baseline (`probes.memory_in_use`, Note
[memory in use]), and the loss of the last step; for shardlang also its plan's peak. Writes ``results.json`` and ``results.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from examples.llama import Llama, LlamaConfig, loss_fn, make_tokens
from shardlang.runtime.launcher import WorkerPool
from shardlang.step.batch import split_batch

from .probes import StepProbe, give_memory_back, memory_in_use

CONFIG_30M = LlamaConfig(vocab_size=8192, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1408,
                         max_seq_len=256)
GLOBAL_BATCH = 8


@dataclasses.dataclass(frozen=True)
class Setting:
    data: int
    tensor: int
    warmup: int
    steps: int
    seq: int
    variants: tuple[str, ...] = ()  # of `VARIANTS`

    @property
    def modes(self) -> tuple[str, ...]:
        return ("shardlang", "fsdp2+tp" if self.data > 1 else "dtensor-tp") + self.variants

    @property
    def planned(self) -> tuple[str, ...]:
        """The modes with a plan to set beside the measure."""
        return tuple(m for m in self.modes if m in PLANNED)

    def batch(self, k: int, rank: int) -> torch.Tensor:
        tokens = make_tokens(k, GLOBAL_BATCH, self.seq, CONFIG_30M.vocab_size)
        return split_batch(tokens, self.data, rank // self.tensor)  # ranks of one tp group take the same rows


def _model() -> Llama:
    torch.manual_seed(0)
    return Llama(dataclasses.replace(CONFIG_30M, max_seq_len=CONFIG_30M.max_seq_len))


class _Shardlang:
    def __init__(self, setting: Setting, ctx, example, options: dict | None = None):
        import shardlang as sl

        col, row = (sl.shard("tp", dim=0), sl.shard("fsdp")), (sl.shard("tp", dim=1), sl.shard("fsdp"))
        spec = sl.Spec(sl.Mesh(fsdp=setting.data, tp=setting.tensor),
                       rules=[("*.attention.w[qkv].weight", col), ("*.attention.wo.weight", row),
                              ("*.feed_forward.w[13].weight", col), ("*.feed_forward.w2.weight", row),
                              ("output.weight", col), ("*", sl.shard("fsdp"))],
                       units=["tok_embeddings", "layers.*", "output"],
                       options=sl.Options(**(options or {})))
        self.step = sl.compile(_model(), loss_fn, spec, optimizer=sl.AdamW(lr=1e-3), example_batch=example,
                               dist_context=ctx)

    def __call__(self, batch):
        return self.step(batch)


class _TorchTitan:
    """torchtitan's Llama plan (``parallelize_llama`` without sequence or loss parallelism), then FSDP2."""

    def __init__(self, setting: Setting, ctx, example):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        from torch.distributed.tensor import Replicate

        mesh = init_device_mesh("cpu", (setting.data, setting.tensor), mesh_dim_names=("dp", "tp"))
        model = _model()
        parallelize_module(model, mesh["tp"], {"output": ColwiseParallel(output_layouts=Replicate())})
        for layer in model.layers:
            parallelize_module(layer, mesh["tp"], {
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
            })
            # the modules read heads from their sizes: a tp rank holds n_heads / tp of them
            layer.attention.n_heads //= setting.tensor
            layer.attention.n_kv_heads //= setting.tensor
        if setting.data > 1:
            for layer in model.layers:
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def __call__(self, batch):
        return _eager_step(self.model, self.optimizer, batch)


def _eager_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    loss.backward()
    optimizer.step()
    return loss.detach()


VARIANTS = {"shardlang+sp": {"sequence_parallel": True}, "shardlang+lp": {"loss_parallel": True}}
BUILDERS = {"shardlang": _Shardlang, "fsdp2+tp": _TorchTitan, "dtensor-tp": _TorchTitan,
            **{mode: functools.partial(_Shardlang, options=options) for mode, options in VARIANTS.items()}}
PLANNED = ("shardlang", *VARIANTS)  # the modes that have a plan


def _prime(setting: Setting, rank: int) -> None:
    """One eager step of the plain model on this rank's rows and one collective, before any mode is built.

    Note [one-time allocations]: a process's first matmuls, softmaxes and collectives
    fill native caches (the CPU kernels' scratch, gloo's buffers) that stay for the
    life of the process. Built first, a mode would carry them in its ``state``: at
    2x2 about 29 MiB, whichever mode comes first. After this step every mode's
    figures are the same in either build order.
    """
    model = _model()
    _eager_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), setting.batch(0, rank))
    dist.all_reduce(torch.zeros(1))
    del model
    gc.collect()


def run_rank(ctx, setting: Setting) -> dict:
    """One rank: build every mode, interleave the measured steps, then one probed step each for the peak."""
    torch.set_num_threads(1)
    trainers, records = {}, {}
    _prime(setting, ctx.rank)
    for mode in setting.modes:
        gc.collect()
        before = memory_in_use()
        trainers[mode] = BUILDERS[mode](setting, ctx, setting.batch(0, ctx.rank))
        for k in range(setting.warmup):
            float(trainers[mode](setting.batch(k, ctx.rank)))
        gc.collect()
        records[mode] = {"state": memory_in_use() - before, "times": []}
    for k in range(setting.steps):
        shift = k % len(setting.modes)
        for mode in setting.modes[shift:] + setting.modes[:shift]:
            dist.barrier()
            started = time.perf_counter()
            float(trainers[mode](setting.batch(setting.warmup + k, ctx.rank)))
            records[mode]["times"].append(time.perf_counter() - started)
    for mode in setting.modes:
        gc.collect()
        dist.barrier()
        start = memory_in_use()
        with StepProbe() as probe:
            records[mode]["loss"] = float(trainers[mode](setting.batch(setting.warmup + setting.steps, ctx.rank)))
        records[mode]["peak"] = records[mode]["state"] + probe.peak - start
    for mode in setting.planned:  # the plan beside the measure
        records[mode]["plan_peak"] = trainers[mode].step.compiled.memory.peak
    del trainers
    gc.collect()
    give_memory_back()
    return records


def _summary(setting: Setting, ranks: list[dict]) -> dict:
    out = {}
    for mode in setting.modes:
        out[mode] = {"step_s": statistics.median(statistics.median(r[mode]["times"]) for r in ranks),
                     "peak_mib": max(r[mode]["peak"] for r in ranks) / 2**20,
                     "state_mib": max(r[mode]["state"] for r in ranks) / 2**20,
                     "loss": ranks[0][mode]["loss"]}
    for mode in setting.planned:
        errors = [(r[mode]["plan_peak"] - r[mode]["peak"]) / r[mode]["peak"] for r in ranks]
        out[mode]["plan_peak_mib"] = max(r[mode]["plan_peak"] for r in ranks) / 2**20
        out[mode]["plan_error"] = [min(errors), max(errors)]  # (plan - measured) / measured, over ranks
    for mode in setting.variants:  # what the option saves against plain shardlang, measured and planned
        out[mode]["measured_saving_mib"] = out["shardlang"]["peak_mib"] - out[mode]["peak_mib"]
        out[mode]["planned_saving_mib"] = out["shardlang"]["plan_peak_mib"] - out[mode]["plan_peak_mib"]
    peer = setting.modes[1]
    out["ratios"] = {"step_time": out["shardlang"]["step_s"] / out[peer]["step_s"],
                     "peak_memory": out["shardlang"]["peak_mib"] / out[peer]["peak_mib"]}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tensor_parallel", description=__doc__.split("\n")[0])
    parser.add_argument("--meshes", default="2x2,1x4", help="data x tensor ranks, comma-separated (default 2x2,1x4)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq", type=int, default=CONFIG_30M.max_seq_len, help="tokens per sequence (default 256)")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="also shardlang with Options(sequence_parallel=True)")
    parser.add_argument("--loss-parallel", action="store_true", help="also shardlang with Options(loss_parallel=True)")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/tp"))
    args = parser.parse_args(argv)
    results = {"model": dataclasses.asdict(CONFIG_30M), "global_batch": GLOBAL_BATCH, "seq": args.seq,
               "params": sum(p.numel() for p in _model().parameters()), "meshes": {}}
    for mesh in args.meshes.split(","):
        data, tensor = (int(x) for x in mesh.split("x"))
        variants = (("shardlang+sp",) if args.sequence_parallel else ()) + (
            ("shardlang+lp",) if args.loss_parallel else ())
        setting = Setting(data, tensor, args.warmup, args.steps, args.seq, variants)
        pool = WorkerPool(data * tensor, threads=1, timeout=3600)
        try:
            from benchmarks.tensor_parallel import run_rank as job  # by module name, not __main__: ranks import it
            ranks = pool.run(job, setting)
        finally:
            pool.close()
        results["meshes"][mesh] = _summary(setting, ranks)
        print(mesh, json.dumps(results["meshes"][mesh]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "results.md").write_text(_markdown(results))
    print(_markdown(results))
    return 0


def _markdown(results: dict) -> str:
    lines = [f"Llama {results['params'] / 1e6:.1f}M parameters, global batch {results['global_batch']} x "
             f"{results['seq']} tokens, float32, 4 CPU ranks over gloo", "",
             "| mesh (data x tp) | mode | step (s) | peak memory per rank (MiB) | loss |", "|---|---|---|---|---|"]
    for mesh, row in results["meshes"].items():
        for mode, r in row.items():
            if mode != "ratios":
                lines.append(f"| {mesh} | {mode} | {r['step_s']:.3f} | {r['peak_mib']:.1f} | {r['loss']:.4f} |")
        ratios = row["ratios"]
        lines.append(f"| {mesh} | shardlang / peer | {ratios['step_time']:.2f}x | {ratios['peak_memory']:.2f}x | |")
    lines.append("")
    for mesh, row in results["meshes"].items():
        for mode in [m for m in PLANNED if m in row]:
            low, high = (100 * e for e in row[mode]["plan_error"])
            lines.append(f"{mesh}: {mode}'s plan peak {row[mode]['plan_peak_mib']:.1f} MiB, "
                         f"{low:+.1f}% to {high:+.1f}% of the measured peak over ranks")
        for mode in [m for m in VARIANTS if m in row]:
            lines.append(f"{mesh}: {mode} saves {row[mode]['measured_saving_mib']:.1f} MiB of peak measured, "
                         f"{row[mode]['planned_saving_mib']:.1f} MiB planned")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
