"""The compiled step a rank runs: the bound graph over this rank's `TrainState`.

The state (shards, optimizer state, step count, lr inputs, buffers) lives in
`shardlang.step.state` (Note [one state, many graphs]); the step binds the compiled
graph to this rank's process groups and runs it on that state.
"""

from __future__ import annotations

import contextlib
import math
import datetime
import numbers

import torch
import torch.distributed as dist

from .batch import batch_leaves
from ..compiler import (
    CompiledStep, Schedule, StepBackend, WORLD_AXIS, bind, compile_graph, group_keys, hyper_name, local_shard,
    norm_flat_order, unpack_member,
)
from ..errors import ShardlangRuntimeError, SpecError
from .evaluate import Evaluation, Evaluations, structure_of
from .lr import LRSchedule
from .ownership import reclaim
from .random_state import StepRandom
from ..runtime.dist import Backend, DistContext
from ..runtime.dist import check_timeout
from ..runtime.groups import mesh_groups
from ..runtime.watch import StepWatch
from .state import TrainState, optimizer_slice, shard_coordinate
from ..checkpoint.state_dict import ModelNames
from .variants import DEFAULT_SHAPE_LIMIT, Recipe, Variants


class Step:
    """One rank's sharded training step. Call it with the per-rank batch; it returns the local loss.

    Example::

        step = sl.compile(model, loss_fn, spec, optimizer=sl.AdamW(lr=3e-4), example_batch=batch)
        print(step.schedule)
        loss = step(batch)
    """

    def __init__(self, compiled: CompiledStep, model: torch.nn.Module | None, optimizer, ctx: DistContext,
                 lr_schedule=None, state: TrainState | None = None, spec=None, timeout_s: float | None = None,
                 recipe: Recipe | None = None, shape_limit: int = DEFAULT_SHAPE_LIMIT,
                 loss_fn=None):
        self.compiled = compiled
        self.spec = spec  # for the record (checkpoints); the compiled step is what runs
        self.optimizer = optimizer
        self.dist = ctx
        self._check_world(ctx)
        if timeout_s is not None:
            check_timeout(timeout_s, "timeout")
        self._watch = StepWatch(ctx, compiled.schedule, timeout_s)  # before the first collective: see its docs
        if ctx.has_process_group:  # before making subgroups: different programs would hang there
            _check_same_schedule(compiled.schedule, ctx)
        self._groups = self._make_groups(ctx, timeout_s)
        # Note [one state, many graphs]: every batch shape's graph runs on self.state
        self.variants = Variants(compiled, self._bind(compiled), recipe, self._bind, limit=shape_limit)
        self.state = state or TrainState.from_module(compiled, model, self._coordinate, ctx.device,
                                                      self._optimizer_shard, rank=ctx.rank)
        self.names = (ModelNames.of(model) if model is not None
                      else ModelNames.of_flats(compiled.flats, self.state.buffer_names))
        self._runner = self._compile_backend(compiled, ctx)
        self.lr_schedule = LRSchedule(lr_schedule, self.lrs) if lr_schedule is not None else None
        self.random = StepRandom.for_step(self._graph, compiled.context.training, ctx.rank, ctx.device)
        self.grad_norm: torch.Tensor | None = None  # with clip_grad_norm: the last step's norm before clipping
        self._flat_sq_norms: torch.Tensor | None = None  # with skip_nonfinite: each flat's squared gradient norm
        self._skipped = torch.zeros((), dtype=torch.int64)  # steps skipped for a non-finite gradient norm
        if self.lr_schedule is not None:
            self._write_lrs(self.lr_schedule.lrs())
        self._evaluations = Evaluations(structure_of(model), loss_fn, compiled) if model is not None else None

    # The state's tensors, by the names the step has always had (Note [one state, many graphs]).
    @property
    def flat_tensors(self) -> list[torch.Tensor]:
        return self.state.flat_tensors

    @property
    def optimizer_state(self) -> list[torch.Tensor]:
        return self.state.optimizer_state

    @property
    def step_count(self) -> torch.Tensor:
        return self.state.step_count

    @property
    def hyper(self) -> dict[str, torch.Tensor]:
        return self.state.hyper

    @property
    def buffers(self) -> list[torch.Tensor]:
        return self.state.buffers

    @property
    def schedule(self) -> Schedule:
        return self.compiled.schedule

    def __call__(self, batch) -> torch.Tensor:
        compiled, graph = self.variants.get(batch)
        inputs = self._inputs(compiled, batch)
        self._watch.begin()
        # The backend compiled the example batch's graph; other batch shapes run eager.
        run = self._runner.run if self._runner.backend is not StepBackend.EAGER and graph is self._graph else graph
        with torch.no_grad(), self.random or contextlib.nullcontext():  # the graph holds its own backward
            try:
                loss = run(*inputs)
            except Exception as exc:  # a collective that timed out names the late rank and the op
                error = self._watch.explain(exc, graph)
                if error is None:
                    raise
                raise error from exc
        if isinstance(loss, tuple):  # clip_grad_norm: (loss, norm before clipping); skip_nonfinite: + per flat
            loss, self.grad_norm, *per_flat = loss
            if per_flat:
                self._flat_sq_norms = per_flat[0]
                self._skipped += (~torch.isfinite(self.grad_norm)).to(torch.int64).cpu()  # no sync on a GPU
        if self.lr_schedule is not None:
            self.lr_schedule.advance()
            self._write_lrs(self.lr_schedule.lrs())
        return loss

    def evaluate(self, batch, fn=None):
        """Evaluate on the per-rank ``batch``: the loss (or ``fn(model, batch)``), forward only, on this step's state.

        The model is in eval mode (BatchNorm uses its running statistics,
        dropout is off) and nothing is differentiated, reduced or updated;
        units are gathered and freed as in the training forward. ``fn`` returns
        a tensor or a tuple/list/dict of tensors, e.g. the logits. Every rank
        must call it alike (a collective). Example::

            val_loss = step.evaluate(val_batch)
        """
        return self.evaluation(batch, fn)(batch)

    def evaluation(self, batch, fn=None) -> Evaluation:
        """The bound evaluation graph for ``fn`` (default: the loss) and ``batch``'s shapes, compiled on first use.

        Its ``.schedule`` is the evaluation's plan. Example::

            print(step.evaluation(val_batch).schedule.summary_text())
        """
        if self._evaluations is None:
            raise ShardlangRuntimeError("this step was made from a TrainState without its module; evaluation "
                                        "needs the module's structure: make the step with sl.compile")
        return self._evaluations.get(batch, fn, self.state, self.dist, self._bind)

    def has_evaluation(self, batch, fn=None) -> bool:
        """Whether the evaluation graph for ``fn`` and ``batch``'s shapes is compiled already."""
        return self._evaluations is not None and self._evaluations.has(batch, fn)

    @property
    def _graph(self) -> torch.fx.GraphModule:
        """The bound graph of the first batch shape; profilers and benchmarks swap it for an instrumented one."""
        return self.variants.first_graph

    @_graph.setter
    def _graph(self, graph: torch.fx.GraphModule) -> None:
        self.variants.first_graph = graph

    @property
    def graph(self) -> torch.fx.GraphModule:
        """The bound graph this rank runs for the example batch's shape (collectives on real process groups)."""
        return self._graph

    @property
    def backend_compile_s(self) -> float:
        """Seconds the backend took to compile the bound graph (``Options(backend="inductor")``; 0 for eager)."""
        return self._runner.compile_s

    @property
    def backend_cache_hit(self) -> bool | None:
        """Whether inductor loaded the compiled step from its FX graph cache (None for eager)."""
        return self._runner.cache_hit

    @property
    def batch_shapes(self) -> list[tuple[tuple[tuple[int, ...], torch.dtype], ...]]:
        """The per-rank batch shapes compiled so far, one entry (each leaf's shape and dtype) per variant."""
        return [s.leaves for s in self.variants.signatures]

    def graph_for(self, batch) -> torch.fx.GraphModule:
        """The bound graph that runs ``batch`` (compiling it for a new shape, as a step would)."""
        return self.variants.get(batch)[1]

    def schedule_for(self, batch) -> Schedule:
        """The schedule of the graph that runs ``batch``: its collectives are the same for every shape."""
        return self.variants.get(batch)[0].schedule

    def graph_inputs(self, batch) -> list:
        """The bound graph's arguments for one step on the per-rank ``batch`` (for profilers and memory checks)."""
        return self._inputs(self.variants.get(batch)[0], batch)

    def _inputs(self, compiled: CompiledStep, batch) -> list:
        leaves = batch_leaves(batch, compiled.traced.batch_shapes, self.dist.device)
        return [*self.state.graph_inputs(), *leaves]

    def _bind(self, compiled: CompiledStep) -> torch.fx.GraphModule:
        """``compiled``'s graph on this rank's process groups and mesh coordinate."""
        names = ({key: group.group_name for key, group in self._groups.items()} if self.dist.has_process_group
                 else None)
        return bind(compiled.graph_module, names, self._mesh_coordinate(),
                    reduce_scatter_as_all_to_all=self.dist.backend is Backend.GLOO)

    def set_lr(self, lr: float, group: int | None = None) -> None:
        """Set the learning rate for the next steps (no retracing: lr is a graph input).

        ``group=None`` sets every parameter group's lr, as a loop over
        ``torch.optim``'s ``param_groups`` does; ``group=g`` only group g's (0:
        the parameters no ``param_groups`` rule matched; g >= 1: ``param_groups[g-1]``).
        """
        names = [n for n in self.lrs] if group is None else [hyper_name("lr", group)]
        if names[0] not in self.hyper:
            raise ShardlangRuntimeError(f"set_lr(group={group!r}): there are {len(self.lrs)} parameter groups, "
                                        f"0..{len(self.lrs) - 1}")
        if isinstance(lr, bool) or not isinstance(lr, numbers.Real) or not 0 <= lr < float("inf"):
            raise SpecError(f"set_lr(lr={lr!r}): a learning rate is a finite number >= 0, e.g. 3e-4")
        self._write_lrs({n: lr for n in names})

    @property
    def lrs(self) -> dict[str, float]:
        """Every parameter group's current learning rate, by graph input name (``lr``, ``lr/group1``, ...)."""
        return {k: float(v) for k, v in self.hyper.items() if k == "lr" or k.startswith("lr/")}

    def _write_lrs(self, lrs: dict[str, float]) -> None:
        for name, lr in lrs.items():
            self.hyper[name].fill_(float(lr))

    @property
    def steps_done(self) -> int:
        """Optimizer updates done (a step skipped by ``skip_nonfinite`` does not count, as in torch.optim)."""
        return int(self.step_count.item())

    @property
    def skipped_steps(self) -> int:
        """Steps whose update ``Options(skip_nonfinite=True)`` skipped for a non-finite gradient norm."""
        return int(self._skipped)

    def nonfinite_report(self, loss: torch.Tensor) -> str | None:
        """None when the last step's ``loss`` and gradient norm are finite; else what was not, and where.

        The gradient norm is known with ``clip_grad_norm`` or ``skip_nonfinite``; with
        ``skip_nonfinite`` the report names the first unit, in backward order (the order
        in which the gradients were made), whose gradient is inf or nan. Example::

            report = step.nonfinite_report(loss)
            # "loss nan; gradient norm nan, first in unit 'blocks.3' (backward order; 4 of 6 units);
            #  update skipped (1 so far)"
        """
        loss_ok = bool(torch.isfinite(loss.detach()).all())
        norm_ok = self.grad_norm is None or bool(torch.isfinite(self.grad_norm))
        if loss_ok and norm_ok:
            return None
        parts = [f"loss {float(loss.detach().reshape(-1)[0]):g}" if not loss_ok else "loss finite"]
        if self.grad_norm is not None:
            parts.append(f"gradient norm {float(self.grad_norm):g}" + self._nonfinite_units())
        if self.compiled.context.training.skip_nonfinite and not norm_ok:
            parts.append(f"update skipped ({self.skipped_steps} so far)")
        return "; ".join(parts)

    def _nonfinite_units(self) -> str:
        """``, first in unit 'u' (backward order; k of n units)`` from the per-flat squared norms."""
        if self._flat_sq_norms is None:
            return ""
        names = norm_flat_order(self.compiled.graph_module.graph)
        bad = [n for n, v in zip(names, self._flat_sq_norms.tolist()) if not math.isfinite(v)]
        units = list(dict.fromkeys(f.unit for f in self.compiled.flats if f.trainable))
        bad_units = list(dict.fromkeys(self.compiled.context.flat(n).unit for n in bad))
        if not bad_units:
            return ""
        first = max(bad_units, key=units.index)  # backward runs the units in reverse
        return f", first in unit {first!r} (backward order; {len(bad_units)} of {len(units)} units)"

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole, by name (a collective: call it on every rank)."""
        return self._gather_parameters(keep=True)

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The model's ``state_dict()``, whole, on CPU: parameters (tied names included) and buffers.

        A collective: call it on every rank. With ``rank0_only`` only rank 0
        keeps the tensors (one flat parameter gathered at a time): the shards
        are gathered to rank 0 alone, so the other ranks send theirs, hold
        nothing whole and get ``{}``; for models that fit on one rank. Example::

            sd = step.full_state_dict()
            if rank == 0:
                torch.save(sd, "model.pt")    # loads with model.load_state_dict(sd)
        """
        keep = self.dist.is_main or not rank0_only
        params = self._gather_parameters(keep=keep, to_main_only=rank0_only)
        if not keep:
            return {}
        out = {name: params[name].cpu() for name in self.names.parameters}
        out.update({alias: out[name] for alias, name in self.names.aliases.items()})
        buffers = self.full_buffers()
        out.update({name: buffers[name].detach().cpu().clone() for name in self.names.persistent_buffers})
        return out

    def _gather_parameters(self, keep: bool, to_main_only: bool = False) -> dict[str, torch.Tensor]:
        """Every parameter whole, by name, where ``keep``; with ``to_main_only`` the shards go to rank 0 alone.

        With a tensor axis every rank gathers its tp-local blocks whole over the data axes, and
        then the blocks over the tensor axis (``to_main_only`` does not spare the other ranks yet).
        """
        tensor = self.compiled.context.config.tensor
        if tensor is None:
            return self._gather_data_axes(keep, to_main_only)
        blocks = self._gather_data_axes(keep=True)
        group = self._groups.get(tensor.name)
        whole = {name: _gather_blocks(block, tensor.placement_of(name), tensor.size, group)
                 for name, block in blocks.items()}
        return whole if keep else {}

    def _gather_data_axes(self, keep: bool, to_main_only: bool = False) -> dict[str, torch.Tensor]:
        """Every parameter (its tp-local block, with a tensor axis) whole over the data axes, where ``keep``."""
        out = {}
        for flat, local in zip(self.compiled.flats, self.flat_tensors):
            if flat.params_sharded:
                group = self._groups.get(flat.axis)
                gathered = (_gather_to_main(local, flat.world, group, self.dist.is_main) if to_main_only
                            else _all_gather(local, flat.world, group))
            else:
                gathered = local
            if not keep:
                continue
            for m in flat.members:
                if flat.params_sharded:
                    full = unpack_member(gathered, m.world, m.offset, m.piece_numel, m.kind.value, m.dim,
                                         list(m.local_shape), list(m.info.shape))
                else:
                    full = local[m.offset : m.offset + m.info.numel].view(m.info.shape)
                out[m.name] = full.detach().clone()
        return out

    def full_buffers(self) -> dict[str, torch.Tensor]:
        """The module's buffers on this rank, by name."""
        return dict(zip(self.state.buffer_names, self.state.buffers))

    def load_into(self, model: torch.nn.Module) -> None:
        """Copy the trained parameters and buffers into ``model``, whole (a collective: call it on every rank).

        ``model`` may be the module given to `compile` (which holds meta tensors
        since, Note [the step owns the state]): it gets real storage on the
        step's device again and can be called. For models that fit on one rank.
        """
        params = self.full_parameters()
        reclaim(model, self.dist.device)
        buffers = self.full_buffers()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(params[name])
            for name, b in model.named_buffers():
                b.copy_(buffers[name])

    def save(self, path, *, data_position: int | None = None, data_state: dict | None = None):
        """Write a checkpoint of this rank's state to the directory ``path`` (a collective: every rank calls it).

        Every rank writes only its own shards; the directory appears only once complete
        (docs/checkpoints.md). ``data_position`` (default: the steps done) and ``data_state`` (a data
        loader's ``state_dict()``, kept as JSON) are given back by `load`.

        Example: ``step.save("ckpt/step-3", data_state=loader.state_dict())``.
        """
        from ..checkpoint import save

        return save(self, path, data_position=data_position, data_state=data_state)

    def save_async(self, path, *, data_position: int | None = None, checkpointer: str = "thread",
                   data_state: dict | None = None):
        """As `save`, but write in the background: returns an `AsyncSave` (``.wait()``); training may go on.

        The state is staged first (copied by DCP's stager, between steps), so later steps do not change
        what is written. ``checkpointer``: ``"thread"`` or ``"process"`` (docs/checkpoints.md).
        """
        from ..checkpoint import save_async

        return save_async(self, path, data_position=data_position, checkpointer=checkpointer, data_state=data_state)

    def load(self, path):
        """Read the checkpoint at ``path`` into this step's state (a collective), whatever layout wrote it.

        Returns a `shardlang.checkpoint.Restored` (``.steps``, ``.data_position``). Example::

            restored = step.load("ckpt/step-3")
            for k in range(restored.data_position, total): step(batch_for(k))
        """
        from ..checkpoint import load

        return load(self, path)

    def _compile_backend(self, compiled: CompiledStep, ctx: DistContext):
        """The bound graph compiled by ``Options.backend``; Note [one compile per machine].

        When every rank compiles the same graph, the ranks on one machine share
        inductor's cache, so the first local rank compiles alone while the others
        wait, and then they load its result from the cache instead of all
        building the same kernels at once on the same cores. The first rank
        reaches the barrier even when its compile fails, so nobody hangs. A graph
        that slices this rank's own shard (``local_shard``, bound to a narrow at
        this rank's offset) differs by rank and cannot come from another rank's
        cache entry: those ranks compile at once.
        """
        inputs = [*self.state.graph_inputs(), *_example_leaves(compiled, ctx.device)]
        backend = compiled.context.backend
        per_rank = any(n.target is local_shard for n in compiled.graph_module.graph.nodes)
        if backend is StepBackend.EAGER or not ctx.has_process_group or ctx.world_size == 1 or per_rank:
            return compile_graph(self._graph, backend, inputs)
        first = ctx.local_rank == 0
        if not first:
            dist.barrier()
        try:
            return compile_graph(self._graph, backend, inputs)
        finally:
            if first:
                dist.barrier()

    def _mesh_coordinate(self) -> dict[str, int]:
        """This rank's coordinate on each mesh axis (row-major over the axes in order)."""
        return self.compiled.context.world_mesh.coordinate(self.dist.rank)

    def _coordinate(self, flat) -> int:
        """Which shard of ``flat`` this rank holds (`state.shard_coordinate`)."""
        return shard_coordinate(self.compiled, self.dist.rank)(flat)

    def _optimizer_shard(self, flat, held: torch.Tensor) -> torch.Tensor:
        """The part of this rank's parameter tensor its optimizer updates (`state.optimizer_slice`)."""
        return optimizer_slice(self.compiled, self.dist.rank)(flat, held)

    def _check_world(self, ctx: DistContext) -> None:
        expected = self.compiled.context.world_mesh.size
        if ctx.world_size != expected:
            raise ShardlangRuntimeError(
                f"the step was compiled for a mesh of {expected} ranks but runs in a world of {ctx.world_size}"
            )

    def _make_groups(self, ctx: DistContext, timeout_s: float | None) -> dict:
        """This rank's process group for every group key the graph uses, and for every sharded flat's axis.

        With ``timeout_s`` (``sl.compile(timeout=)``) every one of them gets that collective timeout;
        otherwise subgroups get the world's (`DistContext.timeout_s`).
        """
        if not ctx.has_process_group:
            return {}
        config = self.compiled.context.config
        keys = [*group_keys(self.compiled.graph_module), WORLD_AXIS,
                *(f.axis for f in self.compiled.flats if f.params_sharded),
                *([config.tensor.name] if config.tensor is not None else [])]
        runtime = {key: config.runtime_group_key(key) for key in keys}  # the passes' "*": the data axes' ranks
        made = mesh_groups(config.world_mesh, list(runtime.values()), ctx.rank,
                           ctx.timeout_s if timeout_s is None else timeout_s)
        groups = {key: made[runtime[key]] for key in keys}
        if timeout_s is not None:
            for group in {id(g): g for g in groups.values()}.values():
                dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_s), group)
        return groups


def _example_leaves(compiled: CompiledStep, device: torch.device) -> list[torch.Tensor]:
    """Batch leaves of the compiled shapes, for a backend to compile against (their values are never read)."""
    return [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in compiled.traced.batch_shapes]


def _all_gather(local: torch.Tensor, world: int, group=None) -> torch.Tensor:
    if world == 1:
        return local
    out = local.new_empty(local.numel() * world)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    gather(out, local.contiguous(), group=group)
    return out


def _gather_blocks(block: torch.Tensor, placement, size: int, group) -> torch.Tensor:
    """A parameter whole from every tensor rank's ``block`` (itself when replicated on the tensor axis)."""
    if size == 1 or not hasattr(placement, "dim"):
        return block
    pieces = [torch.empty_like(block) for _ in range(size)]
    dist.all_gather(pieces, block.contiguous(), group=group)
    return torch.cat(pieces, dim=placement.dim)


def _gather_to_main(local: torch.Tensor, world: int, group, is_main: bool) -> torch.Tensor | None:
    """``local``'s flat gathered whole on rank 0 (None elsewhere): only rank 0's group gathers, to rank 0 alone.

    The other groups of a hybrid mesh hold replicas of the same shards, so they have nothing to send.
    """
    if world == 1:
        return local
    if 0 not in dist.get_process_group_ranks(group):  # every sharded flat's axis has a group (`_make_groups`)
        return None
    out = local.new_empty(local.numel() * world) if is_main else None
    pieces = list(out.view(world, -1).unbind(0)) if is_main else None
    dist.gather(local.contiguous(), pieces, dst=0, group=group)
    return out


def _check_same_schedule(schedule: Schedule, ctx: DistContext) -> None:
    """Every rank must issue the same collectives; a mismatch is an error now, not a hang later.

    Only the sequence of collectives is compared (`Schedule.collectives_digest`):
    ranks may hold batches of different shapes, which change compute, not
    collectives (Note [same collectives for every shape] in `shardlang.step.variants`).
    """
    digests: list = [None] * ctx.world_size
    dist.all_gather_object(digests, schedule.collectives_digest())
    groups: dict[str, list[int]] = {}
    for rank, digest in enumerate(digests):
        groups.setdefault(digest, []).append(rank)
    if len(groups) > 1:
        described = "; ".join(f"ranks {ranks} have schedule {d}" for d, ranks in groups.items())
        raise ShardlangRuntimeError(
            f"ranks compiled different collectives ({described}); every rank must compile the same model, spec "
            "and optimizer"
        )
