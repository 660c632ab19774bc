"""Worker functions for test_materialize.py: models built on the meta device, and pretrained weights.

A module of its own (not a test file) because the local launcher's workers
import worker functions by name.

Meta cases (``META_CASES``): the parity cases built under ``torch.device("meta")``
(``gpt_tiny``: tied head; ``convnet_bn``: BatchNorm buffers; ``frozen``: a frozen
Linear), and ``hf_style``, a model initialised the way Hugging Face models are:
no reliance on ``reset_parameters`` order, a ``_init_weights(module)`` method
reading ``config.initializer_range``, a tied LM head, and a custom module with a
raw parameter (``ScaleNorm.gain``) that only ``_init_weights`` knows.
"""

from __future__ import annotations

import attrs
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardlang as sl
from shardlang.step.batch import split_batch
from shardlang.step.materialize import Init, materialize_module

import parity
from models import CASES, GLOBAL_BATCH, Case, _gen
from parity import DTYPES, OPTIMIZERS


@attrs.frozen
class HFConfig:
    vocab_size: int = 24
    hidden: int = 12
    layers: int = 2
    initializer_range: float = 0.05


class ScaleNorm(nn.Module):
    """x / rms(x) * gain: a raw parameter and no reset_parameters (only the model's _init_weights sets it)."""

    def __init__(self, dim: int):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.gain


class HFLayer(nn.Module):
    def __init__(self, config: HFConfig):
        super().__init__()
        self.norm = ScaleNorm(config.hidden)
        self.up = nn.Linear(config.hidden, 2 * config.hidden)
        self.down = nn.Linear(2 * config.hidden, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class HFStyleLM(nn.Module):
    """What ``transformers.PreTrainedModel`` subclasses look like, small: ``post_init`` applies ``_init_weights``."""

    def __init__(self, config: HFConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden)
        self.layers = nn.ModuleList(HFLayer(config) for _ in range(config.layers))
        self.norm = ScaleNorm(config.hidden)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        self.lm_head.weight = self.embed.weight  # tie_word_embeddings
        self.apply(self._init_weights)  # post_init(); a no-op on meta

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.data.zero_()
        if isinstance(module, ScaleNorm):
            module.gain.data.fill_(1.0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def hf_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def hf_batch(step: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randint(HFConfig().vocab_size, (GLOBAL_BATCH, 9), generator=_gen(step, salt=7))


HF_CASE = Case("hf_style", lambda: HFStyleLM(HFConfig()), hf_loss, hf_batch, units=("layers.*",))
META_CASES = {name: CASES[name] for name in ("gpt_tiny", "convnet_bn", "frozen")} | {"hf_style": HF_CASE}


def meta_model(case_name: str, dtype: str) -> nn.Module:
    with torch.device("meta"):
        model = META_CASES[case_name].builder()
    return model.to(DTYPES[dtype])


def init_weights_of(case_name: str, model: nn.Module):
    """The case's ``init_weights``: HF-style models initialise through their ``_init_weights``."""
    return model._init_weights if case_name == "hf_style" else None


def spec_variant(case: Case, world_size: int, variant: str) -> sl.Spec:
    """Specs that must all start from the same weights (Note [initial values])."""
    if variant == "units":
        return sl.Spec(mesh=sl.Mesh(fsdp=world_size), units=case.units)
    if variant == "root_only":  # one unit: everything materialised at once
        return sl.Spec(mesh=sl.Mesh(fsdp=world_size), units=[])
    if variant == "zero1":  # another strategy: every rank holds the whole flat parameter
        return sl.Spec(mesh=sl.Mesh(fsdp=world_size), units=case.units, strategies=[("*", sl.ZeRO1)])
    if variant == "dim0":  # pieces along dim 0 instead of flat slices
        return sl.Spec(mesh=sl.Mesh(fsdp=world_size), rules=[("*", sl.shard("fsdp", dim=0))], units=case.units)
    raise ValueError(variant)


def train_meta(ctx, case_name: str, optimizer: str, dtype: str, steps: int, variant: str = "units",
               weights: str | None = None):
    """Build on meta, compile (materialising, or loading ``weights``), train: (losses, params, buffers); params
    and buffers on rank 0 only."""
    case = META_CASES[case_name]
    model = meta_model(case_name, dtype)
    example = split_batch(case.make_batch(0, DTYPES[dtype]), ctx.world_size, ctx.rank)
    step = sl.compile(model, case.loss_fn, spec_variant(case, ctx.world_size, variant),
                      optimizer=OPTIMIZERS[optimizer][0](), example_batch=example, dist_context=ctx,
                      init_seed=0, init_weights=init_weights_of(case_name, model), weights=weights)
    losses = []
    for k in range(steps):
        losses.append(float(step(split_batch(case.make_batch(k, DTYPES[dtype]), ctx.world_size, ctx.rank))))
    params = step.full_parameters()
    buffers = {k: v.clone() for k, v in step.full_buffers().items()}
    return (losses, params, buffers) if ctx.is_main else (losses, None, None)


def reference(case_name: str, optimizer: str, dtype: str, steps: int, weights: str | None = None):
    """One process: materialise the whole meta model the same way (or load_state_dict the weights), torch.optim."""
    case, dt = META_CASES[case_name], DTYPES[dtype]
    if weights is None:
        model = meta_model(case_name, dtype)
        materialize_module(model, Init(seed=0, init_weights=init_weights_of(case_name, model)))
    else:
        model = case.build(dt, seed=99)  # other values, overwritten by the file
        missing, unexpected = model.load_state_dict(load_tensors(weights), strict=False)
        assert not unexpected and set(missing) <= tied_names(model), (missing, unexpected)
    return train_torch(case, model, optimizer, dt, steps)


def train_torch(case, model, optimizer: str, dt, steps: int):
    opt = OPTIMIZERS[optimizer][1]([p for p in model.parameters() if p.requires_grad])
    losses = []
    for k in range(steps):
        opt.zero_grad()
        loss = case.loss_fn(model, case.make_batch(k, dt))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, dict(model.named_buffers())


def tied_names(model: nn.Module) -> set[str]:
    """Every name of a tied parameter (``tok_emb.weight`` and ``head.weight``): a file need hold only one."""
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return {n for group in names.values() if len(group) > 1 for n in group}


def load_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file or a directory of them (the HF layout), by name."""
    from pathlib import Path

    from safetensors.torch import load_file

    p = Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    return {k: v for f in files for k, v in load_file(str(f)).items()}


def save_pretrained(case_name: str, dtype: str, directory: str, sharded: bool) -> str:
    """Save a trained-looking model of the case: one file, or the HF layout (two files and an index).

    Tied parameters are saved once, under their LAST name (``head.weight``),
    as Hugging Face does for GPT-2, so the loader must map aliases.
    """
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    model = META_CASES[case_name].build(DTYPES[dtype], seed=7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))  # values no initialisation would give
        for b in model.buffers():
            b.add_(torch.rand_like(b) if b.is_floating_point() else 3)  # BatchNorm statistics too (variance > 0)
    last_name = {id(t): n for n, t in model.named_parameters(remove_duplicate=False)}
    tensors = {last_name[id(p)]: p.detach().clone().contiguous() for p in model.parameters()}
    tensors |= {n: b.detach().clone() for n, b in model.named_buffers()}
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    if not sharded:
        save_file(tensors, str(out / "model.safetensors"))
        return str(out / "model.safetensors")
    names = list(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    weight_map = {}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, str(out / file))
        weight_map |= {n: file for n in part}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return str(out)


def materialise_peak(ctx, case_name: str, variant: str):
    """The most parameter and buffer elements the model held at once while this rank materialised it.

    Sampled by an ``init_weights`` probe, called on every module while its unit is allocated.
    Returns (peak elements held by the model, the largest unit's elements, the whole model's elements).
    """
    case = META_CASES[case_name]
    model = meta_model(case_name, "float32")
    held = []
    inner = init_weights_of(case_name, model)

    def probe(module):
        if inner is not None:
            inner(module)
        seen = {id(t): t.numel() for t in (*model.parameters(), *model.buffers()) if not t.is_meta}
        held.append(sum(seen.values()))

    example = split_batch(case.make_batch(0), ctx.world_size, ctx.rank)
    step = sl.compile(model, case.loss_fn, spec_variant(case, ctx.world_size, variant), example_batch=example,
                      dist_context=ctx, init_weights=probe)
    by_unit: dict[str, int] = {}
    for f in step.compiled.flats:
        by_unit[f.unit] = by_unit.get(f.unit, 0) + f.numel
    whole = sum(f.numel for f in step.compiled.flats)
    return max(held), max(by_unit.values()), whole


def compile_twice_after_release(ctx, case_name: str):
    """Compile a meta model, then compile the released module again (it must still trace): rank 0's two states."""
    case = META_CASES[case_name]
    model = meta_model(case_name, "float64")
    example = split_batch(case.make_batch(0, torch.float64), ctx.world_size, ctx.rank)
    spec = spec_variant(case, ctx.world_size, "units")
    first = sl.compile(model, case.loss_fn, spec, example_batch=example, dist_context=ctx)
    second = sl.compile(model, case.loss_fn, spec, example_batch=example, dist_context=ctx)
    return [t.clone() for t in first.flat_tensors], [t.clone() for t in second.flat_tensors]


def state_dict_on_rank0(ctx, case_name: str, hybrid: bool = False):
    """``full_state_dict()`` on every rank after one step: (its result, ``full_parameters()``, the collectives
    ``full_state_dict`` issued on this rank, by name). ``hybrid``: a 2 x N/2 replicate x fsdp mesh."""
    from unittest import mock

    case = META_CASES[case_name]
    model = meta_model(case_name, "float64")
    example = split_batch(case.make_batch(0, torch.float64), ctx.world_size, ctx.rank)
    spec = (sl.Spec(mesh=sl.Mesh(replicate=2, fsdp=ctx.world_size // 2), units=case.units) if hybrid
            else spec_variant(case, ctx.world_size, "units"))
    step = sl.compile(model, case.loss_fn, spec, example_batch=example, dist_context=ctx)
    step(example)
    all_gather = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"  # torch 2.13
    with mock.patch.object(dist, "gather", wraps=dist.gather) as gathers, \
            mock.patch.object(dist, all_gather, wraps=getattr(dist, all_gather)) as all_gathers:
        sd = step.full_state_dict()
    issued = {"gather": gathers.call_count, "all_gather": all_gathers.call_count}
    return sd, step.full_parameters(), issued


