"""Sharded evaluation: a forward-only graph over the training step's own state.

`Evaluation` is one bound evaluation graph (Note [evaluation graph] in
`compiler.evaluate`): for one function of (model, batch) and one per-rank
batch shape, it gathers each unit before use and frees it after, as the
training forward does, with no gradients, no reductions and no optimizer. It
reads the `TrainState` of the step it belongs to (Note [one state, many
graphs]): the same parameter storage and buffers, passed by reference, never
copied, so evaluating after k steps sees exactly the parameters of step k.

A `Step` makes them on demand (`Step.evaluation`, `Step.evaluate`) and keeps
one per (function, batch shape). Every rank must evaluate alike: the first
evaluation of a function and shape compiles and compares its schedule across
ranks, as the training step does.

Example::

    step = sl.compile(model, loss_fn, spec, example_batch=batch)
    step(batch)                                            # a training step
    val = step.evaluate(val_batch)                         # the loss, model.eval(), no gradients
    logits = step.evaluate(val_batch, fn=lambda m, b: m(b[:, :-1]))   # or any outputs
    print(step.evaluation(val_batch).schedule)             # gathers and frees, forward only
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch.utils import _pytree as pytree

from .batch import batch_leaves
from ..compiler import CompiledStep, Schedule, compile_eval
from ..errors import ShardlangRuntimeError
from ..runtime.dist import DistContext
from .state import TrainState


class Evaluation:
    """One bound evaluation graph over a `TrainState`; call it with a per-rank batch.

    It returns what the evaluated function returns on this rank's batch (for a
    mean-reduced loss, the mean over this rank's rows; the global mean is the
    mean over ranks when every rank has as many rows).

    Example::

        evaluation = step.evaluation(val_batch)
        evaluation.schedule.summary.collectives     # {'all_gather': ..., 'reduce_scatter': 0, 'all_reduce': 0}
        loss = evaluation(val_batch)
    """

    def __init__(self, compiled: CompiledStep, state: TrainState, ctx: DistContext,
                 bind: Callable[[CompiledStep], torch.fx.GraphModule]):
        self.compiled = compiled
        self.state = state
        self.dist = ctx
        if ctx.has_process_group:
            from .step import _check_same_schedule  # one check for every graph a step runs

            _check_same_schedule(compiled.schedule, ctx)
        self._graph = bind(compiled)  # on the step's own process groups (its gathers' axes are among them)

    @property
    def schedule(self) -> Schedule:
        """The evaluation schedule: gathers, waits, frees and forward compute."""
        return self.compiled.schedule

    @property
    def graph(self) -> torch.fx.GraphModule:
        """The bound graph this rank runs."""
        return self._graph

    def graph_inputs(self, batch) -> list:
        """The graph's arguments: the state's parameter storage and buffers (the same tensors), then the batch."""
        leaves = batch_leaves(batch, self.compiled.traced.batch_shapes, self.dist.device)
        return [*self.state.flat_tensors, *self.state.buffers, *leaves]

    def __call__(self, batch):
        with torch.no_grad():
            outputs = self._graph(*self.graph_inputs(batch))
        return pytree.tree_unflatten(list(outputs), self.compiled.traced.output_spec)


def structure_of(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta device: its structure, no storage.

    Tracing needs only the modules, the names and the shapes (the values come
    from the state), and keeping the user's module would keep its full weights
    alive after `compile`. Tied parameters stay tied (one meta tensor for one
    original).

    Example::

        skeleton = structure_of(model)
        next(skeleton.parameters()).is_meta    # True
    """
    memo: dict[int, torch.Tensor] = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


class Evaluations:
    """A step's evaluation graphs, compiled on first use, one per (function, per-rank batch shape).

    ``module`` gives the model's structure only (`structure_of`): parameters and buffers come from the state.
    """

    def __init__(self, module: torch.nn.Module, loss_fn: Callable | None, training: CompiledStep):
        self.module = module
        self.loss_fn = loss_fn
        self.training = training
        self._bound: dict[tuple, Evaluation] = {}

    def has(self, batch, fn: Callable | None) -> bool:
        """Whether the graph for ``fn`` and ``batch``'s shapes is compiled."""
        return self._key(batch, fn or self.loss_fn) in self._bound

    def get(self, batch, fn: Callable | None, state: TrainState, ctx: DistContext,
            bind: Callable[[CompiledStep], torch.fx.GraphModule]) -> Evaluation:
        """The bound graph for ``fn`` (default: the loss) and ``batch``'s shapes, compiled on first use.

        ``bind`` is the step's (`Step._bind`): its process groups, mesh coordinate and collective lowering.
        """
        fn = fn or self.loss_fn
        if fn is None:
            raise ShardlangRuntimeError("this step was made without a loss function; pass evaluate(batch, fn=...) "
                                        "with fn(model, batch) returning what to compute")
        key = self._key(batch, fn)
        evaluation = self._bound.get(key)
        if evaluation is None:
            context = self.training.context
            compiled = compile_eval(self.module, fn, context.flats, context.config, batch)
            evaluation = self._bound[key] = Evaluation(compiled, state, ctx, bind)
        return evaluation

    @staticmethod
    def _key(batch, fn: Callable | None) -> tuple:
        """One graph per function object and per-rank batch structure, shapes and dtypes."""
        leaves, spec = pytree.tree_flatten(batch)
        return (fn, spec, tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t)
                                for t in leaves))
