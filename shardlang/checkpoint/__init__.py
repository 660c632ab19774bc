"""Checkpoints on torch.distributed.checkpoint (docs/checkpoints.md).

- `layout`: a rank's flat tensors as chunks of named, global tensors (Note [chunks of a flat shard]).
- `planner`: DCP planners that write and read those chunks, with checks that name keys.
- `state_dict`: the keys FSDP2 users have, plus shardlang's own (Note [checkpoint keys]).
- `store`: atomic directories, checksums, the latest complete checkpoint, pruning (Note [atomic checkpoints]).
- `saving`: `save`, `save_async`, `load`.
- `background`: async saves on DCP's ``async_save`` (Note [async saves]).
- `export`: a checkpoint as safetensors, tensor by tensor.

Example::

    step.save("ckpt/step-3")
    step.load("ckpt/step-3")        # at any world size and layout
"""

import importlib

__all__ = ["AsyncSave", "Checkpointer", "CheckpointDir", "Restored", "load", "save", "save_async", "wait_for_saves"]

#: Where each public name lives. Imported on first use: torch.distributed.checkpoint takes 1.4 s to import,
#: and every ``import shardlang`` reaches this package (`shardlang.step.step` reads `state_dict`'s key names).
_HOMES = {"CheckpointDir": ".store", **{name: ".saving" for name in __all__ if name != "CheckpointDir"}}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name], __name__), name)
    globals()[name] = value
    return value
