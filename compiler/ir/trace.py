"""Trace a whole training step (forward, loss, backward, optimizer) into one aten graph.

The traced function is the *logical*, unsharded step. Its inputs are, in order:

    FLAT    one tensor per flat parameter: its members flattened and concatenated
    STATE   optimizer state, one tensor per (trainable flat, state name), same size as FLAT
    STEP    a 0-d float64 count of the updates done so far
    HYPER   0-d float64 hyperparameters (lr), so a schedule can change them without retracing
    BUFFER  the module's buffers (BatchNorm statistics are mutated in place)
    BATCH   the leaves of the per-rank batch

and it returns the loss. Inside, each parameter is a view of its flat input,
detached into an autograd leaf; `torch.autograd.grad` produces the gradients
(``torch.func.grad`` broke under symbolic shapes in a trial, autograd.grad did
not); each trainable flat's gradients are concatenated into one flat gradient;
and the optimizer updates the flat input and its state in place.

Nodes carry ``meta["custom"]`` tags that the passes read instead of guessing:
``phase`` (forward / backward / optimizer), ``member`` on the nodes that build a
parameter's leaf, ``grad_flat`` on the concatenated gradient, ``flat`` on a
flat parameter's optimizer update, and ``unit`` on every forward node that runs
inside a unit's module (the innermost one; ``""`` for the model itself outside
every other unit; nodes of the loss function outside the model have none).

`trace_forward` traces the evaluation graph instead (Note [evaluation graph]):
the same FLAT placeholders and buffers, then the batch, and no gradients, no
optimizer and no step count.

Note [no decomposition]: make_fx runs without a decomposition table, so
``scaled_dot_product_attention`` stays one fused forward op with its matching
backward op. Decomposing the forward alone gives silently wrong gradients.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Mapping

import attrs
import torch
import torch.fx.traceback as fx_traceback
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from shardlang.errors import TraceError
from ..layout.flat import FlatParam
from .lazy_code import lazy_code
from ..layout.optim import GroupedOptimizer, hyper_tensors
from .dtypes import check_matmul_dtypes
from .mutations import check_input_mutations
from .provenance import partial_graph, trace_error, tracing_sites
from .rng import GlobalDropout, check_random_ops
from .sync_batch_norm import SyncBatchNorm
from .torch_logs import captured_torch_logs
from .training import Training
from shardlang.spec.vocabulary import Accumulation, RandomScheme


class InputRole(enum.Enum):
    FLAT = "flat"
    STATE = "state"
    STEP = "step"
    HYPER = "hyper"
    BUFFER = "buffer"
    BATCH = "batch"


class Phase(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


@attrs.frozen
class GraphInput:
    """What one placeholder of the step graph receives."""

    role: InputRole
    name: str  # flat name, "flat/state", buffer name, hyper name, or batch leaf index
    flat: str | None = None


@attrs.frozen
class TensorShape:
    """What tracing needs of a tensor: shape, dtype, device (no storage).

    Example: ``TensorShape.of(model.bn.running_mean)``.
    """

    shape: tuple[int, ...] = attrs.field(converter=tuple)
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorShape:
        return cls(tuple(t.shape), t.dtype, t.device)


@attrs.frozen
class TracedStep:
    """The traced logical step: its graph, what each input is, and the batch structure."""

    graph_module: torch.fx.GraphModule
    inputs: tuple[GraphInput, ...]
    batch_spec: pytree.TreeSpec
    batch_shapes: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    optimizer: GroupedOptimizer | None = None  # the optimizer of each parameter group
    output_spec: pytree.TreeSpec | None = None  # evaluation graphs: the structure of what ``fn`` returned
    replicated_from: int | None = None  # the layers traced, when the graph replicates them (Note [replicated trace])
    placements: object = None  # `compiler.placement.PlacementPlan`: how a tensor axis placed the logical step


def phase_of(node: torch.fx.Node) -> Phase | None:
    tag = node.meta.get("custom", {}).get("phase")
    return Phase(tag) if tag else None


def tag_of(node: torch.fx.Node, key: str):
    return node.meta.get("custom", {}).get(key)


class _LossModule(torch.nn.Module):
    """Wraps (model, loss_fn) so `functional_call` can swap in the traced parameters."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch):
        return self.loss_fn(self.model, batch)


def graph_inputs(flats: tuple[FlatParam, ...], optimizer, buffer_names, n_batch_leaves) -> tuple[GraphInput, ...]:
    """The input signature of the step graph, in placeholder order."""
    inputs = [GraphInput(InputRole.FLAT, f.name, f.name) for f in flats]
    for f in flats:
        if f.trainable:
            inputs += [GraphInput(InputRole.STATE, f"{f.name}/{s}", f.name) for s in optimizer.state_names(f)]
    inputs.append(GraphInput(InputRole.STEP, "step"))
    inputs += [GraphInput(InputRole.HYPER, k) for k in optimizer.hyper()]
    inputs += [GraphInput(InputRole.BUFFER, b) for b in buffer_names]
    inputs += [GraphInput(InputRole.BATCH, str(i)) for i in range(n_batch_leaves)]
    return tuple(inputs)


def eval_graph_inputs(flats: tuple[FlatParam, ...], buffer_names, n_batch_leaves) -> tuple[GraphInput, ...]:
    """The input signature of an evaluation graph: FLAT, BUFFER, BATCH (Note [evaluation graph])."""
    inputs = [GraphInput(InputRole.FLAT, f.name, f.name) for f in flats]
    inputs += [GraphInput(InputRole.BUFFER, b) for b in buffer_names]
    inputs += [GraphInput(InputRole.BATCH, str(i)) for i in range(n_batch_leaves)]
    return tuple(inputs)


def trace_forward(model: torch.nn.Module, fn: Callable, flats: tuple[FlatParam, ...], batch) -> TracedStep:
    """Trace ``fn(model, batch)`` forward only, in eval mode, with fake tensors (Note [evaluation graph]).

    ``fn`` is the loss function, or any function of (model, batch) that returns
    a tensor or a pytree of tensors (logits, say); the graph returns its leaves
    and `TracedStep.output_spec` their structure. Only the shapes and dtypes of
    ``model``'s buffers and of ``batch`` are read, so the module may hold fake,
    meta or stale tensors.

    Example::

        traced = trace_forward(model, loss_fn, flats, per_rank_batch)
        traced.graph_module.graph      # placeholders: flats, buffers, batch leaves; no backward
    """
    buffers = dict(model.named_buffers())
    batch_leaves, batch_spec = pytree.tree_flatten(batch)
    inputs = eval_graph_inputs(flats, tuple(buffers), len(batch_leaves))
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        example = [torch.empty(f.numel, dtype=f.dtype) for f in flats]
        example += [torch.empty(b.shape, dtype=b.dtype) for b in buffers.values()]
    example += [_to_fake(fake_mode, t) for t in batch_leaves]
    loss_module = _LossModule(model, fn)
    buffer_keys = ["model." + k for k in buffers]
    output_spec = []

    def forward_fn(*args):
        flat_in, rest = args[: len(flats)], args[len(flats):]
        named = dict(zip(buffer_keys, rest[: len(buffer_keys)]))
        piece = pytree.tree_unflatten(list(rest[len(buffer_keys):]), batch_spec)
        compute_dtype = next((f.param_dtype for f in flats if f.param_dtype is not None), None)
        if compute_dtype is not None:  # mixed precision casts floating inputs, as in training
            piece = pytree.tree_map(lambda t: t.to(compute_dtype) if t.is_floating_point() else t, piece)
        leaves, _ = _parameter_leaves(flats, flat_in, trainable=False)
        with fx_traceback.annotate({"phase": Phase.FORWARD.value}):
            out = torch.func.functional_call(loss_module, {**leaves, **named}, (piece,), tie_weights=True,
                                             strict=False)
        out_leaves, spec = pytree.tree_flatten(out)
        bad = [type(x).__name__ for x in out_leaves if not isinstance(x, torch.Tensor)]
        if bad or not out_leaves:
            raise TraceError(f"the evaluated function must return a tensor or a tuple/list/dict of tensors; "
                             f"it returned {type(out).__name__}" + (f" holding {', '.join(bad)}" if bad else ""))
        output_spec.append(spec)
        return out_leaves

    try:
        with fx_traceback.preserve_node_meta(), torch.no_grad(), _eval_mode(model), lazy_code(), \
                captured_torch_logs():  # a failure is reported below, once (Note [torch's logs])
            gm = make_fx(forward_fn, tracing_mode="fake")(*example)
    except TraceError:
        raise
    except Exception as exc:
        raise TraceError(f"tracing the evaluation step failed: {type(exc).__name__}: {exc}") from exc
    shapes = tuple((tuple(t.shape), t.dtype) for t in batch_leaves)
    return TracedStep(gm, inputs, batch_spec, shapes, None, output_spec[0])


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module):
    """``model.eval()`` for the duration (BatchNorm reads its running statistics, dropout is off), then restored."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def trace_step(model: torch.nn.Module, loss_fn: Callable, flats: tuple[FlatParam, ...], optimizer,
               batch, data_parallel_size: int = 1, training: Training | None = None,
               buffers: Mapping[str, TensorShape] | None = None,
               tied: Mapping[str, str] | None = None) -> TracedStep:
    """Trace the unsharded training step of ``model`` with fake tensors (no real weights needed).

    ``batch`` is an example per-rank batch (real or fake); only its shapes and
    dtypes are used. With ``data_parallel_size`` > 1, training-mode BatchNorm is
    traced synchronised over that many ranks (`compiler.ir.sync_batch_norm`).
    ``optimizer`` is an optimizer or a `GroupedOptimizer` (one per parameter group);
    ``training`` the training features (`compiler.ir.training`). ``buffers``
    (name -> `TensorShape`) stands in for the module's buffers, so a module
    whose storage is gone (on the meta device) traces again for another batch
    shape; by default the module's own buffers are the examples. ``tied``
    (alias -> the name ``named_parameters()`` lists) gives the module's tied
    parameters, which moving a module to the meta device unties; by default
    they are read off the module (`tied_parameters`).
    """
    training = training or Training()
    optimizer = GroupedOptimizer.build(optimizer)
    fake_mode = _fake_mode_of(model)
    if buffers is None:
        buffers = dict(model.named_buffers())
    else:
        with fake_mode:
            buffers = {name: torch.empty(b.shape, dtype=b.dtype, device=None if b.device.type == "meta" else b.device)
                       for name, b in buffers.items()}  # meta: as `_to_fake` traces it
    batch_leaves, batch_spec = pytree.tree_flatten(batch)
    inputs = graph_inputs(flats, optimizer, tuple(buffers), len(batch_leaves))
    with fake_mode:
        flat_inputs = [torch.empty(f.numel, dtype=f.dtype) for f in flats]
        state_inputs = [torch.empty(f.numel, dtype=f.dtype) for f in flats if f.trainable
                        for _ in optimizer.state_names(f)]
        hyper = hyper_tensors(optimizer)
        step_input = torch.zeros((), dtype=torch.float64)
        hyper_inputs = [torch.zeros((), dtype=torch.float64) for _ in hyper]
    example = [*flat_inputs, *state_inputs, step_input, *hyper_inputs]
    example += [_to_fake(fake_mode, t) for t in (*buffers.values(), *batch_leaves)]
    _check_microbatches(batch_leaves, training.microbatches)
    step_fn = _make_step_fn(_LossModule(model, loss_fn), flats, optimizer, list(buffers), batch_spec, tuple(hyper),
                            data_parallel_size, training, tied_parameters(model) if tied is None else tied)
    with tracing_sites(model) as sites:
        try:
            with fx_traceback.preserve_node_meta(), lazy_code(), captured_torch_logs(), \
                    _annotate_units(model, {m.info.unit for f in flats for m in f.members}):
                gm = make_fx(step_fn, tracing_mode="fake")(*example)
        except TraceError:
            raise
        except Exception as exc:  # surface the user's error with where it happened and what to do
            partial = partial_graph(exc)
            if partial is not None:  # a parameter changed in place often fails later, in backward
                check_input_mutations(partial, inputs)
            raise trace_error(exc, model, sites) from exc
    if sites.built:
        raise TraceError("tracing the training step: a module was built inside it\n"
                         f"what to do: {sites.describe_built()}", site=sites.first_site)
    check_input_mutations(gm.graph, inputs)
    check_matmul_dtypes(gm.graph)
    if training.random is RandomScheme.GLOBAL:
        check_random_ops(gm)
    _sum_gradients_early(gm)
    shapes = tuple((tuple(t.shape), t.dtype) for t in batch_leaves)
    return TracedStep(gm, inputs, batch_spec, shapes, optimizer)


def tied_parameters(model: torch.nn.Module) -> dict[str, str]:
    """Every alias of a tied parameter -> the name ``named_parameters()`` lists it under.

    Example: a GPT whose head is tied to its embedding gives ``{"head.weight": "tok_emb.weight"}``.
    """
    first: dict[int, str] = {}
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def _make_step_fn(loss_module, flats, optimizer, buffer_names, batch_spec, hyper_names, data_parallel_size,
                  training: Training, tied: Mapping[str, str]):
    n_flat = len(flats)
    n_state = sum(len(optimizer.state_names(f)) for f in flats if f.trainable)
    micro = training.microbatches
    keep = training.accumulation is Accumulation.KEEP
    sum_dtypes = [f.gradient_reduce_dtype for f in flats if f.trainable for _ in f.members]

    def step_fn(*args):
        flat_in = args[:n_flat]
        state_in = list(args[n_flat : n_flat + n_state])
        step = args[n_flat + n_state]
        rest = args[n_flat + n_state + 1 :]
        hyper = dict(zip(hyper_names, rest[: len(hyper_names)]))
        buffers = {"model." + k: v for k, v in zip(buffer_names, rest[len(hyper_names):len(hyper_names) + len(buffer_names)])}
        batch = pytree.tree_unflatten(list(rest[len(hyper_names) + len(buffer_names) :]), batch_spec)

        compute_dtype = next((f.param_dtype for f in flats if f.param_dtype is not None), None)
        if compute_dtype is not None:  # mixed precision casts floating inputs, as FSDP2 does
            batch = pytree.tree_map(lambda t: t.to(compute_dtype) if t.is_floating_point() else t, batch)
        modes = []
        if data_parallel_size > 1:
            modes.append(SyncBatchNorm("*", data_parallel_size))
        if training.random is RandomScheme.GLOBAL:
            modes.append(GlobalDropout(data_parallel_size))
        grads, loss_sum = None, None
        # Note [micro-batches]: KEEP traces all k micro-batches here, on one set of
        # parameter leaves, summing their gradients; PER_MICROBATCH traces the
        # first only, and `accumulate_microbatches` repeats it after the passes.
        for i in range(micro if keep else 1):
            with _annotate_microbatch(i, micro):
                if grads is None:
                    leaves, trainable = _parameter_leaves(flats, flat_in)
                    leaves |= {"model." + alias: leaves["model." + name] for alias, name in tied.items()}
                piece = _microbatch(batch, i, micro)
                with torch.enable_grad(), fx_traceback.annotate({"phase": Phase.FORWARD.value}), \
                        contextlib.ExitStack() as stack:
                    for mode in modes:
                        stack.enter_context(mode)
                    loss = torch.func.functional_call(loss_module, {**leaves, **buffers}, (piece,), tie_weights=True,
                                                      strict=False)
                    _check_loss(loss)
                    if micro > 1:  # the mean over k micro-batches is the mean over the whole batch
                        loss = loss / micro
                with fx_traceback.annotate({"phase": Phase.BACKWARD.value}):
                    mine = list(torch.autograd.grad(loss, trainable, materialize_grads=True)) if trainable else []
                with fx_traceback.annotate({"phase": Phase.BACKWARD.value, "grad_sum": True}):
                    if micro > 1:  # KEEP sums in the dtype the sum is reduced in (mixed precision: reduce_dtype)
                        mine = [g.to(dt) for g, dt in zip(mine, sum_dtypes)]
                    grads = mine if grads is None else [a + g for a, g in zip(grads, mine)]
                loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
        with torch.no_grad():
            for flat, tensor in zip(flats, flat_in):
                if not flat.trainable:
                    continue
                mine = [grads.pop(0) for _ in flat.members]
                with fx_traceback.annotate({"phase": Phase.OPTIMIZER.value, "grad_flat": flat.name}):
                    grad = torch.cat([g.reshape(-1).to(flat.dtype) for g in mine])
                state = [state_in.pop(0) for _ in optimizer.state_names(flat)]
                with fx_traceback.annotate({"phase": Phase.OPTIMIZER.value, "flat": flat.name}):
                    optimizer.update_(flat, tensor, grad, state, hyper, step)
            with fx_traceback.annotate({"phase": Phase.OPTIMIZER.value}):
                step.add_(1)
        master_dtype = flats[0].dtype if flats else loss_sum.dtype
        return loss_sum.to(master_dtype) if compute_dtype is not None else loss_sum

    return step_fn


@contextlib.contextmanager
def _annotate_units(model: torch.nn.Module, units):
    """While tracing, tag each node made inside a unit's module with ``unit`` (the innermost unit wins).

    Forward pre-hooks and hooks on the unit modules enter and leave an
    annotation; they are removed when tracing ends, so the user's model is left
    as it was. The recompute pass reads these tags.
    """
    open_annotations: list[contextlib.ExitStack] = []
    handles = []

    def enter(name: str):
        def hook(_module, _args):
            stack = contextlib.ExitStack()
            stack.enter_context(fx_traceback.annotate({"unit": name}))
            open_annotations.append(stack)
        return hook

    def leave(_module, _args, _output):
        open_annotations.pop().close()

    for name in sorted(units):
        module = model.get_submodule(name) if name else model
        handles.append(module.register_forward_pre_hook(enter(name)))
        handles.append(module.register_forward_hook(leave, always_call=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        while open_annotations:
            open_annotations.pop().close()


def _sum_gradients_early(gm: torch.fx.GraphModule) -> None:
    """KEEP accumulation: add each micro-batch gradient into the sum as soon as backward makes it.

    autograd.grad returns every gradient at the end of a micro-batch's backward;
    moving each sum right after its inputs lets `reduce_gradients` issue a flat
    parameter's reduction while the last micro-batch's backward goes on.
    """
    order = {n: float(i) for i, n in enumerate(gm.graph.nodes)}
    for node in [n for n in gm.graph.nodes if tag_of(n, "grad_sum")]:
        latest = max(node.all_input_nodes, key=order.__getitem__)
        latest.append(node)
        order[node] = order[latest] + 0.5
    gm.recompile()


def _parameter_leaves(flats, flat_in, trainable: bool = True) -> tuple[dict, list]:
    """Each parameter as a view of its flat input, detached into an autograd leaf (tagged ``member``).

    With ``trainable=False`` (evaluation) no leaf requires a gradient.
    """
    leaves, grads = {}, []
    for flat, tensor in zip(flats, flat_in):
        start = 0
        for m in flat.members:
            with fx_traceback.annotate({"phase": Phase.FORWARD.value, "member": m.name}):
                leaf = tensor[start : start + m.info.numel].view(m.info.shape)
                if flat.param_dtype is not None:  # mixed precision: compute in param_dtype
                    leaf = leaf.to(flat.param_dtype)
                leaf = leaf.detach()
                if flat.trainable and trainable:
                    leaf.requires_grad_(True)
                    grads.append(leaf)
            leaves["model." + m.name] = leaf
            start += m.info.numel
    return leaves, grads


def _annotate_microbatch(i: int, micro: int):
    return fx_traceback.annotate({"microbatch": i}) if micro > 1 else contextlib.nullcontext()


def _microbatch(batch, i: int, micro: int):
    """Rows ``[i*b, (i+1)*b)`` of every batch leaf (b = rows / micro); the slices are tagged ``microbatch_rows``."""
    if micro == 1:
        return batch

    def rows(leaf):
        b = leaf.shape[0] // micro
        with fx_traceback.annotate({"phase": Phase.FORWARD.value, "microbatch_rows": b}):
            return leaf[i * b : (i + 1) * b]

    return pytree.tree_map(rows, batch)


def _check_microbatches(batch_leaves, micro: int) -> None:
    if micro == 1:
        return
    for index, leaf in enumerate(batch_leaves):
        rows = leaf.shape[0] if leaf.dim() else 0
        if rows % micro:
            raise TraceError(
                f"batch leaf {index} has {rows} rows per rank, which do not split into Options.microbatches="
                f"{micro} equal micro-batches; make the per-rank batch a multiple of {micro} rows"
            )


def _check_loss(loss) -> None:
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.dtype.is_floating_point:
        hint = ""
        if isinstance(loss, torch.Tensor):
            described = f"a tensor of shape {tuple(loss.shape)} and dtype {loss.dtype}"
        elif isinstance(loss, (tuple, list, dict)):
            described = f"a {type(loss).__name__} of {len(loss)} values"
            hint = "; return the loss alone (compute other values outside the step)"
        else:
            described = f"{type(loss).__name__} {repr(loss)[:60]}"
        raise TraceError(f"loss_fn must return a floating-point scalar tensor; it returned {described}{hint}")
    if not loss.requires_grad:
        raise TraceError("loss_fn returned a loss that does not depend on any trainable parameter; compute it from "
                         "the model's output, and check that the output is not detached and that some parameters "
                         "have requires_grad=True")


def _fake_mode_of(model: torch.nn.Module) -> FakeTensorMode:
    for t in (*model.parameters(), *model.buffers()):
        if isinstance(t, FakeTensor):
            return t.fake_mode
    return FakeTensorMode(allow_non_fake_inputs=True)


def _to_fake(mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, FakeTensor):
        return t
    if t.is_meta:  # a buffer of a model built on meta: traced on the device the flat inputs have (the default)
        with mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
    return mode.from_tensor(t)
