"""Materialisation: a model built on the meta device becomes this rank's `TrainState`, one unit at a time.

Note [materialisation]: a model built under ``with torch.device("meta"):``
has shapes and no storage. Its state is built on each rank from the flat
layout the compiler produced (`CompiledStep.flats`, Note [shard layout]),
without ever holding the whole model:

1. Before anything is allocated, every meta tensor that the weights files do
   not supply must have an owner module with ``reset_parameters()``, or an
   ``init_weights`` must be given; otherwise a `SpecError` names the module
   (`check_initialisable`).
2. Unit by unit (in the order of the flats): the modules that own a tensor of
   the unit that needs a value are allocated whole on the CPU (every tensor
   they own directly, tied tensors shared), and initialised children first,
   in module order, each under its own seed ``module_seed(seed, module
   name)``: ``reset_parameters()`` if the module has one, then
   ``init_weights(module)`` if given. A floating tensor still NaN afterwards
   was set by neither: a `SpecError` names it.
3. This rank's pieces of the unit's flat parameters (or its slice of a
   whole flat, Note [whole-flat shards]) are cut from those values
   (`compiler.layout.flat.member_piece`), or read from the weights files
   (Note [reading shards]); the unit's buffers are kept whole; the modules'
   tensors go back to meta.

So a rank holds its shards, one unit's modules whole and the buffers, never
the model. Initialisation runs on the CPU whatever the device, so the values
are the same on every device.

Note [initial values]: a tensor's initial value depends only on the seed, the
names of the modules that own it and what their initialisation does: never on
the world size, the spec, the units or the strategy. So N=1, 2, 4 and every
spec start from the same weights, and `materialize_module`, which builds the
whole model through the same per-module initialisation, is the one-process
reference (``shardlang check``, the parity tests). The one assumption, the
PyTorch convention FSDP2 relies on too: a module's initialisation writes its
own tensors, or those of submodules in the same unit. A tensor that several
modules own (a tied weight) gets the value of the last one in module order.

Example::

    with torch.device("meta"):
        model = GPT(config)
    step = sl.compile(model, loss_fn, spec, example_batch=batch, init_seed=0)   # materialises here
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import attrs
import torch
from torch import nn

from ..compiler import CompiledStep, FlatParam, member_piece, slice_spans
from ..errors import SpecError
from .state import TrainState, optimizer_slice, shard_coordinate, tensor_local
from ..spec.units import ROOT_UNIT, unit_label, unit_of
from .weights import Block, WeightFiles

InitWeights = Callable[[nn.Module], None]


@attrs.frozen
class Init:
    """Where a model's initial values come from: the seed and ``init_weights`` for meta tensors, weights files.

    - ``seed``: each module initialises under ``module_seed(seed, its name)`` (Note [initial values]).
    - ``init_weights(module)``: called on every module that owns a meta tensor, after its
      ``reset_parameters()`` (if any); for models that initialise differently. A Hugging Face
      model's own ``_init_weights`` is used when none is given (Note [the model's own initialiser]).
    - ``weights``: a safetensors file or a Hugging Face checkpoint directory (`shardlang.step.weights`);
      every parameter is read from it, and the buffers it holds.

    Example: ``Init(seed=0, init_weights=model._init_weights)``.
    """

    seed: int = 0
    init_weights: InitWeights | None = None
    weights: str | Path | None = None

    def __attrs_post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise SpecError(f"init_seed is {self.seed!r}; it must be an int >= 0")
        if self.init_weights is not None and not callable(self.init_weights):
            raise SpecError(f"init_weights is {self.init_weights!r}, not a function; expected "
                            "init_weights(module) -> None")


def has_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def module_seed(seed: int, module_name: str) -> int:
    """The seed a module initialises under: a hash of (seed, module name), stable across runs and machines.

    Example: ``module_seed(0, "blocks.0.attn.qkv")`` is the same number on every rank.
    """
    digest = hashlib.blake2b(f"{seed}/{module_name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def materialize(compiled: CompiledStep, model: nn.Module, rank: int, device: torch.device,
                init: Init = Init()) -> TrainState:
    """This rank's `TrainState` for ``model`` (meta or real), built unit by unit (Note [materialisation]).

    Real tensors are cut as they are; meta ones are initialised; with
    ``init.weights``, parameters (and the buffers the files hold) are read,
    only this rank's slices. ``model`` is left as it was.

    Example::

        state = materialize(compiled, meta_model, rank=1, device=torch.device("cpu"))
        Step(compiled, None, optimizer, ctx, state=state)
    """
    init = with_model_initialiser(init, model)
    tensors = _Tensors(model)
    files, from_file = _open_weights(init, model)
    tensors.check_initialisable(init.init_weights, from_file)
    coordinate = shard_coordinate(compiled, rank)
    local, block = tensor_local(compiled, rank), _tensor_block(compiled, rank)
    units = list(dict.fromkeys(f.unit for f in compiled.flats))
    buffer_unit = {name: unit_of(name, set(units)) for name in tensors.buffer_names}
    units += [u for u in dict.fromkeys(buffer_unit.values()) if u not in units]
    flat_tensors: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    for unit in units:
        flats = [f for f in compiled.flats if f.unit == unit]
        names = [m.name for f in flats for m in f.members] + [b for b, u in buffer_unit.items() if u == unit]
        with tensors.values_of(names, init, from_file) as values:
            for flat in flats:
                flat_tensors[flat.name] = _storage(flat, local(values), files, from_file, coordinate(flat),
                                                   block).to(device)
            for name in names:
                if name in buffer_unit:
                    buffers[name] = (files.read(from_file[name], tensors.current(name).dtype) if name in from_file
                                     else values[name].detach().clone()).to(device)
    return TrainState.fresh(compiled, [flat_tensors[f.name] for f in compiled.flats],
                            [buffers[n] for n in tensors.buffer_names], list(tensors.buffer_names), device,
                            optimizer_slice(compiled, rank))


def materialize_module(model: nn.Module, init: Init = Init()) -> nn.Module:
    """Give every meta tensor of ``model`` its initial value, whole, on the CPU, in place; returns ``model``.

    The same values `materialize` shards (Note [initial values]): the
    one-process reference of a model built on meta. With ``init.weights`` the
    parameters and the buffers the files hold are loaded, as ``load_state_dict`` would.

    Example::

        reference = materialize_module(build_on_meta(), Init(seed=0))
    """
    init = with_model_initialiser(init, model)
    tensors = _Tensors(model)
    files, from_file = _open_weights(init, model)
    tensors.check_initialisable(init.init_weights, from_file)
    values = tensors.allocate_all(init, from_file)
    with torch.no_grad():
        for name, key in from_file.items():
            values[name].copy_(files.read(key, values[name].dtype))
    return model


def with_model_initialiser(init: Init, model: nn.Module) -> Init:
    """``init``, with the model's own initialiser as ``init_weights`` when none is given and the model has one.

    Note [the model's own initialiser]: a Hugging Face model (a ``PreTrainedModel``) initialises in its
    constructor by calling ``self._init_weights(module)`` on every module (``post_init``); that is also
    what gives the rotary embeddings' non-persistent ``inv_freq`` its value, which no weights file holds.
    Built on meta, the constructor's initialisation did nothing, so shardlang calls the root's
    ``_init_weights`` where ``init_weights`` would be called: on every module, after its
    ``reset_parameters()``, under the module's seed. A job's own ``init_weights`` takes precedence.
    """
    own = getattr(model, "_init_weights", None)
    if init.init_weights is not None or not callable(own) or getattr(model, "config", None) is None:
        return init
    return attrs.evolve(init, init_weights=own)


def _open_weights(init: Init, model: nn.Module) -> tuple[WeightFiles | None, dict[str, str]]:
    if init.weights is None:
        return None, {}
    files = WeightFiles.open(init.weights)
    params, buffers = files.match(model)
    return files, {**params, **buffers}


def _tensor_block(compiled: CompiledStep, rank: int) -> Callable[[str], Block | None]:
    """Parameter name -> the `Block` of it ``rank`` holds on the tensor axis (None: it holds the whole)."""
    config = compiled.context.config
    axis = config.tensor
    if axis is None:
        return lambda name: None
    at = compiled.context.world_mesh.coordinate(rank)[axis.name]
    shapes = {p.name: tuple(p.shape) for p in config.params}

    def block(name: str) -> Block | None:
        dim = axis.split_dim(name)
        if dim is None:
            return None
        size = shapes[name][dim] // axis.size
        return Block(dim, at * size, size)

    return block


def _storage(flat: FlatParam, values: dict[str, torch.Tensor], files: WeightFiles | None, from_file: dict[str, str],
             rank: int, block: Callable[[str], Block | None]) -> torch.Tensor:
    """This rank's parameter storage for ``flat``: its members' pieces, concatenated and padded (Note [shard layout]).

    In the whole layout under ZeRO-3 / ZeRO-2, the part of each member inside this rank's slice
    (Note [whole-flat shards]).
    """
    if flat.params_sharded and flat.whole_layout:
        return _slice_storage(flat, values, files, from_file, rank, block)
    pieces = [files.read_piece(from_file[m.name], m, rank, block(m.name)) if m.name in from_file
              else member_piece(m, values[m.name].detach(), rank) for m in flat.members]
    out = torch.cat(pieces) if pieces else torch.empty(0, dtype=flat.dtype)
    return torch.nn.functional.pad(out, (0, flat.storage_numel - out.numel())) if out.numel() < flat.storage_numel \
        else out


def _slice_storage(flat: FlatParam, values: dict[str, torch.Tensor], files: WeightFiles | None,
                   from_file: dict[str, str], rank: int, block: Callable[[str], Block | None]) -> torch.Tensor:
    """Slice ``rank`` of the whole flat, built from the members' ranges inside it (Note [whole-flat shards])."""
    parts = [files.read_range(from_file[m.name], m.info, lo, hi, block(m.name)) if m.name in from_file
             else values[m.name].detach().reshape(-1)[lo:hi] for m, lo, hi in slice_spans(flat, rank)]
    out = torch.cat(parts) if parts else torch.empty(0, dtype=flat.dtype)
    size = flat.shard_numel
    return torch.nn.functional.pad(out, (0, size - out.numel())) if out.numel() < size else out


@attrs.frozen
class _Slot:
    """One place a module holds a tensor: ``module._parameters[attr]`` or ``module._buffers[attr]``."""

    module_name: str
    module: nn.Module
    attr: str
    is_param: bool
    original: torch.Tensor

    @property
    def table(self) -> dict:
        return self.module._parameters if self.is_param else self.module._buffers

    @property
    def full_name(self) -> str:
        return f"{self.module_name}.{self.attr}" if self.module_name else self.attr


class _Tensors:
    """A model's tensors by canonical name (first name, as ``named_parameters()``), and the slots holding each."""

    def __init__(self, model: nn.Module):
        self.model = model
        canonical: dict[int, str] = {}
        for name, t in model.named_parameters(remove_duplicate=False):
            canonical.setdefault(id(t), name)
        for name, t in model.named_buffers(remove_duplicate=False):
            canonical.setdefault(id(t), name)
        self.buffer_names = tuple(name for name, _ in model.named_buffers())
        self.modules = _post_order(model)  # children before parents (Note [materialisation])
        self.slots: dict[str, list[_Slot]] = {}
        self.owned: dict[str, list[_Slot]] = {}
        for module_name, module in self.modules:
            for is_param, table in ((True, module._parameters), (False, module._buffers)):
                for attr, t in table.items():
                    if t is None:
                        continue
                    slot = _Slot(module_name, module, attr, is_param, t)
                    self.slots.setdefault(canonical[id(t)], []).append(slot)
                    self.owned.setdefault(module_name, []).append(slot)
        self.canonical = canonical

    def name_of(self, slot: _Slot) -> str:
        return self.canonical[id(slot.original)]

    def needs_init(self, name: str, from_file: dict[str, str]) -> bool:
        return self.slots[name][0].original.is_meta and name not in from_file

    def check_initialisable(self, init_weights: InitWeights | None, from_file: dict[str, str]) -> None:
        """Every meta tensor the files do not supply has an owner that can initialise it; else a `SpecError`."""
        if init_weights is not None:
            return
        for name, slots in self.slots.items():
            if not self.needs_init(name, from_file):
                continue
            if not any(callable(getattr(s.module, "reset_parameters", None)) for s in slots):
                owner = slots[0]
                held = [self.name_of(s) for s in self.owned[owner.module_name] if self.needs_init(self.name_of(s),
                                                                                                   from_file)]
                raise SpecError(
                    f"module {unit_label(owner.module_name)!r} ({type(owner.module).__name__}) holds "
                    f"{_some(held)} on the meta device but has no reset_parameters(), so shardlang cannot give "
                    f"{'it' if len(held) == 1 else 'them'} initial values; define reset_parameters() on "
                    f"{type(owner.module).__name__}, pass init_weights=fn (a job file's init_weights(module)) that "
                    "initialises it, or load every parameter from weights")

    def _modules_for(self, names, from_file) -> list[tuple[str, nn.Module]]:
        """The modules owning any of ``names`` that needs a value, in initialisation order."""
        owners = {s.module_name for n in names if self.needs_init(n, from_file) for s in self.slots[n]}
        return [(n, m) for n, m in self.modules if n in owners]

    def values_of(self, names, init: Init, from_file: dict[str, str]) -> _Values:
        """A context giving ``names``' values: initialised when they need it (their modules allocated), else as held."""
        return _Values(self, list(names), init, from_file)

    def allocate_all(self, init: Init, from_file: dict[str, str]) -> dict[str, torch.Tensor]:
        """Allocate every meta tensor for good, initialise the ones the files do not supply; values by name."""
        metas = [n for n, slots in self.slots.items() if slots[0].original.is_meta]
        modules = [(n, m) for n, m in self.modules if n in {s.module_name for x in metas for s in self.slots[x]}]
        _allocate(self, modules)
        _initialise([(n, m) for n, m in self._modules_for(metas, from_file)], init)
        values = {n: self.current(n) for n in self.slots}
        self.check_set([n for n in metas if n not in from_file], values)
        return values

    def current(self, name: str) -> torch.Tensor:
        slot = self.slots[name][0]
        return slot.table[slot.attr]

    def check_set(self, names, values: dict[str, torch.Tensor]) -> None:
        for name in names:
            value = values[name]
            if value.is_floating_point() and bool(value.isnan().any()):
                owners = ", ".join(f"{unit_label(s.module_name)!r} ({type(s.module).__name__})" for s in self.slots[name])
                raise SpecError(f"{name!r} has no initial value after initialisation: neither reset_parameters() nor "
                                f"init_weights set it (or they set NaN) on its module {owners}; make one of them "
                                "initialise it")


class _Values:
    """The values of some tensors while their modules are allocated; on exit the modules go back to meta."""

    def __init__(self, tensors: _Tensors, names: list[str], init: Init, from_file: dict[str, str]):
        self.tensors, self.names, self.init, self.from_file = tensors, names, init, from_file
        self.slots: list[_Slot] = []

    def __enter__(self) -> dict[str, torch.Tensor]:
        modules = self.tensors._modules_for(self.names, self.from_file)
        self.slots = _allocate(self.tensors, modules)
        _initialise(modules, self.init)
        values = {n: self.tensors.current(n) for n in self.names if n not in self.from_file}
        self.tensors.check_set([n for n in self.names if self.tensors.needs_init(n, self.from_file)], values)
        return values

    def __exit__(self, *exc) -> None:
        for slot in self.slots:
            slot.table[slot.attr] = slot.original


def _allocate(tensors: _Tensors, modules: list[tuple[str, nn.Module]]) -> list[_Slot]:
    """Give every tensor these modules own directly CPU storage (meta: NaN, real: a copy), ties shared."""
    fresh: dict[int, torch.Tensor] = {}
    changed = []
    names = {n for n, _ in modules}
    for module_name in names:
        for slot in tensors.owned.get(module_name, []):
            t = slot.original
            if id(t) not in fresh:
                if t.is_meta:
                    data = torch.empty(t.shape, dtype=t.dtype)
                    if data.is_floating_point():
                        data.fill_(float("nan"))  # Note [materialisation] 2: NaN marks "not initialised"
                    else:
                        data.zero_()
                else:
                    data = t.detach().to("cpu", copy=True)
                fresh[id(t)] = nn.Parameter(data, requires_grad=t.requires_grad) if slot.is_param else data
            slot.table[slot.attr] = fresh[id(t)]
            changed.append(slot)
    return changed


def _initialise(modules: list[tuple[str, nn.Module]], init: Init) -> None:
    """``reset_parameters()`` then ``init_weights(module)`` on each module, under its own seed."""
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        for name, module in modules:
            torch.manual_seed(module_seed(init.seed, name))
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
            if init.init_weights is not None:
                init.init_weights(module)


def _post_order(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module once (by its first name, as ``named_modules()``), children before their parent."""
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def walk(name: str, module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        for child_name, child in module._modules.items():
            if child is not None:
                walk(f"{name}.{child_name}" if name else child_name, child)
        out.append((name, module))

    walk(ROOT_UNIT, model)
    return out


def _some(names: list[str], shown: int = 4) -> str:
    return ", ".join(repr(n) for n in names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")
