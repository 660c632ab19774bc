"""The training state a rank holds between steps, apart from the graphs that read it.

Note [one state, many graphs]: a `TrainState` is the only holder of a rank's
trained bytes: its parameter storage for every flat parameter (a shard, or
the whole under ZeRO-1/DDP), the optimizer state of the trainable ones, the
update count, the hyperparameter inputs (lr) and the module's buffers. Every
graph a step binds (the training step, and graphs for other batch shapes or
for evaluation) reads and mutates these same tensors in place, in the order of
`compiler.ir.trace` (FLAT, STATE, STEP, HYPER, BUFFER). Nothing else keeps a
copy: checkpoints read and write the state here, and the user's module is not
a second holder: `compile` moves it to meta (Note [the step owns the state] in
`shardlang.step.ownership`; docs/architecture.md, "Who holds which bytes").

Note [initialisation]: `TrainState.from_module` cuts this rank's shards from a
module that holds full values. Every rank builds the same model (same seed),
so parameters start equal to what one process would have, which is what the
parity tests rely on. A model on the meta device holds no values:
`shardlang.step.materialize` builds its state one unit at a time instead, and
hands the flat tensors to `TrainState.fresh` (Note [materialisation]).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..compiler import CompiledStep, FlatParam, hyper_tensors, init_state, shard_of


def shard_coordinate(compiled: CompiledStep, rank: int) -> Callable[[FlatParam], int]:
    """Which shard of a flat parameter ``rank`` holds: its coordinate on the flat's axis (0 when it holds the whole).

    Example: on ``Mesh(fsdp=4)`` rank 2 holds shard 2 of every ZeRO-3 flat parameter.
    """
    coordinate = compiled.context.world_mesh.coordinate(rank)
    return lambda flat: coordinate[flat.axis] if flat.params_sharded else 0


def tensor_local(compiled: CompiledStep, rank: int) -> Callable[[dict], dict]:
    """Logical parameter values by name -> the blocks ``rank`` holds on the tensor axis (the same without one).

    The flats of a step with a tensor axis hold tp-local blocks (Note [tp-local flats]); their
    shards are cut from these blocks as from whole parameters on a mesh of data axes alone.
    """
    config = compiled.context.config
    if config.tensor is None:
        return lambda values: values
    axis = config.tensor
    at = config.world_mesh.coordinate(rank)[axis.name]
    params = {p.name for p in config.params}  # buffers pass through whole
    return lambda values: {name: axis.local_block(name, v, at) if name in params else v
                           for name, v in values.items()}


def optimizer_slice(compiled: CompiledStep, rank: int) -> Callable[[FlatParam, torch.Tensor], torch.Tensor]:
    """The part of ``rank``'s parameter tensor for a flat parameter that its optimizer updates.

    The whole tensor, except under ZeRO-1, where the rank holds the whole flat
    parameter and updates one slice of it (Note [whole-flat shards]).
    """
    coordinate = compiled.context.world_mesh.coordinate(rank)

    def slice_of(flat: FlatParam, held: torch.Tensor) -> torch.Tensor:
        if flat.sharded and not flat.params_sharded:
            c = flat.shard_numel
            return held.narrow(0, coordinate[flat.axis] * c, c)
        return held

    return slice_of


class TrainState:
    """One rank's parameter storage, optimizer state, step count, hyperparameters and buffers.

    Example::

        state = TrainState.from_module(compiled, model, coordinate, torch.device("cpu"))
        state.graph_inputs()     # the leading arguments of every graph bound to this state
    """

    def __init__(self, flat_tensors: list[torch.Tensor], optimizer_state: list[torch.Tensor],
                 step_count: torch.Tensor, hyper: dict[str, torch.Tensor], buffers: list[torch.Tensor],
                 buffer_names: list[str]):
        self.flat_tensors = flat_tensors
        self.optimizer_state = optimizer_state
        self.step_count = step_count
        self.hyper = hyper
        self.buffers = buffers
        self.buffer_names = buffer_names

    @classmethod
    def from_module(cls, compiled: CompiledStep, model: torch.nn.Module, coordinate: Callable[[FlatParam], int],
                    device: torch.device, optimizer_shard: Callable[[FlatParam, torch.Tensor], torch.Tensor],
                    rank: int = 0) -> TrainState:
        """Cut this rank's state from ``model``'s full parameters and buffers (Note [initialisation]).

        ``coordinate(flat)`` is which shard of ``flat`` this rank holds;
        ``optimizer_shard(flat, held)`` the part of the held storage its
        optimizer updates (under ZeRO-1 a slice of the whole). ``rank`` places the
        tensor axis's blocks (`tensor_local`).
        """
        named = tensor_local(compiled, rank)(dict(model.named_parameters()))
        flats = [shard_of(f, named, coordinate(f)).to(device).clone() for f in compiled.flats]
        buffers = [b.detach().clone().to(device) for b in model.buffers()]
        return cls.fresh(compiled, flats, buffers, [n for n, _ in model.named_buffers()], device, optimizer_shard)

    @classmethod
    def fresh(cls, compiled: CompiledStep, flat_tensors: list[torch.Tensor], buffers: list[torch.Tensor],
              buffer_names: list[str], device: torch.device,
              optimizer_shard: Callable[[FlatParam, torch.Tensor], torch.Tensor]) -> TrainState:
        """A state at step 0 around parameter storage and buffers already on ``device``: zero optimizer state."""
        optimizer = compiled.traced.optimizer
        optimizer_state = [s for f, t in zip(compiled.flats, flat_tensors) if f.trainable
                           for s in init_state(optimizer, optimizer_shard(f, t), f)]
        step_count = torch.zeros((), dtype=torch.float64, device=device)
        hyper = {k: v.to(device) for k, v in hyper_tensors(optimizer).items()}
        return cls(flat_tensors, optimizer_state, step_count, hyper, buffers, buffer_names)

    def graph_inputs(self) -> list[torch.Tensor]:
        """The state's tensors in graph-input order (FLAT, STATE, STEP, HYPER, BUFFER); the batch follows."""
        return [*self.flat_tensors, *self.optimizer_state, self.step_count, *self.hyper.values(), *self.buffers]

    @property
    def nbytes(self) -> int:
        """The bytes this rank's state holds."""
        return sum(t.numel() * t.element_size() for t in self.graph_inputs())
