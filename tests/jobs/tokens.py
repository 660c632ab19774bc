"""A job on prepared token data (tests/test_data.py): a tiny GPT over the data's vocabulary.

``SHARDLANG_TEST_DATA`` is the prepared directory; ``SHARDLANG_TEST_VOCAB`` overrides the
model's vocabulary (to test data whose vocabulary is larger than the embedding).
"""

import os
import sys
from pathlib import Path

import torch

import shardlang as sl

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import GPT, GPTConfig, init_weights, lm_loss  # noqa: E402,F401  (init_weights: the job's)

make_batch = sl.data.tokens(os.environ["SHARDLANG_TEST_DATA"], seq_len=16, global_batch=8, seed=3)
make_eval_batch = sl.data.tokens(os.environ["SHARDLANG_TEST_DATA"], seq_len=16, global_batch=8, split="val")
VOCAB = int(os.environ.get("SHARDLANG_TEST_VOCAB", make_batch.vocab_size))


def build_model():
    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, n_embd=32))


def loss_fn(model, batch):
    return lm_loss(model, batch)


spec = sl.Spec(mesh=sl.Mesh(fsdp=-1), units=["blocks.*"])
optimizer = sl.AdamW(lr=1e-2)
