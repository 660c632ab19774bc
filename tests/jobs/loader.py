"""A job whose data is a loader (tests/test_loaders.py): ``data`` instead of ``make_batch``.

``SHARDLANG_TEST_LOADER`` picks it: ``stateful`` (torchdata's StatefulDataLoader over a
shuffled map-style Hugging Face dataset, seeded), ``hf-iterable`` (a StatefulDataLoader over
a Hugging Face IterableDataset) or ``plain`` (torch's DataLoader, no state: resumed by skipping).
Each global batch is 8 sequences of 17 tokens (inputs and targets) with a collate function.
"""

import os
import sys
from pathlib import Path

import torch

import shardlang as sl

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import GPT, GPTConfig, init_weights, lm_loss  # noqa: E402,F401  (init_weights: the job's)

KIND = os.environ.get("SHARDLANG_TEST_LOADER", "stateful")
ROWS = 44  # 5 full batches of 8 an epoch, and a partial one dropped


def _rows():
    g = torch.Generator().manual_seed(7)
    start = torch.randint(64, (ROWS, 1), generator=g)
    return ((start + torch.arange(17)) % 64).tolist()


def collate(examples):
    return torch.tensor([e["tokens"] for e in examples], dtype=torch.long)


def _loader():
    if KIND == "plain":
        return torch.utils.data.DataLoader([{"tokens": r} for r in _rows()], batch_size=8, shuffle=True,
                                           drop_last=True, collate_fn=collate,
                                           generator=torch.Generator().manual_seed(0))
    import datasets
    from torchdata.stateful_dataloader import StatefulDataLoader

    dataset = datasets.Dataset.from_dict({"tokens": _rows()})
    if KIND == "hf-iterable":
        return StatefulDataLoader(dataset.to_iterable_dataset(num_shards=2), batch_size=8, drop_last=True,
                                  collate_fn=collate)
    return StatefulDataLoader(dataset, batch_size=8, shuffle=True, drop_last=True, collate_fn=collate,
                              generator=torch.Generator().manual_seed(0))


data = _loader()


def build_model():
    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))


def loss_fn(model, batch):
    return lm_loss(model, batch)


spec = sl.Spec(mesh=sl.Mesh(fsdp=-1), units=["blocks.*"])
optimizer = sl.AdamW(lr=1e-2)
