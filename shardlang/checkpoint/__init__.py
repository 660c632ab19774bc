"""Checkpoints on torch.distributed.checkpoint (docs/checkpoints.md).

- `layout`: a rank's flat tensors as chunks of named, global tensors (Note [chunks of a flat shard]).
- `planner`: DCP planners that write and read those chunks, with checks that name keys.
- `state_dict`: the keys FSDP2 users have, plus shardlang's own (Note [checkpoint keys]).
- `store`: atomic directories, checksums, the latest complete checkpoint, pruning (Note [atomic checkpoints]).
- `saving`: `save`, `save_async`, `load`.
- `export`: a checkpoint as safetensors, tensor by tensor.

Example::

    step.save("ckpt/step-3")
    step.load("ckpt/step-3")        # at any world size and layout
"""

from .saving import AsyncSave, Restored, load, save, save_async, wait_for_saves
from .store import CheckpointDir

__all__ = ["AsyncSave", "CheckpointDir", "Restored", "load", "save", "save_async", "wait_for_saves"]
