"""Worker functions for test_memory_plan.py: measure a real step's memory on the CPU, node by node.

The measure is glibc's ``mallinfo2``: the bytes malloc has handed out and not
yet taken back, summed over every arena, so it sees allocations and frees made
on any thread (gloo's included; torch.profiler's memory events miss the frees
made on gloo's threads). The bound graph runs under a `torch.fx.Interpreter`
that frees values after their last use, as the generated code does, and samples
right after each node has run, while that node's inputs are still held: the
moment the static plan calls "during" the node (Note [liveness] in
`compiler/analysis/memory.py`).

Bytes are measured relative to a baseline taken just before the graph runs,
when only its inputs are live; the inputs' own bytes are added back, so a
sample is "everything the step holds", the plan's quantity. Allocator overhead
(chunk headers, alignment, tensor objects) is in the measure and not in the
plan; it is small next to the tensors, and the test's tolerance covers it.
"""

from __future__ import annotations

import ctypes
import gc
import time

import torch
import torch.fx as fx

from shardlang import api
from shardlang.compiler.lower import emit
from shardlang.cli.common import rank_batch
from shardlang.cli.job import build, load_job


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _Mallinfo2


def malloc_in_use() -> int:
    """Bytes in use by malloc across every arena and mmapped chunk (glibc >= 2.33)."""
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd


WAIT = torch.ops._c10d_functional.wait_tensor.default
SETTLE_S = 0.002


class _Sampler(fx.Interpreter):
    """Runs the graph, sampling malloc's bytes in use right after each node.

    After a wait the sampler sleeps `SETTLE_S`: gloo's thread wakes the waiter
    before it drops the finished collective's buffers, and on a loaded machine
    it may not run again for a while; the pause lets it finish, so a sample
    after a wait sees what the wait released (as the plan assumes) rather than
    how busy the machine was.
    """

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm, garbage_collect_values=True)
        self.samples: list[tuple[str, int]] = []

    def run_node(self, n: fx.Node):
        result = super().run_node(n)
        if n.target is WAIT:
            time.sleep(SETTLE_S)
        self.samples.append((n.name, malloc_in_use()))
        return result


def measure_job(ctx, path: str, warmup: int = 1, spec_file: str | None = None) -> dict:
    """Compile ``path``'s job (under ``spec_file``'s spec, if given) on this rank, run ``warmup`` steps, then
    measure one step node by node.

    Returns ``{"samples": [(node, bytes), ...], "input_bytes": int, "seconds": {...}}``; ``input_bytes`` counts the
    step's buffer pool with its inputs (held between steps, Note [buffer assignment]).
    """
    started = time.perf_counter()
    torch.manual_seed(0)
    job = load_job(path, spec_file)
    model = build(job, 0)
    batch = rank_batch(job, 0, ctx.world_size, ctx.rank)  # ranks of one tp group take the same rows
    step = api.compile(model, job.loss_fn, job.spec, optimizer=job.optimizer, example_batch=batch, dist_context=ctx)
    del model
    compiled = time.perf_counter()
    for _ in range(warmup):  # lazy initialisation (gloo buffers, thread pools) happens here, not in the sample
        step(batch)
    inputs = step.graph_inputs(batch)
    input_bytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in inputs}.values())
    pool = emit.buffer_pool(step.graph)  # held since the warm-up, so in the baseline: state, as the plan counts it
    input_bytes += pool.nbytes if pool is not None else 0
    sampler = _Sampler(step.graph)
    gc.collect()
    _libc.malloc_trim(0)
    base = malloc_in_use()
    with torch.no_grad():
        sampler.run(*inputs)
    samples = [(name, nbytes - base + input_bytes) for name, nbytes in sampler.samples]
    seconds = {"compile": compiled - started, "measure": time.perf_counter() - compiled}
    return {"samples": samples, "input_bytes": input_bytes, "seconds": seconds}
