"""How a bound step graph runs: node by node (eager), or compiled by inductor.

The compiler's output is one aten graph with its collectives bound to process
groups (`compiler.lower.emit`). ``StepBackend.EAGER`` runs it as fx's generated Python,
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

Note [inductor keeps the schedule]: the schedule places each collective's
issue and wait so that communication overlaps compute (prefetch, the
reduce-scatter's wait after the next unit's backward), and the memory plan's
peak follows from that order. Two of inductor's default passes undo it. On the
benchmark's tiny GPT at N = 2 (collectives and matmuls in the generated code's
order), the schedule's ``AG w AG w AG m m m m w ... RS AG w m ... w RS w RS w``
became ``AG w AG w m m m m AG w ... RS w AG w m ... RS w RS w`` (the
peak-memory pass: each gather issued just before its wait), and with only that
pass off ``AG AG AG w w ... RS m RS w w w`` (the locality pass: every
reduce-scatter's wait at the end of the backward). With both off
(`_KEEP_THE_SCHEDULE`) it is the schedule's order, ``AG w AG w AG m m m m w ...
RS AG w m ... w RS m w RS w``; tests/test_inductor.py checks that no collective
has fewer matmuls under it than scheduled. What inductor still changes: it fuses
the optimizer updates of all flats into one kernel after the last wait, so each
reduction's received blocks live until then (more memory than the plan counts
for the eager graph, not more exposed communication).

The step's 0-d arithmetic (the optimizer's bias corrections from the step
count and the learning rate) runs eagerly before the compiled graph, which
takes its results as inputs (`step_scalars`, Note [step scalars before
inductor]): inlined into the update's kernel it cost two ``std::pow`` per
vector of 8 elements. On the CPU, log-softmax and its backward stay aten's
calls (Note [log-softmax stays aten]).

Caches: inductor's FX graph cache is on (torch's default, kept on here), so the
second process that compiles the same graph on the same machine loads the
kernels instead of building them. It keys on a shape environment that only a
tracing context provides, so `compile_graph` makes one (before, every compile
bypassed the cache: ``fxgraph_cache_bypass``, 'No shape env'). AOTAutograd's own
cache still bypasses our graphs (their ``unpack_member`` calls are not torch ops);
it only saves the functionalisation trace, seconds. They live under
``TORCHINDUCTOR_CACHE_DIR`` (default ``/tmp/torchinductor_<user>``).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence

import attrs
import torch
import torch.fx as fx

from shardlang.errors import CompileError
from shardlang.spec.vocabulary import StepBackend
from .step_scalars import StepScalars, split_step_scalars


#: Inductor settings that keep the compiled step in the schedule's order (Note [inductor keeps the schedule]).
_KEEP_THE_SCHEDULE = {
    # The peak-memory pass picks, among topological orders, the one of least estimated peak:
    # it issues each all-gather just before its wait and waits for each reduce-scatter at once,
    # so that no collective overlaps any compute. The schedule's order already has the peak the
    # memory plan computed; keep it.
    "reorder_for_peak_memory": False,
    # The post-grad locality pass moves producers down to their consumers: with it on, every
    # reduce-scatter's wait moved to the end of the backward.
    "reorder_for_locality": False,
}


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
    from torch._guards import TracingContext, tracing
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    hits_before = counters["inductor"]["fxgraph_cache_hit"]
    started = time.perf_counter()
    # compile_fx rewrites the graph it is given; the step keeps its own for inspection.
    # Inductor's FX graph cache needs a shape environment to key on, which only a tracing context
    # (dynamo's, normally) provides: without one every compile bypasses the cache. Static shapes.
    # The step's 0-d arithmetic runs eagerly before the compiled graph (Note [step scalars before inductor]).
    split = split_step_scalars(gm, example_inputs)
    inputs = list(example_inputs)
    if split is not None:
        gm = split.graph_module
        with torch.no_grad():
            inputs += split.prologue(*split.scalar_inputs(example_inputs))
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    with torch.no_grad(), tracing(TracingContext(fake_mode)), \
            config.patch({**_KEEP_THE_SCHEDULE, "fallback_random": True, "fx_graph_cache": True}):
        fakes = [fake_mode.from_tensor(t, static_shapes=True) for t in inputs]
        compiled = compile_fx(copy.deepcopy(gm), fakes, decompositions=decompositions(kept_aten_ops(inputs)))
    elapsed = time.perf_counter() - started
    run = compiled if split is None else _with_prologue(compiled, split)
    return CompiledRunner(backend, run, elapsed, counters["inductor"]["fxgraph_cache_hit"] > hits_before)


#: Ops inductor calls as aten's on the CPU instead of decomposing them (Note [log-softmax stays aten]).
_NOT_DECOMPOSED = ("aten::_log_softmax", "aten::_log_softmax_backward_data")


def kept_aten_ops(inputs: Sequence[torch.Tensor]) -> tuple[str, ...]:
    """The ops that stay aten's for a step on these inputs: log-softmax on the CPU, none elsewhere.

    Note [log-softmax stays aten] was measured on the CPU's C++ kernels only; on a GPU inductor's
    Triton kernel for the decomposed log-softmax is the one torchtitan users get, so it stays.
    Example: ``kept_aten_ops([torch.zeros(2)]) == _NOT_DECOMPOSED``.
    """
    on_cpu = all(t.device.type == "cpu" for t in inputs if isinstance(t, torch.Tensor))
    return _NOT_DECOMPOSED if on_cpu else ()


class _Decompositions(dict):
    """A decomposition table that pickles as the call that builds it.

    Inductor's FX graph cache pickles a table passed to ``compile_fx`` into its key; some of inductor's
    own decompositions are pybind functions, which do not pickle, and the cache would be bypassed. The
    table is a function of the torch version, which the key holds already, and of ``kept``.
    """

    kept: tuple[str, ...] = ()

    def __reduce__(self):
        return decompositions, (self.kept,)


def decompositions(kept: tuple[str, ...]) -> dict:
    """Inductor's decompositions, less those of the ops named in ``kept`` (Note [log-softmax stays aten]).

    Note [log-softmax stays aten]: decomposed, a language model's log-softmax over the vocabulary and its
    backward became one C++ kernel that reads the logits three times and evaluates ``exp`` twice per
    element: 36 to 42 ms CPU on the 10M GPT at N = 1, against 12 to 18 ms for aten's ``_log_softmax``
    and ``_log_softmax_backward_data``, which inductor now calls as they are (its fallback). The price is a
    logits-sized buffer of log-probabilities that the fused kernel never wrote: the compiled peak at 10M rose
    by 15 to 17 MiB (to eager's). Example::

        compile_fx(gm, fakes, decompositions=decompositions(kept_aten_ops(inputs)))
    """
    from torch._inductor.decomposition import select_decomp_table

    table = _Decompositions({op: fn for op, fn in select_decomp_table().items() if op.name() not in kept})
    table.kept = tuple(kept)
    return table


def _with_prologue(compiled: Callable, split: StepScalars) -> Callable:
    prologue, indices = split.prologue, split.scalar_indices

    def run(*inputs):
        with torch.no_grad():
            extra = prologue(*(inputs[i] for i in indices))
        return compiled(*inputs, *extra)

    return run

