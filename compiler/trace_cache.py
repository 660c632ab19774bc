"""Traced steps shared by the configurations of one model that trace the same step.

Note [shared traces]: of a `StepConfig`, tracing reads only the logical flat
parameters (their names, units, dtypes, mixed precision, trainability,
parameter group, and their members' names, logical shapes, dtypes, units and
trainability), the data-parallel size (training-mode BatchNorm is traced
synchronised over it), the training features, and the tensor axis (its name,
degree, placements, sequence and loss parallelism). The strategy, the split of
the data mesh, the sharding layout, prefetch and recompute come after the
trace, in the passes. `shardlang tune` compiles dozens of layouts at one tp
degree that differ only there (every strategy over every mesh split): at 70B
on a 2-D mesh, the trace is a third of a layout's first compile. A
`TraceCache` serves them one trace: `compile_step(traces=...)` looks the
configuration up by `trace_key` and traces only on a miss. Entries hold their
model, so an id in a key is never another model's. A trace served again
starts a new shape memo (Note [shape memo]): the last configuration's memo
holds the values of its own local sizes, which another mesh split or strategy
seldom asks for, and kept across dozens of layouts it grew a 70B tune
worker from 1 GB to 4.6 GB.

Example::

    traces = TraceCache()
    for config in configs:   # the same model and batch, other strategies and mesh splits
        compile_step(model, loss_fn, config, optimizer, batch, traces=traces)
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping

import attrs
import torch
import torch.utils._pytree as pytree

from .config import StepConfig
from .ir.shapes import drop_shape_memo
from .ir.trace import TracedStep


@attrs.define
class TraceCache:
    """The ``size`` traced steps last used, by `trace_key` (Note [shared traces])."""

    size: int = 3  # a 70B 2-D trace holds about 100 MB: a tp degree's unit granularities
    _entries: collections.OrderedDict = attrs.field(factory=collections.OrderedDict, init=False)
    hits: int = attrs.field(default=0, init=False)

    def traced(self, key: tuple, model: torch.nn.Module, trace: Callable[[], TracedStep]) -> TracedStep:
        """The trace under ``key``, traced by ``trace()`` on a miss."""
        if key in self._entries:
            self._entries.move_to_end(key)
            self.hits += 1
            traced = self._entries[key][1]
            drop_shape_memo(traced.graph_module)  # Note [shared traces]: the last configuration's local values
            return traced
        traced = trace()
        self._entries[key] = (model, traced)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return traced


def trace_key(model: torch.nn.Module, loss_fn, config: StepConfig, flats, optimizer, batch,
              buffers: Mapping | None, tied: Mapping[str, str] | None) -> tuple:
    """What the trace of ``config``'s step over its logical ``flats`` reads (Note [shared traces]): equal keys
    trace equal steps."""
    tensor = config.tensor
    return (
        id(model), id(loss_fn), repr(optimizer), config.mesh.size, repr(config.training),
        tuple((f.name, f.unit, f.dtype, f.param_dtype, f.reduce_dtype, f.trainable, f.group,
               tuple((m.info.name, m.info.shape, m.info.dtype, m.info.unit, m.info.trainable) for m in f.members))
              for f in flats),
        None if tensor is None else (tensor.name, tensor.size, tuple(sorted((k, repr(v)) for k, v in
                                                                           tensor.placements.items())),
                                     tensor.sequence_parallel, tensor.loss_parallel),
        tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else repr(x)
              for x in pytree.tree_leaves(batch)),
        str(pytree.tree_structure(batch)),
        None if buffers is None else tuple(sorted((k, repr(v)) for k, v in buffers.items())),
        None if tied is None else tuple(sorted(tied.items())),
    )
