"""Job file: a Llama-style decoder (RMSNorm, rotary embeddings, SwiGLU, grouped-query attention, untied head).

Run the tiny size with ``shardlang run examples/llama.py --nproc 2``, check it with
``shardlang check examples/llama.py --world-sizes 1,2,4``, and plan a real shape with
``LLAMA_SIZE=70b shardlang plan examples/llama.py --world 1024``.

The size comes from the environment variable ``LLAMA_SIZE`` (read when the job file
is imported, so every rank and the reference see the same one):

    tiny   2 layers, d=64, 4 heads, 2 KV heads, ffn 160, vocab 64, seq 32 (~100K parameters; the default, for CI)
    1b     Llama-3.2-1B's shape: 16 layers, d=2048, 32 heads, 8 KV heads, ffn 8192, vocab 128256, seq 4096
    8b     Llama-3-8B:           32 layers, d=4096, 32 heads, 8 KV heads, ffn 14336, vocab 128256, seq 4096
    70b    Llama-3-70B:          80 layers, d=8192, 64 heads, 8 KV heads, ffn 28672, vocab 128256, seq 4096

(1b keeps its head untied, like every size here, so it has 1.50B parameters rather than
Llama-3.2-1B's 1.24B.) ``LLAMA_BATCH`` sets the global batch in sequences: 8 for tiny,
1024 for the others (one 4096-token sequence per rank at 1024 ranks, 4M tokens a step,
Llama 3's batch); it must divide by the world size. ``LLAMA_SEQ`` sets the sequence length
in tokens (torchtitan's Llama 3 8B setting trains at 8192).

Module names (the spec's rules and units refer to them):

    tok_embeddings, layers.{i}.attention_norm, layers.{i}.attention.{wq,wk,wv,wo},
    layers.{i}.ffn_norm, layers.{i}.feed_forward.{w1,w2,w3}, norm, output

Every module that owns parameters has ``reset_parameters()`` (``nn.Linear``,
``nn.Embedding`` and ``nn.RMSNorm`` do), so the model can be built on the meta device
and initialised unit by unit. The rotary table is computed in ``forward`` from the
positions, not held in a buffer: the model has no buffers at all.

The data is the synthetic counting streams of ``examples/gpt.py``: each sequence
counts upward from a random start with a stride of 1, 2 or 3 (mod the vocabulary),
with one token in ten replaced by noise, so the tiny model's loss falls within a few
dozen steps. ``make_eval_batch`` is a fixed held-out batch of the same streams, for
``shardlang run examples/llama.py --nproc 2 --steps 30 --eval-every 10``.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.nn.functional as F
from torch import nn

import shardlang as sl

NOISE = 0.1  # fraction of tokens replaced by uniform noise
STRIDES = (1, 2, 3)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Sizes of a Llama. The defaults give the tiny CI model.

    Example: ``LlamaConfig(n_layers=4, dim=128, n_heads=8, n_kv_heads=2, ffn_dim=352)``.
    """

    vocab_size: int = 64
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 160
    max_seq_len: int = 32
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"LlamaConfig: dim={self.dim} must be a multiple of n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"LlamaConfig: n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"LlamaConfig: the head size dim/n_heads={self.dim // self.n_heads} must be even "
                             "(rotary embeddings rotate pairs)")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def n_params(self) -> int:
        """The number of parameters of a model of this shape (head untied)."""
        kv = self.n_kv_heads * self.head_dim
        attention = 2 * self.dim * self.dim + 2 * self.dim * kv
        layer = attention + 3 * self.dim * self.ffn_dim + 2 * self.dim
        return self.n_layers * layer + 2 * self.vocab_size * self.dim + self.dim


SIZES = {
    "tiny": LlamaConfig(),
    "1b": LlamaConfig(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                      max_seq_len=4096),
    "8b": LlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                      max_seq_len=4096),
    "70b": LlamaConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                       max_seq_len=4096),
}
DEFAULT_BATCH = {"tiny": 8}  # global batch in sequences; the big sizes use 1024


def size_from_env(env=os.environ) -> str:
    """The size named by ``LLAMA_SIZE`` (default ``tiny``); an unknown name is an error listing the valid ones."""
    name = env.get("LLAMA_SIZE", "tiny").strip().lower()
    if name not in SIZES:
        raise sl.SpecError(f"environment variable LLAMA_SIZE={env['LLAMA_SIZE']!r} is not a size of "
                           f"examples/llama.py; expected one of {', '.join(SIZES)}")
    return name


def batch_from_env(size: str, env=os.environ) -> int:
    """The global batch (sequences) from ``LLAMA_BATCH``, else the size's default."""
    return _positive_from_env(env, "LLAMA_BATCH", DEFAULT_BATCH.get(size, 1024), "a batch size",
                              "sequences per global batch", 8)


def seq_from_env(size: str, env=os.environ) -> int:
    """The sequence length (tokens) from ``LLAMA_SEQ``, else the size's own."""
    return _positive_from_env(env, "LLAMA_SEQ", SIZES[size].max_seq_len, "a sequence length",
                              "tokens per sequence", 8192)


def _positive_from_env(env, name: str, default: int, what: str, unit: str, example: int) -> int:
    """The integer >= 1 in environment variable ``name``, else ``default``; a `SpecError` naming it otherwise."""
    raw = env.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise sl.SpecError(f"environment variable {name}={raw!r} is not {what}; "
                           f"expected an integer >= 1 ({unit}), e.g. {name}={example}")
    return value


def rotary_tables(seq_len: int, head_dim: int, theta: float, dtype: torch.dtype, device=None):
    """cos and sin of the rotation angles, each ``(seq_len, head_dim / 2)``: position t, pair i turns by t * theta^(-2i/d)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of ``x`` ``(batch, heads, seq, head_dim)`` by the angles in cos/sin (Llama's layout)."""
    pairs = x.unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    """Causal grouped-query attention: ``n_kv_heads`` key/value heads, each shared by ``n_heads / n_kv_heads`` queries."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # Each KV head serves n_heads / n_kv_heads query heads. Repeated here: the same as
        # sdpa's enable_gqa=True (tests/test_llama.py), without depending on which kernels take it.
        repeat = self.n_heads // self.n_kv_heads
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attention(norm(x))``, then ``h + feed_forward(norm(h))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """A Llama-3-style decoder with an untied output head.

    Example::

        model = Llama(LlamaConfig())
        logits = model(torch.zeros(2, 16, dtype=torch.long))   # (2, 16, vocab_size)
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.config.max_seq_len:
            raise ValueError(f"Llama: sequence length {t} exceeds max_seq_len={self.config.max_seq_len}")
        x = self.tok_embeddings(tokens)
        cos, sin = rotary_tables(t, self.config.head_dim, self.config.rope_theta, x.dtype, x.device)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))


def make_tokens(step: int, batch_size: int, seq_len: int, vocab_size: int) -> torch.Tensor:
    """Synthetic token streams for ``step``: ``(batch_size, seq_len + 1)`` int64, the same for the same arguments."""
    g = torch.Generator().manual_seed(step)
    n = seq_len + 1
    start = torch.randint(vocab_size, (batch_size, 1), generator=g)
    stride = torch.tensor(STRIDES)[torch.randint(len(STRIDES), (batch_size, 1), generator=g)]
    tokens = (start + stride * torch.arange(n)) % vocab_size
    noise = torch.randint(vocab_size, (batch_size, n), generator=g)
    return torch.where(torch.rand(batch_size, n, generator=g) < NOISE, noise, tokens)


# ---- the job ---------------------------------------------------------------

SIZE = size_from_env()
CONFIG = dataclasses.replace(SIZES[SIZE], max_seq_len=seq_from_env(SIZE))
GLOBAL_BATCH = batch_from_env(SIZE)


def build_model() -> Llama:
    """The Llama of ``LLAMA_SIZE`` (default tiny), built on the meta device.

    No rank ever holds it whole: shardlang materialises it one unit at a time,
    through each module's ``reset_parameters()`` (docs/large_models.md).
    """
    with torch.device("meta"):
        return Llama(CONFIG)


def loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over every position of the (per-rank) batch."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def make_batch(step: int) -> torch.Tensor:
    """The global batch for ``step``: ``(GLOBAL_BATCH, max_seq_len + 1)`` int64 tokens."""
    return make_tokens(step, GLOBAL_BATCH, CONFIG.max_seq_len, CONFIG.vocab_size)


VALIDATION_SEED = 1_000_000  # far from every training step's seed


def make_eval_batch(step: int) -> torch.Tensor:
    """The validation batch for ``shardlang run --eval-every K``: the same held-out streams whatever ``step``."""
    return make_tokens(VALIDATION_SEED, GLOBAL_BATCH, CONFIG.max_seq_len, CONFIG.vocab_size)


spec = sl.Spec(mesh=sl.Mesh(fsdp=-1), rules=[("*", sl.shard("fsdp"))],
               units=["tok_embeddings", "layers.*", "output"])
optimizer = sl.AdamW(lr=3e-3 if SIZE == "tiny" else 3e-4, weight_decay=0.1)
