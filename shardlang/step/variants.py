"""Batches of other shapes: one compiled graph per per-rank batch shape, all bound to one `TrainState`.

A traced graph has its batch's shapes baked in (make_fx records every view and
expand with concrete sizes). Real data varies: a last partial batch, padding
to the longest sequence of each batch, ranks whose batches differ in length in
the same step. A `Step` therefore keeps one *variant* per distinct per-rank
batch signature (the batch's structure and each leaf's shape and dtype),
compiled on first sight by a `Recipe` that repeats the first compilation with
the new example batch, and bound to the same state (Note [one state, many
graphs] in `shardlang.step.state`).

Note [same collectives for every shape]: every variant on every rank must issue
the same collectives in the same order, or ranks holding different shapes in
the same step would hang. The schedule's collectives do not depend on the
batch (Note [collectives do not depend on the batch] in `compiler.schedule.schedule`),
provided everything that chooses them is fixed: the resolved spec, the
optimizer, the training features, and the recompute policies and prefetch
depth (a memory budget's search picks them from the first shape's peak;
variants keep them rather than search again). Ranks compare the first variant's collectives at
start-up; each later variant is compared on its own rank with the first one
(no collective, so ranks that compile at different steps cannot deadlock), and
a difference is an error before the variant runs.

Example::

    step = sl.compile(model, loss_fn, spec, example_batch=tokens[:, :33])
    step(tokens[:, :33]); step(tokens[:, :17])       # compiles a second graph, same shards and optimizer
    step.batch_shapes                                 # [((8, 33), torch.int64), ...], one entry per variant
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import attrs
import torch
from torch.utils import _pytree as pytree

from ..compiler import CompiledStep, TensorShape
from ..errors import ShardlangRuntimeError

#: Distinct batch shapes a step compiles before `ShapeWarning` (torch.compile's cache_size_limit is also 8).
DEFAULT_SHAPE_LIMIT = 8


class ShapeWarning(UserWarning):
    """A step compiled more distinct batch shapes than its limit: pad or bucket the shapes to compile less."""


LeafShapes = tuple[tuple[tuple[int, ...], torch.dtype], ...]


@attrs.frozen
class BatchSignature:
    """What a compiled graph fixes of a batch: its pytree structure and each leaf's shape and dtype.

    Example: ``BatchSignature.of((x, y)).leaves == (((8, 16), torch.float32), ((8, 4), torch.float32))``.
    """

    structure: str
    leaves: LeafShapes

    @classmethod
    def of(cls, batch) -> BatchSignature:
        leaves, spec = pytree.tree_flatten(batch)
        for index, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                raise ShardlangRuntimeError(
                    f"batch leaf {index} is a {type(leaf).__name__}; every leaf of a batch must be a tensor"
                )
        return cls(_structure(spec), tuple((tuple(t.shape), t.dtype) for t in leaves))

    def shapes(self) -> str:
        """The leaves' shapes as text, e.g. ``(8, 33)`` or ``(8, 16) (8, 4)``."""
        return " ".join(str(shape) for shape, _ in self.leaves)


@attrs.frozen
class Recipe:
    """Everything a compilation read, kept to compile another batch shape identically.

    ``compile_at(config, batch=...)`` runs `compiler.compile.compile_step`
    with the same module (which may hold no storage by then: tracing is fake,
    the buffers' shapes stand in for the buffers, and the tied parameters are
    the ones recorded at the first compilation, since moving a module to the
    meta device unties them), loss, resolved spec,
    optimizer, training features and mixed precision. The recompute policies
    and the prefetch depth are those the first compilation settled on (Note
    [same collectives for every shape]).
    """

    model: torch.nn.Module
    loss_fn: Callable
    resolved: object  # shardlang.spec.spec.ResolvedSpec
    optimizer: object
    compile_at: Callable[..., CompiledStep]
    buffers: dict[str, TensorShape]
    tied: dict[str, str]
    dump_dir: str | None = None

    def compile(self, example_batch, first, variant: int) -> CompiledStep:
        """``example_batch``'s step, with ``first``'s (a `CompileContext`) configuration: its recompute policies
        and prefetch depth included."""
        dump = str(Path(self.dump_dir) / f"variant{variant}") if self.dump_dir else None
        return self.compile_at(first.config, batch=example_batch, buffers=self.buffers, tied=self.tied,
                               dump_dir=dump)


class Variants:
    """The graphs of one step by batch signature: the first, and those compiled since.

    ``bind(compiled)`` turns a compiled variant into the graph this rank runs.
    """

    def __init__(self, first: CompiledStep, bound: torch.fx.GraphModule, recipe: Recipe | None,
                 bind: Callable[[CompiledStep], torch.fx.GraphModule], limit: int = DEFAULT_SHAPE_LIMIT):
        self.first = first
        self.recipe = recipe
        self.limit = limit
        self._bind = bind
        self._by_signature: dict[BatchSignature, tuple[CompiledStep, torch.fx.GraphModule]] = {
            signature_of(first): (first, bound)
        }

    @property
    def first_graph(self) -> torch.fx.GraphModule:
        """The bound graph of the first compiled shape."""
        return self._by_signature[signature_of(self.first)][1]

    @first_graph.setter
    def first_graph(self, graph: torch.fx.GraphModule) -> None:
        self._by_signature[signature_of(self.first)] = (self.first, graph)

    def __len__(self) -> int:
        return len(self._by_signature)

    @property
    def signatures(self) -> list[BatchSignature]:
        return list(self._by_signature)

    def get(self, batch) -> tuple[CompiledStep, torch.fx.GraphModule]:
        """The compiled variant and bound graph for ``batch``, compiling it on first sight."""
        signature = BatchSignature.of(batch)
        found = self._by_signature.get(signature)
        if found is not None:
            return found
        self._check_structure(signature)
        compiled = self.recipe.compile(batch, self.first.context, len(self))
        self._check_collectives(compiled, signature)
        found = self._by_signature[signature] = (compiled, self._bind(compiled))
        if len(self) > self.limit:
            shown = ", ".join(s.shapes() for s in self._by_signature)
            warnings.warn(ShapeWarning(
                f"the step has compiled {len(self)} batch shapes (limit {self.limit}): {shown}; each costs a "
                "compilation and a graph. Pad or bucket the shapes (e.g. sequence lengths to a multiple of 64), "
                "or raise the limit with sl.compile(..., shape_limit=N)"), stacklevel=3)
        return found

    def _check_structure(self, signature: BatchSignature) -> None:
        first = signature_of(self.first)
        if signature.structure != first.structure or len(signature.leaves) != len(first.leaves):
            raise ShardlangRuntimeError(
                f"the batch has structure {signature.structure} with {len(signature.leaves)} tensors; the step was "
                f"compiled for {first.structure} with {len(first.leaves)} (batches may change shape, not structure)"
            )
        for index, ((shape, dtype), (first_shape, first_dtype)) in enumerate(zip(signature.leaves, first.leaves)):
            if dtype != first_dtype or len(shape) != len(first_shape):
                raise ShardlangRuntimeError(
                    f"batch leaf {index} has shape {shape}, {dtype}; the step was compiled for {first_shape}, "
                    f"{first_dtype}: a batch may change its sizes, not its dtype or number of dims"
                )
        if self.recipe is None:
            raise ShardlangRuntimeError(
                f"the batch has shape {signature.shapes()}; this step was compiled for {first.shapes()} only and "
                "cannot compile another (it was built without a recipe; use sl.compile)"
            )

    def _check_collectives(self, compiled: CompiledStep, signature: BatchSignature) -> None:
        """Note [same collectives for every shape]: a variant must issue the first variant's collectives."""
        mine, first = compiled.schedule.collective_sequence(), self.first.schedule.collective_sequence()
        if mine == first:
            return
        index = next((i for i, (a, b) in enumerate(zip(mine, first)) if a != b), min(len(mine), len(first)))
        shown = lambda seq: str(seq[index]) if index < len(seq) else "nothing"  # noqa: E731
        raise ShardlangRuntimeError(
            f"the step for batch shape {signature.shapes()} would issue different collectives than the one for "
            f"{signature_of(self.first).shapes()} (collective {index}: {shown(mine)} instead of {shown(first)}), "
            "so ranks holding these shapes would hang; make the collectives independent of the batch shape"
        )


def signature_of(compiled: CompiledStep) -> BatchSignature:
    """The batch signature a compiled step was traced for."""
    return BatchSignature(_structure(compiled.traced.batch_spec), compiled.traced.batch_shapes)


def _structure(spec: pytree.TreeSpec) -> str:
    return " ".join(str(spec).split())  # one line: TreeSpec's text wraps
