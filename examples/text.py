"""Job file: the Llama of examples/llama.py trained on real text, prepared once with ``shardlang data prepare``.

Prepare a corpus from text anyone has, the Python standard library's sources
(no download; a BPE of 4096 tokens is trained on them), then train::

    shardlang data prepare "$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')" \\
        --glob '*.py' --out data/python --tokenizer train-bpe:4096
    shardlang run examples/text.py --nproc 2 --steps 300 --eval-every 50 --metrics text.jsonl

``TEXT_DATA`` names another prepared directory (default ``data/python``, relative
to the working directory). The model's vocabulary is the data's. Global batch
``k`` is a function of the data, the seed and ``k`` (`sl.data.tokens`), so
``shardlang check examples/text.py --world-sizes 1,2,4`` compares against one
process on the same sequences, and ``--resume`` continues mid-epoch exactly.
Evaluation at step ``k`` reads validation batch ``k``: held-out sequences,
different at each evaluation.
"""

from __future__ import annotations

import os

import torch

import shardlang as sl
from llama import Llama, LlamaConfig, loss_fn  # noqa: F401  (loss_fn: the job's loss, as examples/llama.py's)

DATA = os.environ.get("TEXT_DATA", "data/python")
SEQ_LEN = 128
GLOBAL_BATCH = 16  # sequences a step: 2,048 tokens; a multiple of 4 (world sizes 1, 2, 4)

make_batch = sl.data.tokens(DATA, seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH, seed=0)
make_eval_batch = sl.data.tokens(DATA, seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH, seed=0, split="val")

CONFIG = LlamaConfig(vocab_size=make_batch.vocab_size, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=352,
                     max_seq_len=SEQ_LEN)


def build_model() -> Llama:
    """A 4-layer Llama (d=128) over the data's vocabulary, built on meta and materialised unit by unit."""
    with torch.device("meta"):
        return Llama(CONFIG)


spec = sl.Spec(mesh=sl.Mesh(fsdp=-1), rules=[("*", sl.shard("fsdp"))],
               units=["tok_embeddings", "layers.*", "output"])
optimizer = sl.AdamW(lr=3e-3, weight_decay=0.1)
