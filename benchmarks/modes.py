"""The systems compared, and the job each rank runs: build every mode, train them side by side, probe.

Every mode trains the same GPT (``examples/gpt.py``) from the same seed, on the
same global batches (``make_tokens(step)``, split over ranks in rank order), with
AdamW at the same hyperparameters:

- ``single``: one process, the plain model and ``torch.optim.AdamW``; the reference.
- ``shardlang``: full sharding (ZeRO-3): every parameter sharded flat, one unit per
  transformer block plus the root unit (embeddings, final LayerNorm, tied head).
- ``shardlang-zero2``, ``shardlang-zero1``, ``shardlang-ddp``: the same units under
  shardlang's other strategies (`shardlang.spec.strategy`): parameters kept from forward
  to backward; whole parameters with sharded optimizer state; nothing sharded.
  At N = 1 every strategy is the same program, so only ``shardlang`` runs there.
- ``shardlang-inductor``: ``shardlang`` with ``Options(backend="inductor")``: the
  whole step (forward, backward, optimizer, collectives) compiled by inductor.
- ``fsdp2``: ``fully_shard`` on each transformer block and on the root, defaults.
- ``fsdp2-compile``: torchtitan's way: ``torch.compile`` on each transformer block
  (in place, ``block.compile()``), then ``fully_shard`` as ``fsdp2``; the optimizer stays eager.
- ``ddp``: ``DistributedDataParallel``, defaults.

Note [side by side]: a run is one (model size, world size, backend) with every
mode in the same N processes. Each rank builds the modes one after the other and
trains each ``warmup`` steps; then come ``steps`` timed rounds, each running one
step of every mode (after a barrier, so that ranks start together) in an order
that rotates from round to round. Other load on the machine then falls on every
mode alike, which matters on a shared two-core machine. Last, each mode runs one
instrumented step under `probes.StepProbe` (collectives and memory; not timed).
The loss a mode reports is that last step's: the loss of the parameters after
every step before it, the same number of updates in every mode.

Note [memory per mode]: memory in use is additive over objects, so a mode's
share is measured while the others are resident: ``state`` is what building it
and its warm-up steps left in use (parameters, optimizer state, buckets, caches:
what it keeps between steps), and ``peak`` is ``state`` plus the highest rise
above the in-use level at the start of its instrumented step. At least one
warm-up step is run, so that state created lazily by the first step (torch's
AdamW moments, DDP's rebuilt buckets) is in ``state``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from unittest import mock

import torch
import torch.distributed as dist

from examples.gpt import GPTConfig, lm_loss, make_gpt, make_tokens
from shardlang.step.batch import split_batch
from shardlang.runtime.dist import Backend, DistContext

from .probes import StepProbe, bytes_written, give_memory_back, memory_in_use

MODES = ("single", "shardlang", "shardlang-zero2", "shardlang-zero1", "shardlang-ddp", "shardlang-inductor",
         "fsdp2", "fsdp2-compile", "ddp")
STRATEGIES = {"shardlang": "ZeRO3", "shardlang-zero2": "ZeRO2", "shardlang-zero1": "ZeRO1", "shardlang-ddp": "DDP",
              "shardlang-inductor": "ZeRO3"}
INDUCTOR_MODES = ("shardlang-inductor",)
SHARDLANG_MODES = tuple(STRATEGIES)
PEER_MODES = ("fsdp2", "fsdp2-compile", "ddp")
GLOO, FAKE = "gloo", "fake"


@dataclasses.dataclass(frozen=True)
class ModelSize:
    """A GPT size and setting for the benchmark: ``GPTConfig`` fields, the sequence length trained on, and
    ``per_rank_batch``: sequences per rank (the latency-heavy setting), or None: the run's global batch split
    over the ranks (the throughput setting)."""

    name: str
    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    seq_len: int
    per_rank_batch: int | None = None

    def global_batch(self, default: int, world: int) -> int:
        """Sequences per step over all ranks: ``per_rank_batch * world``, or ``default`` split over the ranks."""
        return default if self.per_rank_batch is None else self.per_rank_batch * world

    def config(self) -> GPTConfig:
        return GPTConfig(vocab_size=self.vocab_size, block_size=self.seq_len, n_layer=self.n_layer,
                         n_head=self.n_head, n_embd=self.n_embd)

    def build(self) -> torch.nn.Module:
        return make_gpt(**dataclasses.asdict(self.config()))


_10M = {"n_layer": 6, "n_embd": 320, "n_head": 5, "vocab_size": 8192}
_100M = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 16384}
SIZES = {
    "tiny": ModelSize("tiny", n_layer=2, n_embd=64, n_head=2, vocab_size=64, seq_len=32),
    "10M": ModelSize("10M", **_10M, seq_len=64),
    "100M": ModelSize("100M", **_100M, seq_len=64),
    # The latency-heavy setting: one 128-token sequence per rank, so the step is short and fixed costs weigh.
    "10M-latency": ModelSize("10M-latency", **_10M, seq_len=128, per_rank_batch=1),
    "100M-latency": ModelSize("100M-latency", **_100M, seq_len=128, per_rank_batch=1),
}


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run (Note [side by side]); plain data, sent to every rank."""

    size: ModelSize
    modes: tuple[str, ...]
    world: int
    backend: str = GLOO
    warmup: int = 2
    steps: int = 3
    global_batch: int = 8
    lr: float = 1e-3
    weight_decay: float = 0.01
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or self.warmup < 1 or self.steps < 1:
            raise ValueError(f"RunSpec: modes {unknown} are not in {MODES}, or warmup={self.warmup} < 1, "
                             f"or steps={self.steps} < 1")

    @property
    def label(self) -> str:
        return f"{self.size.name} N={self.world}" + (" (fake backend)" if self.backend == FAKE else "")

    def batches(self, rank: int) -> list[torch.Tensor]:
        """This rank's batch of every step: the rows of the global batch it owns."""
        s = self.size
        batch = s.global_batch(self.global_batch, self.world)
        return [split_batch(make_tokens(k, batch, s.seq_len, s.vocab_size), self.world, rank)
                for k in range(self.warmup + self.steps + 1)]


class TorchTrainer:
    """A plain PyTorch step: forward, loss, backward, ``AdamW.step``, ``zero_grad(set_to_none=True)``."""

    def __init__(self, module: torch.nn.Module, params, spec: RunSpec):
        self.module = module
        self.optimizer = torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay)

    def step(self, batch: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(self.module, batch)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def extra(self) -> dict:
        return {}


class ShardlangTrainer:
    """A compiled shardlang step; ``extra`` reports its schedule's predicted bytes."""

    def __init__(self, model: torch.nn.Module, mode: str, spec: RunSpec, ctx: DistContext, example: torch.Tensor):
        import shardlang as sl

        options = sl.Options(backend="inductor" if mode in INDUCTOR_MODES else "eager")
        sl_spec = sl.Spec(sl.Mesh(fsdp=-1), rules=[("*", sl.shard("fsdp"))], units=["blocks.*"],
                          strategies=[("*", getattr(sl, STRATEGIES[mode]))], options=options)
        # The fake backend's collectives return no data, so the start-up comparison of schedule
        # digests across ranks (an all_gather_object) cannot run there: skip it, and only there.
        # Nor can the step watch record its progress in the fake backend's store (FakeStore has no set):
        # it gets no store there, as in a world of one.
        fake = contextlib.ExitStack()
        if spec.backend == FAKE:
            fake.enter_context(mock.patch("shardlang.step.step._check_same_schedule"))
            fake.enter_context(mock.patch("shardlang.runtime.watch.dist.distributed_c10d._get_default_store",
                                          return_value=None))
        started = time.perf_counter()
        with fake:
            self.step_fn = sl.compile(model, lm_loss, sl_spec, example_batch=example, dist_context=ctx,
                                      optimizer=sl.AdamW(lr=spec.lr, weight_decay=spec.weight_decay))
        self.compile_s = time.perf_counter() - started

    def step(self, batch: torch.Tensor) -> torch.Tensor:
        return self.step_fn(batch)

    def extra(self) -> dict:
        schedule = self.step_fn.schedule
        summary = schedule.summary
        m = sum(f.padded_bytes for f in schedule.flats if f.sharded or f.trainable)
        return {"compile_s": self.compile_s, "backend_compile_s": self.step_fn.backend_compile_s,
                "backend_cache_hit": self.step_fn.backend_cache_hit,
                "schedule_payload": dict(summary.bytes_per_rank),
                "schedule_collectives": dict(summary.collectives), "M_padded": m}


def build_trainer(mode: str, spec: RunSpec, ctx: DistContext, example: torch.Tensor):
    """The mode's trainer on this rank, built from the seeded full model (every rank builds the same)."""
    torch.manual_seed(spec.seed)
    model = spec.size.build()
    if mode == "single":
        return TorchTrainer(model, model.parameters(), spec)
    if mode in SHARDLANG_MODES:
        return ShardlangTrainer(model, mode, spec, ctx, example)
    if mode in ("fsdp2", "fsdp2-compile"):
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            if mode == "fsdp2-compile":  # torchtitan: compile each block, then shard it
                block.compile()
            fully_shard(block)
        fully_shard(model)
        return TorchTrainer(model, model.parameters(), spec)
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model)
        if spec.backend == FAKE:
            # The fake backend's all-reduce completes with no tensor, which DDP's reducer rejects;
            # a hook that hands the bucket back unreduced stands in for the no-op collective.
            ddp.register_comm_hook(None, _no_op_hook)
        return TorchTrainer(ddp, model.parameters(), spec)
    raise ValueError(f"unknown mode {mode!r}; valid modes are {', '.join(MODES)}")


def _no_op_hook(_state, bucket):  # no return annotation: DDP checks it, and ours would be a string
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


# A fake run swaps the pool's gloo group out and back in over the pool's own store (loopback only).
_swapped_stores: list[dist.Store] = []
_restored = [0]


def _join_group(spec: RunSpec, ctx: DistContext) -> tuple[DistContext, bool]:
    """The context shardlang runs in, and whether this job created a process group to destroy after.

    gloo runs use the pool's group. A world of one has none: shardlang runs without
    one, and FSDP2 and DDP get a gloo group of one. Fake runs replace the pool's
    group with the fake backend's, and `_leave_group` gives the gloo one back.
    """
    if spec.backend == FAKE and spec.world > 1:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        _swapped_stores.append(dist.distributed_c10d._get_default_store())  # the pool's, to rejoin after
        dist.destroy_process_group()
        dist.init_process_group(FAKE, store=FakeStore(), rank=ctx.rank, world_size=spec.world)
        return DistContext(ctx.rank, spec.world, ctx.rank, Backend.GLOO, "cpu"), False
    if spec.world == 1 and any(m in PEER_MODES for m in spec.modes):
        dist.init_process_group(GLOO, store=dist.HashStore(), rank=0, world_size=1)
        return ctx, True
    return ctx, False


def _leave_group(spec: RunSpec, ctx: DistContext, own_group: bool) -> None:
    """Undo `_join_group`: destroy a group of one, or replace the fake group by a fresh gloo one."""
    if own_group:
        dist.destroy_process_group()
    if spec.backend == FAKE and spec.world > 1:
        dist.destroy_process_group()
        store = _swapped_stores.pop()
        _restored[0] += 1  # the same count on every rank: each swap rejoins under keys of its own
        dist.init_process_group(GLOO, store=dist.PrefixStore(f"restored-{_restored[0]}/", store), rank=ctx.rank,
                                world_size=spec.world)


def _barrier(spec: RunSpec) -> None:
    if dist.is_initialized() and spec.world > 1:
        dist.barrier()


def run_rank(ctx: DistContext, spec: RunSpec) -> dict[str, dict]:
    """One rank's part of a run (Note [side by side]): plain data per mode back to the parent."""
    torch.set_num_threads(1)
    ctx, own_group = _join_group(spec, ctx)
    batches = spec.batches(ctx.rank)
    trainers, records = {}, {}
    for mode in spec.modes:
        gc.collect()
        before = memory_in_use()
        started = time.perf_counter()
        trainers[mode] = build_trainer(mode, spec, ctx, batches[0])
        build_s = time.perf_counter() - started
        first_step_s = 0.0
        for batch in batches[: spec.warmup]:
            started = time.perf_counter()
            float(trainers[mode].step(batch))
            first_step_s = first_step_s or time.perf_counter() - started  # torch.compile compiles here
        gc.collect()
        records[mode] = {"rank": ctx.rank, "build_s": build_s, "first_step_s": first_step_s,
                         "state": memory_in_use() - before, "times": [], "cpu": [], "wire": []}
    for k, batch in enumerate(batches[spec.warmup : spec.warmup + spec.steps]):
        shift = k % len(spec.modes)
        for mode in spec.modes[shift:] + spec.modes[:shift]:
            record = records[mode]
            _barrier(spec)
            t0, c0, w0 = time.perf_counter(), time.process_time(), bytes_written()
            float(trainers[mode].step(batch))
            record["times"].append(time.perf_counter() - t0)
            record["cpu"].append(time.process_time() - c0)
            record["wire"].append(bytes_written() - w0)
    for mode in spec.modes:
        record = records[mode]
        gc.collect()
        _barrier(spec)
        start = memory_in_use()
        with StepProbe() as probe:
            record["loss"] = float(trainers[mode].step(batches[-1]))
        record.update(peak=record["state"] + probe.peak - start, counts=dict(probe.counts),
                      payload=dict(probe.payload), **trainers[mode].extra())
    del trainers
    _leave_group(spec, ctx, own_group)
    gc.collect()
    give_memory_back()
    return records
