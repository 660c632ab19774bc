"""A step's state as the state dict DCP writes and reads, in the key layout FSDP2 users have.

Note [checkpoint keys]: the keys are those of
``{"model": get_model_state_dict(m), "optimizer": get_optimizer_state_dict(m, opt)}``
saved with ``dcp.save`` (checked against FSDP2 in tests/test_checkpoint_interop.py),
plus shardlang's own:

    model.<name>                                  every parameter (tied ones under each name), persistent buffers
    optimizer.state.<name>.<exp_avg|...>          the optimizer state of each trainable parameter, whole shape
    optimizer.state.<name>.step                   Adam/AdamW: the update count (float32, as torch.optim)
    optimizer.param_groups.<g>.<lr|betas|...>     one torch param group per parameter group, "params" = names
    shardlang.step_count                          the update count (float64)
    shardlang.lr_schedule                         the lr scheduler's state_dict (a JSON string; never a pickle)
    shardlang.rng.rank<r>                         rank r's step generator (only with random ops)
    shardlang.data_position                       the next global batch the job reads (an int)
    shardlang.data_state                          the job's data loader's state_dict, when it has one (JSON)
    shardlang.meta                                JSON: format, world size, mesh, spec, strategies, for the record

Parameters and optimizer state are `layout.Entry` values (this rank's chunks of the
global tensor); everything else is a plain tensor or Python value. The spec, the
strategy and the world size leave no trace in the tensor keys, which is what lets a
checkpoint load under another layout (resharding is DCP's, Note [chunks of a flat shard]).
"""

from __future__ import annotations

import base64
import io
import json

import attrs
import torch

from ..compiler import Adam, AdamW, FlatParam, SGD, hyper_name, tied_parameters
from ..errors import CheckpointError
from .layout import Entry, optimizer_pieces, parameter_pieces, placed

FORMAT = 1
META_KEY = "shardlang.meta"
STEP_KEY = "shardlang.step_count"
SCHEDULE_KEY = "shardlang.lr_schedule"
DATA_KEY = "shardlang.data_position"
DATA_STATE_KEY = "shardlang.data_state"
TENSOR_TAG = "__shardlang_tensor__"  # a tensor inside a loader's state, as JSON
HYPER_CHECKED = ("betas", "eps", "weight_decay", "momentum", "dampening", "nesterov")  # compiled in; must agree


@attrs.frozen
class ModelNames:
    """The model's own names: parameters in ``named_parameters`` order, tied aliases, persistent buffers.

    Example: for examples/gpt.py, ``aliases == {"head.weight": "tok_emb.weight"}``.
    """

    parameters: tuple[str, ...]
    aliases: dict[str, str]  # alias -> the name the parameter is held under (its first name)
    persistent_buffers: tuple[str, ...]

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelNames:
        keys = set(model.state_dict(keep_vars=True))
        buffers = tuple(n for n, _ in model.named_buffers() if n in keys)
        return cls(tuple(n for n, _ in model.named_parameters()), tied_parameters(model), buffers)

    @classmethod
    def of_flats(cls, flats: tuple[FlatParam, ...], buffer_names: list[str]) -> ModelNames:
        """Without the module: the flats' member names, no aliases, every buffer."""
        return cls(tuple(m.name for f in flats for m in f.members), {}, tuple(buffer_names))


def model_entries(step) -> dict[str, object]:
    """``model.<name>`` for every parameter (as `Entry`) and persistent buffer."""
    state = step.state
    block = _tensor_block(step)
    entries: dict[str, object] = {}
    for flat, storage in zip(step.compiled.flats, state.flat_tensors):
        coordinate = _coordinate(step, flat)
        for member in flat.members:
            shape, offsets = block(member.name)
            save, load = parameter_pieces(flat, member, storage, coordinate)
            entries[member.name] = Entry(f"model.{member.name}", shape, flat.dtype, tuple(placed(save, offsets)),
                                         tuple(placed(load, offsets)))
    for alias, name in step.names.aliases.items():
        entries[alias] = attrs.evolve(entries[name], name=f"model.{alias}")
    buffers = dict(zip(state.buffer_names, state.buffers))
    for name in step.names.persistent_buffers:
        entries[name] = buffers[name]
    return entries


def optimizer_entries(step) -> dict[str, dict[str, object]]:
    """``optimizer.state``: per trainable parameter, its optimizer state (as `Entry`) and, for Adam, ``step``."""
    state = step.state
    optimizer = step.compiled.traced.optimizer
    out: dict[str, dict[str, object]] = {}
    tensors = iter(state.optimizer_state)
    block = _tensor_block(step)
    for flat in step.compiled.flats:
        if not flat.trainable:
            continue
        coordinate = _coordinate(step, flat)
        names = optimizer.state_names(flat)
        held = [next(tensors) for _ in names]
        for member in flat.members:
            per = out.setdefault(member.name, {})
            shape, offsets = block(member.name)
            for state_name, tensor in zip(names, held):
                pieces = tuple(placed(optimizer_pieces(flat, member, tensor, coordinate), offsets))
                per[state_name] = Entry(f"optimizer.state.{member.name}.{state_name}", shape, flat.dtype,
                                        pieces, pieces)
            if isinstance(optimizer.of(flat), Adam):
                per["step"] = state.step_count.to(torch.float32)
    return {name: out[name] for name in step.names.parameters if name in out}


def param_groups(step) -> list[dict[str, object]]:
    """One ``torch.optim`` param group per shardlang parameter group: torch's keys, the current lr, names as params."""
    optimizer = step.compiled.traced.optimizer
    members = {m.name: f.group for f in step.compiled.flats if f.trainable for m in f.members}
    schedule = step.lr_schedule
    groups = []
    for g, opt in enumerate(optimizer.groups):
        group = dict(_torch_group(opt))
        group["lr"] = float(step.hyper[hyper_name("lr", g)])
        if schedule is not None and "initial_lr" in schedule.optimizer.param_groups[g]:
            group["initial_lr"] = float(schedule.optimizer.param_groups[g]["initial_lr"])
        group["params"] = [n for n in step.names.parameters if members.get(n) == g]
        groups.append(group)
    return groups


def _torch_group(opt) -> dict[str, object]:
    """torch.optim's own param-group keys for shardlang's ``opt`` (without "params")."""
    dummy = [torch.nn.Parameter(torch.zeros(1))]
    kind = type(opt)
    if kind is SGD:
        torch_opt = torch.optim.SGD(dummy, lr=opt.lr, momentum=opt.momentum, dampening=opt.dampening,
                                    weight_decay=opt.weight_decay, nesterov=opt.nesterov)
    elif kind is AdamW:
        torch_opt = torch.optim.AdamW(dummy, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)
    else:
        torch_opt = torch.optim.Adam(dummy, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)
    return {k: v for k, v in torch_opt.param_groups[0].items() if k != "params"}


def own_entries(step, data_position: int, data_state: dict | None = None) -> dict[str, object]:
    """shardlang's own keys (Note [checkpoint keys]), as a nested dict under ``shardlang``."""
    state = step.state
    own: dict[str, object] = {"step_count": state.step_count, "data_position": int(data_position),
                              "meta": json.dumps(meta(step), sort_keys=True)}
    if data_state is not None:
        own["data_state"] = data_state_to_json(data_state)
    if step.lr_schedule is not None:
        own["lr_schedule"] = schedule_to_json(step.lr_schedule.scheduler.state_dict())
    if step.random is not None:
        own["rng"] = {f"rank{step.dist.rank}": _rng_tensor(step.random)}
    return own


def meta(step) -> dict[str, object]:
    """What a checkpoint records of the run that wrote it (read by `shardlang export`, shown in errors)."""
    spec = getattr(step, "spec", None)
    return {
        "format": FORMAT,
        "world_size": step.dist.world_size,
        "mesh": [list(a) for a in step.compiled.context.world_mesh.axes],
        "spec": spec.to_dict() if spec is not None else None,
        "optimizer": repr(step.compiled.traced.optimizer.base),
        "flats": [{"name": f.name, "strategy": f.strategy.value, "axis": f.axis,
                   "members": [m.name for m in f.members]} for f in step.compiled.flats],
        "parameters": {p.name: list(p.shape) for p in step.compiled.context.config.params},
        "aliases": dict(step.names.aliases),
        "buffers": list(step.names.persistent_buffers),
        "steps": step.steps_done,
    }


def schedule_to_json(state: dict) -> str:
    """An lr scheduler's ``state_dict`` as JSON (Note [checkpoints run no code]: nothing of it is pickled).

    Example::

        >>> schedule_to_json({"last_epoch": 3, "base_lrs": [0.1], "_last_lr": [0.05]})
        '{"_last_lr": [0.05], "base_lrs": [0.1], "last_epoch": 3}'
    """
    try:
        return json.dumps(state, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"the lr scheduler's state_dict cannot be saved as JSON ({exc}); a checkpoint keeps "
                              "numbers, strings, lists and dicts of the scheduler, never pickled objects") from None


def data_state_to_json(state) -> str:
    """A data loader's ``state_dict`` as JSON: numbers, strings, lists, dicts and tensors (tagged, base64).

    Nothing is pickled (Note [checkpoints run no code]); a value of another kind is a `CheckpointError`.

    >>> data_state_to_json({"position": 3, "loader": {"_num_yielded": 3, "seen": (1, 2)}})
    '{"loader": {"_num_yielded": 3, "seen": [1, 2]}, "position": 3}'
    """
    def encode(value):
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            return {TENSOR_TAG: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                                 "data": base64.b64encode(t.view(torch.uint8).numpy().tobytes()).decode()}}
        if isinstance(value, dict):
            if not all(isinstance(k, str) for k in value):
                raise TypeError(f"a dict with keys {[k for k in value if not isinstance(k, str)][:3]} (not strings)")
            return {k: encode(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [encode(v) for v in value]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise TypeError(f"a {type(value).__name__}")

    try:
        return json.dumps(encode(state), sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"the data loader's state_dict cannot be saved as JSON: it holds {exc}; a checkpoint "
                              "keeps numbers, strings, lists, dicts and tensors of it, never pickled objects") from None


def data_state_from_json(text: str, where: str) -> dict:
    """The loader state `data_state_to_json` wrote, read as untrusted JSON; a `CheckpointError` names ``where``."""
    def decode(value):
        if isinstance(value, dict):
            if set(value) == {TENSOR_TAG}:
                spec = value[TENSOR_TAG]
                dtype = getattr(torch, str(spec.get("dtype")), None)
                if not isinstance(dtype, torch.dtype):
                    raise ValueError(f"tensor dtype {spec.get('dtype')!r}")
                raw = torch.frombuffer(bytearray(base64.b64decode(spec["data"], validate=True)), dtype=torch.uint8)
                return raw.view(dtype).reshape([int(n) for n in spec["shape"]]).clone()
            return {k: decode(v) for k, v in value.items()}
        if isinstance(value, list):
            return [decode(v) for v in value]
        return value

    try:
        state = decode(json.loads(text))
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise CheckpointError(f"{where}: {DATA_STATE_KEY} is not a data loader state this shardlang wrote ({exc})",
                              path=where, key=DATA_STATE_KEY) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{where}: {DATA_STATE_KEY} is a {type(state).__name__}, not a dict", path=where,
                              key=DATA_STATE_KEY)
    return state


def schedule_from_saved(value, where: str) -> dict:
    """The scheduler state a checkpoint holds: JSON, or the ``torch.save`` bytes of format 1, read with torch's
    ``weights_only`` allowlist."""
    if isinstance(value, bytes):  # format 1
        from .untrusted import load_value  # imports DCP (1.4 s): not at `import shardlang`

        value = load_value(io.BytesIO(value), where, SCHEDULE_KEY)
        if isinstance(value, dict):
            return value
    elif isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise CheckpointError(f"{where}: {SCHEDULE_KEY!r} is not JSON ({exc})", path=where,
                                  key=SCHEDULE_KEY) from None
        if isinstance(value, dict):
            return value
    raise CheckpointError(f"{where}: {SCHEDULE_KEY!r} holds a {type(value).__name__}, not a scheduler's state_dict",
                          path=where, key=SCHEDULE_KEY)


def _rng_tensor(random) -> torch.Tensor:
    """The step generator's CPU state, and its CUDA state after it when there is one (uint8)."""
    parts = [random.cpu_state] + ([random.cuda_state.cpu()] if random.cuda_state is not None else [])
    return torch.cat(parts).clone()


def set_rng(random, saved: torch.Tensor) -> None:
    n = random.cpu_state.numel()
    random.cpu_state = saved[:n].clone()
    if random.cuda_state is not None and saved.numel() > n:
        random.cuda_state = saved[n:].clone()


def _coordinate(step, flat: FlatParam) -> int:
    """This rank's coordinate on ``flat``'s axis (0 when replicated)."""
    return step.compiled.context.world_mesh.coordinate(step.dist.rank)[flat.axis] if flat.sharded else 0


def _tensor_block(step):
    """Parameter name -> (its logical shape, where this rank's tensor-axis block starts in it).

    The flats hold tp-local blocks (Note [tp-local flats]); a checkpoint names global tensors, as
    DTensors on a 2-D mesh do, so every chunk of a block is placed at the block's start.
    """
    config = step.compiled.context.config
    shapes = {p.name: tuple(p.shape) for p in config.params}
    axis = config.tensor
    if axis is None:
        return lambda name: (shapes[name], (0,) * len(shapes[name]))
    at = step.compiled.context.world_mesh.coordinate(step.dist.rank)[axis.name]
    return lambda name: (shapes[name], axis.block_offsets(name, shapes[name], at))
