"""Job file: a small BERT-style masked language model on batches whose shapes vary, as real data does.

Run it with ``shardlang run examples/bert.py --nproc 4``, check it with
``shardlang check examples/bert.py`` (it passes at 1, 2 and 4 ranks), and read
the plan for the batch of any step with ``shardlang plan examples/bert.py
--world 4 --batch-step 2``.

The model is a post-LayerNorm encoder: token and position embeddings, a
LayerNorm, ``layers`` of bidirectional self-attention (separate ``query``,
``key`` and ``value`` projections, with biases, as BERT has) and a GELU MLP, and
an MLM head (a transform, a LayerNorm and a decoder tied to the token
embedding). Module names:

    tok_emb, pos_emb, ln_emb, layers.{i}.attn.{query,key,value,out}, layers.{i}.ln1,
    layers.{i}.mlp.{fc1,fc2}, layers.{i}.ln2, head.{transform,ln,decoder}

Two things make it a test of ``shardlang check``:

- The key biases get a gradient that is zero in exact arithmetic: ``q . b_k``
  is added to every score of a row, and softmax ignores a constant added to a
  row. They start at zero, so in both the sharded and the reference run they
  stay at rounding noise (about 1e-15 in float64), and a difference measured
  relative to the parameter's own size is 0.5 or more on a correct run (1.02).
  `check` measures at the scale of what training moves (docs/cli.md).
- The data is a finite set of ``DATASET`` sequences read in order, ``BATCH`` at
  a time, so every third step is the partial batch at the end of an epoch; the
  sequence length alternates between ``SEQ_LENS`` (sequences padded to the
  longest of their batch, bucketed). The step compiles once per shape
  (docs/training.md, "Batches of varying shape").

Each sequence counts up from a random start with a stride of 1, 2 or 3, so a
masked token is predictable from its neighbours. Exactly ``MASKED`` positions
of every row are masked, so every rank's mean loss averages the same number of
terms per row, and the mean of the ranks' means is the global mean (the
convention shardlang follows; docs/training.md).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

import shardlang as sl

DATASET = 20  # sequences per epoch: batches of 8, 8 and the partial 4
BATCH = 8
SEQ_LENS = (12, 20)  # step k's batch has length SEQ_LENS[k % 2]
MASKED = 3  # positions masked per row
MASK_ID = 0
IGNORE = -100
STRIDES = (1, 2, 3)


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Sizes of a small BERT. The defaults give the CI model (about 40K parameters, float64)."""

    vocab_size: int = 48
    max_len: int = 32
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    mlp_ratio: int = 4
    dtype: torch.dtype = torch.float64


class SelfAttention(nn.Module):
    """Bidirectional multi-head attention with separate query, key and value projections."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.query = nn.Linear(config.n_embd, config.n_embd, dtype=config.dtype)
        self.key = nn.Linear(config.n_embd, config.n_embd, dtype=config.dtype)
        self.value = nn.Linear(config.n_embd, config.n_embd, dtype=config.dtype)
        self.out = nn.Linear(config.n_embd, config.n_embd, dtype=config.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (proj(x).view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for proj in (self.query, self.key, self.value))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.n_embd, config.mlp_ratio * config.n_embd, dtype=config.dtype)
        self.fc2 = nn.Linear(config.mlp_ratio * config.n_embd, config.n_embd, dtype=config.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Layer(nn.Module):
    """Post-LayerNorm encoder layer: x = ln1(x + attn(x)); x = ln2(x + mlp(x))."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attn = SelfAttention(config)
        self.ln1 = nn.LayerNorm(config.n_embd, dtype=config.dtype)
        self.mlp = MLP(config)
        self.ln2 = nn.LayerNorm(config.n_embd, dtype=config.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.mlp(x))


class MLMHead(nn.Module):
    """transform -> GELU -> LayerNorm -> logits through the (tied) token embedding, plus a bias."""

    def __init__(self, config: BertConfig, embedding: nn.Embedding) -> None:
        super().__init__()
        self.transform = nn.Linear(config.n_embd, config.n_embd, dtype=config.dtype)
        self.ln = nn.LayerNorm(config.n_embd, dtype=config.dtype)
        self.decoder = nn.Linear(config.n_embd, config.vocab_size, dtype=config.dtype)
        self.decoder.weight = embedding.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.ln(F.gelu(self.transform(x))))


class Bert(nn.Module):
    """A BERT-style encoder with an MLM head.

    Example::

        model = Bert(BertConfig())
        logits = model(torch.zeros(2, 12, dtype=torch.long))   # (2, 12, vocab_size)
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd, dtype=config.dtype)
        self.pos_emb = nn.Embedding(config.max_len, config.n_embd, dtype=config.dtype)
        self.ln_emb = nn.LayerNorm(config.n_embd, dtype=config.dtype)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.n_layer))
        self.head = MLMHead(config, self.tok_emb)
        for module in self.modules():  # BERT's initialisation: N(0, 0.02) weights, zero biases
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.config.max_len:
            raise ValueError(f"Bert: sequence length {t} exceeds max_len={self.config.max_len}")
        x = self.ln_emb(self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device)))
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def make_sequences(epoch: int, rows: range, seq_len: int, vocab_size: int = BertConfig.vocab_size) -> torch.Tensor:
    """Rows ``rows`` of the dataset for ``epoch``: counting streams (tokens 1..vocab-1; 0 is the mask)."""
    out = []
    for row in rows:
        g = torch.Generator().manual_seed(1_000_003 * epoch + row)
        start = int(torch.randint(vocab_size - 1, (1,), generator=g))
        stride = STRIDES[int(torch.randint(len(STRIDES), (1,), generator=g))]
        out.append(1 + (start + stride * torch.arange(seq_len)) % (vocab_size - 1))
    return torch.stack(out)


def mask_tokens(tokens: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs with ``MASKED`` positions per row replaced by ``MASK_ID``, labels: the originals there, else -100)."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.stack([torch.randperm(tokens.shape[1], generator=g)[:MASKED] for _ in range(tokens.shape[0])])
    masked = torch.zeros_like(tokens, dtype=torch.bool).scatter_(1, positions, True)
    return tokens.masked_fill(masked, MASK_ID), tokens.masked_fill(~masked, IGNORE)


# ---- the job ---------------------------------------------------------------


def build_model() -> Bert:
    return Bert(BertConfig())


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean cross entropy over the masked positions."""
    inputs, labels = batch
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE)


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: ``(inputs, labels)``, int64, ``(rows, SEQ_LENS[step % 2])``.

    Batches read the dataset in order, so rows are 8, 8, 4, 8, 8, 4, ...
    (every size divides over 1, 2 and 4 ranks).
    """
    per_epoch = -(-DATASET // BATCH)
    epoch, index = divmod(step, per_epoch)
    rows = range(index * BATCH, min((index + 1) * BATCH, DATASET))
    tokens = make_sequences(epoch, rows, SEQ_LENS[step % len(SEQ_LENS)])
    return mask_tokens(tokens, seed=step)


spec = sl.Spec(mesh=sl.Mesh(fsdp=-1), units=["layers.*"])
optimizer = sl.AdamW(lr=3e-3, weight_decay=0.01)
