"""The figures a run is judged against, computed from the model alone (no processes).

- ``params``: the model's parameters, tied weights once (P).
- ``M``: their bytes in float32, ``4 P``.
- ``largest_unit``: the bytes of the biggest unit that is gathered whole (a
  transformer block, or the root: embeddings, final LayerNorm, tied head).
- ``activations``: the bytes autograd keeps from forward for backward on one
  rank's batch, counted once per storage by a saved-tensors hook, parameters
  excluded.
- ``floor``: ``16 P / N + largest_unit + activations``, the memory a rank needs
  with parameters, gradients and both AdamW moments sharded (16 bytes per
  parameter over N ranks), one unit gathered at a time, and the activations.
"""

from __future__ import annotations

import dataclasses

import torch

from examples.gpt import lm_loss, make_tokens

from .modes import ModelSize


@dataclasses.dataclass(frozen=True)
class Reference:
    """The figures for one model size and world size (see the module docstring)."""

    params: int
    largest_unit: int
    activations: int
    world: int

    @property
    def M(self) -> int:  # noqa: N802  the byte count the docs call M
        return 4 * self.params

    @property
    def floor(self) -> int:
        return 16 * self.params // self.world + self.largest_unit + self.activations

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "M": self.M, "floor": self.floor}


def references(size: ModelSize, worlds: list[int], global_batch: int, seed: int = 0) -> dict[int, Reference]:
    """`Reference` for each world size, from one seeded model built in this process."""
    torch.manual_seed(seed)
    model = size.build()
    params = sum(p.numel() for p in model.parameters())
    block = max(sum(p.numel() for p in b.parameters()) for b in model.blocks)
    root = params - sum(sum(p.numel() for p in b.parameters()) for b in model.blocks)
    out = {}
    for n in worlds:
        batch = size.global_batch(global_batch, n)
        tokens = make_tokens(0, batch, size.seq_len, size.vocab_size)
        out[n] = Reference(params, 4 * max(block, root), _saved_bytes(model, tokens[: batch // n]), n)
    del model
    return out


def _saved_bytes(model: torch.nn.Module, batch: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves in forward, parameters excluded."""
    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = lm_loss(model, batch)
    del loss
    return sum(seen.values())
