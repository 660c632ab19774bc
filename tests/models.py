"""Small, deterministic models and batches for parity tests, in plain PyTorch.

Each entry of ``CASES`` is a ``Case``: how to build the model (in float32 or
float64), its loss, the GLOBAL batch for a step (batch dim 8, so world sizes 1,
2 and 4 divide it), and the unit patterns to use (``None``: shardlang's default
units). Example::

    from models import CASES

    case = CASES["prime"]
    model = case.build(torch.float64)            # seeded: every call gives the same weights
    loss = case.loss_fn(model, case.make_batch(0, torch.float64))

The cases, and what each one stresses:

- ``mlp``: three Linear layers, one root unit (the baseline).
- ``gpt_tiny``: examples/gpt.py's GPT at tiny size: attention, LayerNorm, a tied
  head (``head.weight`` IS ``tok_emb.weight``), units ``blocks.*``.
- ``prime``: parameters of prime sizes (Embedding(11, 7), Linear(7, 13),
  LayerNorm(13), Linear(13, 5)) plus a 0-dim ``scale``: nothing divides by 2 or 4.
- ``frozen``: a frozen ``base`` Linear between a trainable ``adapter`` and
  ``head``; gradients must flow THROUGH the frozen weights.
- ``convnet_bn``: Conv2d + BatchNorm2d (train mode, running stats) + ReLU +
  pooling, then a Linear head; default units (``blocks.0``, ``blocks.1``).
  BatchNorm normalises over the batch it sees, so ``Case.batch_coupled`` is True:
  a rank's loss on its shard is NOT the global-batch loss restricted to it.
- ``llama_tiny``: examples/llama.py's Llama at its tiny size (whatever LLAMA_SIZE
  says): RMSNorm, rotary embeddings, grouped-query attention, SwiGLU, an untied
  head; units ``tok_embeddings``, ``layers.*``, ``output``.
- ``lora``: LoRA-style adapters (trainable rank-2 ``lora_a``/``lora_b``) on frozen
  ``base`` Linears, and a frozen head; default units ``layers.0``, ``layers.1``.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn

GLOBAL_BATCH = 8
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@attrs.frozen
class Case:
    """A test model: builder, loss, global batches, unit patterns.

    - ``builder()`` makes the model in float32; call ``build`` instead, which seeds
      the RNG (without disturbing the global one) and converts the dtype.
    - ``loss_fn(model, batch)`` is a scalar, mean-reduced over the batch.
    - ``batch_maker(step, dtype)`` is the GLOBAL batch; call ``make_batch``.
    - ``units``: unit patterns for ``sl.Spec(units=...)``; ``None`` means the default.
    - ``batch_coupled``: True when samples interact in the forward (BatchNorm), so the
      sharded loss equals the mean of per-shard reference losses, not the global one.
    """

    name: str
    builder: Callable[[], nn.Module]
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    batch_maker: Callable[[int, torch.dtype], Any]
    units: tuple[str, ...] | None = attrs.field(
        default=None, converter=lambda u: None if u is None else tuple(u)
    )
    batch_coupled: bool = False

    def build(self, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
        """The model with weights from ``torch.manual_seed(seed)``, in ``dtype``.

        Example: ``CASES["mlp"].build(torch.float64)``.
        """
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = self.builder()
        return model.to(dtype)

    def make_batch(self, step: int, dtype: torch.dtype = torch.float32) -> Any:
        """The global batch for ``step``; floating tensors in ``dtype``, indices int64.

        Example: ``CASES["mlp"].make_batch(3, torch.float64)``.
        """
        return self.batch_maker(step, dtype)


def _gen(step: int, salt: int) -> torch.Generator:
    """A generator for ``step``, distinct per case (``salt``) so cases do not share data."""
    return torch.Generator().manual_seed(1_000_003 * salt + step)


# ---- mlp -------------------------------------------------------------------


class MLP(nn.Module):
    """16 -> 32 -> 32 -> 4 with tanh."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def mlp() -> nn.Module:
    return MLP()


def mse_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def _regression_batch(step: int, dtype: torch.dtype, salt: int, d_in: int, d_out: int):
    g = _gen(step, salt)
    x = torch.randn(GLOBAL_BATCH, d_in, generator=g, dtype=torch.float64)
    noise = torch.randn(GLOBAL_BATCH, d_out, generator=g, dtype=torch.float64)
    y = torch.sin(x[:, :d_out] * 2.0) + 0.1 * noise
    return x.to(dtype), y.to(dtype)


def mlp_batch(step: int, dtype: torch.dtype = torch.float32):
    """``(x, y)``: x (8, 16), y (8, 4)."""
    return _regression_batch(step, dtype, salt=1, d_in=16, d_out=4)


# ---- gpt_tiny --------------------------------------------------------------


def load_example(stem: str):
    """examples/<stem>.py as a module (loaded once). The examples import shardlang at their top."""
    name = f"_shardlang_examples_{stem}"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{stem}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return module


def load_gpt_module():
    """examples/gpt.py as a module (loaded once)."""
    return load_example("gpt")


GPT_TINY = dict(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16)


def gpt_tiny() -> nn.Module:
    """examples/gpt.py's GPT with ``GPT_TINY`` sizes."""
    return load_gpt_module().make_gpt(**GPT_TINY)


def gpt_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return load_gpt_module().lm_loss(model, tokens)


def gpt_batch(step: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int64 tokens (8, 17); ``dtype`` is unused (there are no float inputs)."""
    return load_gpt_module().make_tokens(
        step, batch_size=GLOBAL_BATCH, seq_len=GPT_TINY["block_size"], vocab_size=GPT_TINY["vocab_size"]
    )


# ---- llama_tiny ------------------------------------------------------------


def load_llama_module():
    """examples/llama.py as a module (loaded once)."""
    return load_example("llama")


def llama_tiny() -> nn.Module:
    """examples/llama.py's Llama at the tiny size (``LlamaConfig()``), whatever LLAMA_SIZE says."""
    llama = load_llama_module()
    return llama.Llama(llama.LlamaConfig())


def llama_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return load_llama_module().loss_fn(model, tokens)


def llama_batch(step: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int64 tokens (8, 33); ``dtype`` is unused (there are no float inputs)."""
    llama = load_llama_module()
    config = llama.LlamaConfig()
    return llama.make_tokens(step, GLOBAL_BATCH, config.max_seq_len, config.vocab_size)


# ---- prime -----------------------------------------------------------------


class PrimeModel(nn.Module):
    """Every parameter has prime-sized dims; ``scale`` is a 0-dim parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 7)
        self.fc1 = nn.Linear(7, 13)
        self.norm = nn.LayerNorm(13)
        self.fc2 = nn.Linear(13, 5)
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids).mean(dim=1)
        return self.scale * self.fc2(torch.tanh(self.norm(self.fc1(h))))


def prime_model() -> nn.Module:
    return PrimeModel()


def prime_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch["ids"]), batch["target"])


def prime_batch(step: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """``{"ids": int64 (8, 3) in [0, 11), "target": (8, 5)}``."""
    g = _gen(step, salt=3)
    ids = torch.randint(11, (GLOBAL_BATCH, 3), generator=g)
    target = torch.randn(GLOBAL_BATCH, 5, generator=g, dtype=torch.float64)
    return {"ids": ids, "target": target.to(dtype)}


# ---- frozen ----------------------------------------------------------------


class FrozenPartModel(nn.Module):
    """x + adapter(x) -> frozen base -> GELU -> head. Only ``base`` is frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.adapter = nn.Linear(12, 12)
        self.base = nn.Linear(12, 12)
        self.head = nn.Linear(12, 3)
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.base(x + self.adapter(x))))


def frozen_part_model() -> nn.Module:
    return FrozenPartModel()


def frozen_batch(step: int, dtype: torch.dtype = torch.float32):
    """``(x, y)``: x (8, 12), y (8, 3)."""
    return _regression_batch(step, dtype, salt=4, d_in=12, d_out=3)


# ---- convnet_bn ------------------------------------------------------------


class ConvBlock(nn.Module):
    """Conv2d(3x3, no bias) -> BatchNorm2d -> ReLU."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, kernel_size=3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class ConvNetBN(nn.Module):
    """(8, 3, 8, 8) images -> ConvBlock -> max-pool -> ConvBlock -> global average pool -> Linear(16, 10)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ConvBlock(3, 8), ConvBlock(8, 16)])
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(self.blocks[0](x), 2)
        x = self.blocks[1](x)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def convnet_bn() -> nn.Module:
    return ConvNetBN()


def classify_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, labels = batch
    return F.cross_entropy(model(x), labels)


def convnet_batch(step: int, dtype: torch.dtype = torch.float32):
    """``(images (8, 3, 8, 8), labels int64 (8,) in [0, 10))``."""
    g = _gen(step, salt=5)
    x = torch.randn(GLOBAL_BATCH, 3, 8, 8, generator=g, dtype=torch.float64)
    labels = torch.randint(10, (GLOBAL_BATCH,), generator=g)
    return x.to(dtype), labels


# ---- lora ------------------------------------------------------------------


class LoRALinear(nn.Module):
    """A frozen ``base`` Linear plus a trainable low-rank update: ``base(x) + (alpha / r) * B(A(x))``.

    Real LoRA starts ``B`` at zero; here both factors are small and random, so
    the first step already moves both (a stronger parity test).
    """

    def __init__(self, d_in: int, d_out: int, rank: int = 2, alpha: float = 4.0) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.lora_a = nn.Linear(d_in, rank, bias=False)
        self.lora_b = nn.Linear(rank, d_out, bias=False)
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * self.lora_b(self.lora_a(x))


class LoRAModel(nn.Module):
    """Two LoRA layers (16 -> 16, rank 2) and a frozen head (16 -> 4): 3% of the parameters train."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([LoRALinear(16, 16), LoRALinear(16, 16)])
        self.head = nn.Linear(16, 4)
        self.head.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def lora_model() -> nn.Module:
    return LoRAModel()


def lora_batch(step: int, dtype: torch.dtype = torch.float32):
    """``(x, y)``: x (8, 16), y (8, 4)."""
    return _regression_batch(step, dtype, salt=6, d_in=16, d_out=4)


# ---- the table -------------------------------------------------------------

CASES: dict[str, Case] = {
    c.name: c
    for c in (
        Case("mlp", mlp, mse_loss, mlp_batch),
        Case("gpt_tiny", gpt_tiny, gpt_loss, gpt_batch, units=("blocks.*",)),
        Case("llama_tiny", llama_tiny, llama_loss, llama_batch, units=("tok_embeddings", "layers.*", "output")),
        Case("prime", prime_model, prime_loss, prime_batch),
        Case("frozen", frozen_part_model, mse_loss, frozen_batch, units=("adapter", "base", "head")),
        Case("convnet_bn", convnet_bn, classify_loss, convnet_batch, batch_coupled=True),
        Case("lora", lora_model, mse_loss, lora_batch),
    )
}
