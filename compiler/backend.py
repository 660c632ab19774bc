"""How a bound step graph runs: node by node (eager), or compiled by inductor.

The compiler's output is one aten graph with its collectives bound to process
groups (`compiler.emit`). ``StepBackend.EAGER`` runs it as fx's generated Python,
one aten call per node. ``StepBackend.INDUCTOR`` hands the same graph to
``torch._inductor.compile_fx``: inductor's AOT pass functionalises it, fuses the
elementwise and reduction compute into a few C++ (CPU) or Triton (GPU) kernels,
and keeps the ``_c10d_functional`` collectives and their waits as the graph
orders them (torchtitan's SimpleFSDP route: the collectives are part of the
graph that is compiled, not hooks around it). Nothing upstream changes: the
schedule, the memory plan and the bytes are the same program's.

Note [inductor and the step's effects]: the step mutates its inputs (the
optimizer updates the shards and their state, the step count and BatchNorm's
buffers in place). AOT functionalisation turns each mutation into a pure op plus
a ``copy_`` back into the input at the end of the graph, which inductor fuses
into the kernel that computes the new value, so the update stays in place. The
``free`` nodes do nothing when traced and vanish: inductor plans the memory of
its own buffers, freeing each after its last use. Random ops run through
inductor's fallback to the aten ops (``fallback_random``), so they draw from
the same generator, in the same order, as the eager graph (`random_state`).

Caches: inductor's FX graph cache and AOTAutograd cache are on (torch's
defaults, kept on here), so the second process that compiles the same graph on
the same machine loads the kernels instead of building them. They live under
``TORCHINDUCTOR_CACHE_DIR`` (default ``/tmp/torchinductor_<user>``).
"""

from __future__ import annotations

import copy
import enum
import time
from collections.abc import Callable, Sequence

import attrs
import torch
import torch.fx as fx

from .errors import CompileError


class StepBackend(enum.Enum):
    """What runs the bound step graph. Example: ``StepBackend("inductor")``."""

    EAGER = "eager"
    INDUCTOR = "inductor"


@attrs.frozen
class CompiledRunner:
    """The step graph compiled by a backend, and how long compiling took.

    ``run(*inputs)`` takes the graph's inputs in placeholder order and returns
    what the graph returns. ``compile_s`` is the wall time of `compile_graph`
    (0 for eager); ``cache_hit`` whether inductor loaded the graph from its
    FX graph cache instead of building it (None for eager).

    Example::

        runner = compile_graph(bound, StepBackend.INDUCTOR, inputs)
        loss = runner.run(*inputs)
        runner.compile_s
    """

    backend: StepBackend
    run: Callable
    compile_s: float = 0.0
    cache_hit: bool | None = None


def compile_graph(gm: fx.GraphModule, backend: StepBackend, example_inputs: Sequence[torch.Tensor]) -> CompiledRunner:
    """``gm`` ready to run under ``backend`` (Note [inductor and the step's effects]).

    ``example_inputs`` are the real inputs of a step (their shapes, strides and
    dtypes are compiled in; inductor reads them as fake tensors and does not
    change them). ``gm`` itself is left as it is.
    """
    if backend is StepBackend.EAGER:
        return CompiledRunner(backend, gm)
    if backend is not StepBackend.INDUCTOR:
        raise CompileError(f"unknown step backend {backend!r}; valid: {[b.value for b in StepBackend]}")
    from torch._dynamo.utils import counters
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx

    hits_before = counters["inductor"]["fxgraph_cache_hit"]
    started = time.perf_counter()
    # compile_fx rewrites the graph it is given; the step keeps its own for inspection.
    with torch.no_grad(), config.patch(fallback_random=True, fx_graph_cache=True):
        compiled = compile_fx(copy.deepcopy(gm), list(example_inputs))
    elapsed = time.perf_counter() - started
    return CompiledRunner(backend, compiled, elapsed, counters["inductor"]["fxgraph_cache_hit"] > hits_before)
