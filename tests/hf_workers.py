"""Worker functions for test_huggingface.py: Hugging Face models built on meta, loaded from `save_pretrained`.

A module of its own (not a test file) because the local launcher's workers
import worker functions by name. ``transformers`` is imported inside the
functions: the test file skips, with a reason, where it is not installed.

Each model is built from a small config with dropout off (so one process and N
ranks compute the same function), in float64, and trained on a language-model
loss over random tokens: every position predicts the next token.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardlang as sl
from shardlang.step.batch import split_batch
from shardlang.step.ownership import convert_floating

VOCAB = 96
GLOBAL_BATCH = 4
SEQ = 12
LR = 1e-2
UNITS = {"llama": "model.layers.*", "gpt2": "transformer.h.*", "bert": "bert.encoder.layer.*"}


def config(name: str):
    """A small config of model ``name`` with dropout off."""
    import transformers as tf

    if name == "llama":
        return tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if name == "gpt2":
        return tf.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                             embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    if name == "bert":
        return tf.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                             attention_probs_dropout_prob=0.0)
    raise ValueError(name)


def model_class(name: str):
    import transformers as tf

    return {"llama": tf.LlamaForCausalLM, "gpt2": tf.GPT2LMHeadModel, "bert": tf.BertForMaskedLM}[name]


def save_pretrained(name: str, directory: str) -> str:
    """A freshly initialised model ``name`` written by ``save_pretrained`` in several shards with an index."""
    torch.manual_seed(1234)
    model_class(name)(config(name)).save_pretrained(directory, max_shard_size="40KB")
    return directory


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)


def loss_fn(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def train_sharded(ctx, name: str, directory: str, steps: int):
    """Build on meta (no job code: the model's own initialiser and the directory as written), train ``steps``
    steps: (global losses, full parameters on rank 0)."""
    with torch.device("meta"):
        model = model_class(name)(config(name))
    convert_floating(model, torch.float64)
    spec = sl.Spec(mesh=sl.Mesh(fsdp=-1), units=[UNITS[name]])
    step = sl.compile(model, loss_fn, spec, optimizer=sl.AdamW(lr=LR), dist_context=ctx,
                      example_batch=split_batch(batch(0), ctx.world_size, ctx.rank), weights=directory)
    losses = []
    for k in range(steps):
        loss = step(split_batch(batch(k), ctx.world_size, ctx.rank)).detach().double().clone()
        if ctx.has_process_group:
            dist.all_reduce(loss)
            loss /= ctx.world_size
        losses.append(float(loss))
    params = step.full_parameters()
    return losses, (params if ctx.is_main else None)


def train_reference(name: str, directory: str, steps: int):
    """``from_pretrained`` + ``torch.optim.AdamW`` in one process: (losses, parameters)."""
    model = model_class(name).from_pretrained(directory, dtype=torch.float64)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for k in range(steps):
        opt.zero_grad()
        loss = loss_fn(model, batch(k))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
