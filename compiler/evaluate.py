"""Compile a forward-only evaluation graph over a training step's flat parameters.

Note [evaluation graph]: evaluation runs ``fn(model, batch)`` (the loss, or
anything else of the model and a batch) with the model in eval mode and no
gradients. It is traced by `compiler.ir.trace.trace_forward` over the SAME flat
parameters as the training step it belongs to, so the rank's `TrainState`
(shardlang.step.state, Note [one state, many graphs]) feeds it unchanged: its
inputs are the state's parameter storage (FLAT) and buffers (BUFFER), then the
batch. There is no optimizer state, step count or hyperparameter input,
because nothing is updated; eval-mode BatchNorm reads its running statistics
and writes nothing, so no buffer is mutated either.

Only the passes that place parameters run (`EVAL_PASSES`): each sharded unit
is gathered before its first use and freed after its last, as in the
training forward, and gathers are prefetched as deep as the training step's.
Nothing is re-gathered (there is no backward), nothing is reduced, and the
BatchNorm statistics need no all-reduce in eval mode. `compiler.schedule.verify` checks
exactly that on a schedule marked ``options["evaluate"]``.

Example::

    compiled = compile_step(model, loss_fn, config, optimizer, batch)
    evaluation = compile_eval(model, loss_fn, compiled.flats, compiled.context.config, batch)
    print(evaluation.schedule)        # gathers, waits, frees and forward compute only
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .compile import CompiledStep, structural_check
from .context import CompileContext
from .layout.flat import FlatParam
from .passes.gather_parameters import gather_parameters
from .passes.prefetch_gathers import prefetch_gathers
from .passes.reshard_after_forward import reshard_after_forward
from .passes.pipeline import run_passes
from .config import StepConfig
from .schedule.schedule import read_schedule
from .ir.shapes import propagate_shapes, remember_shapes
from .ir.trace import trace_forward
from .placement.step import tensor_parallel_step
from .schedule.verify import verify

EVAL_PASSES = (gather_parameters, reshard_after_forward, prefetch_gathers, propagate_shapes)


def compile_eval(model: torch.nn.Module, fn: Callable, flats: tuple[FlatParam, ...], config: StepConfig,
                 example_batch, *, check_each_pass: bool = False, dump_dir=None) -> CompiledStep:
    """The evaluation graph of ``fn(model, batch)`` over ``flats``, for the training step's ``config``
    (Note [evaluation graph]).

    ``flats`` are the training step's (`CompiledStep.flats`), so the graph
    reads the same shards, on ``config.mesh``, prefetched as deep; ``example_batch``
    is a per-rank batch, whose shapes are compiled in. The result is a
    `CompiledStep` whose ``traced.output_spec`` rebuilds what ``fn`` returned.
    """
    traced = trace_forward(model, fn, _logical(flats, config), example_batch)
    if config.tensor is not None:
        traced = tensor_parallel_step(traced, config.tensor)
    ctx = CompileContext(config, flats, traced.inputs, evaluate=True)
    check = structural_check if check_each_pass else None
    remember_shapes(traced.graph_module)  # Note [incremental shapes]: only the gathers and their readers re-run
    gm = run_passes(traced.graph_module, ctx, EVAL_PASSES, check=check, dump_dir=dump_dir)
    schedule = read_schedule(gm, ctx)
    verify(schedule)
    return CompiledStep(gm, ctx, schedule, traced)


def _logical(flats: tuple[FlatParam, ...], config: StepConfig) -> tuple[FlatParam, ...]:
    """The step's flats at the members' logical shapes (Note [tp-local flats]); ``flats`` without a tensor axis."""
    if config.tensor is None:
        return flats
    logical = {f.name: f for f in config.logical_flats()}
    return tuple(logical[f.name] for f in flats)
