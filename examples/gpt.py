"""Job file: a small GPT-style language model on synthetic, learnable token streams.

Run it with ``shardlang run examples/gpt.py --nproc 4`` or read its plan with
``shardlang plan examples/gpt.py --world 64``. ``GPT_SIZE=100M`` selects the
100M-parameter GPT of the benchmarks (read at import, like ``LLAMA_SIZE`` in
examples/llama.py).

The model is the usual pre-LayerNorm decoder: token and position embeddings,
``blocks`` of causal self-attention and a GELU MLP, a final LayerNorm, and an LM
head whose weight is the token embedding's (tied). Module names:

    tok_emb, pos_emb, blocks.{i}.ln1, blocks.{i}.attn, blocks.{i}.ln2, blocks.{i}.mlp, ln_f, head

Because the head is tied, ``model.named_parameters()`` lists that weight once, as
``tok_emb.weight``. The default size is tiny (about 106K parameters) so the example
runs in CI; ``make_gpt`` builds bigger ones, e.g.
``make_gpt(n_layer=6, n_embd=384, n_head=6, vocab_size=8192, block_size=256)``.

The job builds the model on the meta device (``build_model``): no rank ever holds
it whole. Each rank materialises its shards unit by unit, initialising every
module with ``reset_parameters()`` (LayerNorm) and then the job's ``init_weights``
(GPT-2's: normal(0, 0.02) weights, zero biases, residual projections scaled by
``1/sqrt(2 * n_layer)``), under a seed per module (docs/large_models.md).
``make_gpt()`` outside a meta context builds and initialises it eagerly, as before.

The data: each sequence counts upward from a random start with a per-sequence
stride of 1, 2 or 3 (mod the vocabulary), and about one token in ten is replaced
by noise. The next token is predictable from the previous two, so the loss falls
well below ``log(vocab_size)`` within a few dozen steps.
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

import shardlang as sl

GLOBAL_BATCH = 8  # a multiple of 4, so world sizes 1, 2 and 4 divide it
NOISE = 0.1  # fraction of tokens replaced by uniform noise
STRIDES = (1, 2, 3)


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Sizes of a GPT. The defaults give the tiny CI model (~106K parameters).

    Example: ``GPTConfig(n_layer=4, n_embd=128)``.
    """

    vocab_size: int = 64
    block_size: int = 32  # the longest sequence the position embedding covers
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig: n_embd={self.n_embd} must be a multiple of n_head={self.n_head}"
            )


def residual_std(config: GPTConfig) -> float:
    """GPT-2's init std for the projections into the residual stream: 0.02 scaled down with depth."""
    return 0.02 / math.sqrt(2 * config.n_layer)


def init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation of one module; shardlang calls it on every module of a meta-built GPT.

    Linear and Embedding weights ~ normal(0, std), std 0.02 unless the module
    carries its own ``init_std`` (the residual projections); Linear biases zero.
    LayerNorm keeps its ``reset_parameters()`` (ones and zeros), which runs first.
    """
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=getattr(module, "init_std", 0.02))
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``scaled_dot_product_attention``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.proj.init_std = residual_std(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    """Two linear layers with a GELU between them."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, config.mlp_ratio * config.n_embd)
        self.proj = nn.Linear(config.mlp_ratio * config.n_embd, config.n_embd)
        self.proj.init_std = residual_std(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """A pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A decoder-only transformer whose LM head is tied to the token embedding.

    Example::

        model = GPT(GPTConfig())
        logits = model(torch.zeros(2, 16, dtype=torch.long))   # (2, 16, vocab_size)
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        self.apply(init_weights)  # eager construction; on meta a no-op, and shardlang calls init_weights per module

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.config.block_size:
            raise ValueError(f"GPT: sequence length {t} exceeds block_size={self.config.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def make_gpt(**config_overrides) -> GPT:
    """A GPT with ``GPTConfig`` defaults replaced by ``config_overrides``.

    Example: ``make_gpt(n_layer=4)``. The caller seeds the RNG (shardlang's job
    loader calls ``torch.manual_seed`` before ``build_model``).
    """
    return GPT(GPTConfig(**config_overrides))


def make_tokens(
    step: int,
    batch_size: int = GLOBAL_BATCH,
    seq_len: int = GPTConfig.block_size,
    vocab_size: int = GPTConfig.vocab_size,
) -> torch.Tensor:
    """Synthetic token streams for ``step``: shape ``(batch_size, seq_len + 1)``, int64.

    Each row is ``start + stride * i (mod vocab_size)`` with a per-row stride from
    ``STRIDES``, and a fraction ``NOISE`` of positions replaced by random tokens.
    Deterministic: the same arguments give the same tensor.
    """
    g = torch.Generator().manual_seed(step)
    n = seq_len + 1
    start = torch.randint(vocab_size, (batch_size, 1), generator=g)
    stride = torch.tensor(STRIDES)[torch.randint(len(STRIDES), (batch_size, 1), generator=g)]
    tokens = (start + stride * torch.arange(n)) % vocab_size
    noise = torch.randint(vocab_size, (batch_size, n), generator=g)
    return torch.where(torch.rand(batch_size, n, generator=g) < NOISE, noise, tokens)


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of predicting ``tokens[:, 1:]`` from ``tokens[:, :-1]``."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


# ---- the job ---------------------------------------------------------------


#: Named sizes; ``GPT_SIZE=10M`` / ``100M`` select the benchmarks' GPTs (docs/large_models.md measures the 100M).
SIZES = {
    "tiny": GPTConfig(),
    "10M": GPTConfig(vocab_size=8192, block_size=64, n_layer=6, n_head=5, n_embd=320),
    "100M": GPTConfig(vocab_size=16384, block_size=64, n_layer=12, n_head=12, n_embd=768),
}


def size_from_env(env=os.environ) -> GPTConfig:
    """The config named by ``GPT_SIZE`` (default ``tiny``); an unknown name is an error listing the valid ones."""
    name = env.get("GPT_SIZE", "tiny").strip()
    if name not in SIZES:
        raise sl.SpecError(f"environment variable GPT_SIZE={name!r} is not a size of examples/gpt.py; "
                           f"valid sizes are {sorted(SIZES)}")
    return SIZES[name]


CONFIG = size_from_env()  # read once at import, so every rank and check's reference see the same model


def build_model() -> GPT:
    """The GPT of ``GPT_SIZE`` (tiny: ~106K parameters) on the meta device: shardlang materialises it unit by unit."""
    with torch.device("meta"):
        return GPT(CONFIG)


def loss_fn(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, averaged over every position of the (per-rank) batch."""
    return lm_loss(model, batch)


def make_batch(step: int) -> torch.Tensor:
    """The global batch for ``step``: ``(8, block_size + 1)`` int64 tokens (inputs and shifted targets)."""
    return make_tokens(step, seq_len=CONFIG.block_size, vocab_size=CONFIG.vocab_size)


spec = sl.Spec(mesh=sl.Mesh(fsdp=-1), rules=[("*", sl.shard("fsdp"))], units=["blocks.*"])
optimizer = sl.AdamW(lr=3e-3, weight_decay=0.01)
