"""``shardlang export D --out model.safetensors [--max-shard-size SIZE]``: a checkpoint's model as safetensors.

D is a checkpoint directory, or a directory of them (``--checkpoint-dir`` of ``run``),
whose latest complete checkpoint is exported. The file loads with
``safetensors.torch.load_file`` plus ``model.load_state_dict(strict=True)``; with
``--max-shard-size`` the model is split into Hugging Face's sharded layout with
``model.safetensors.index.json``. Tensors are read and written one at a time
(`shardlang.checkpoint.export`).

Example::

    $ shardlang export ckpt --out gpt.safetensors
    $ shardlang export ckpt/step-00000100 --out out/model.safetensors --max-shard-size 2GB
"""

from __future__ import annotations

from pathlib import Path

from ..checkpoint import CheckpointDir
from ..errors import CheckpointError


def add_parser(subparsers) -> None:
    """Register ``shardlang export`` on the top-level parser's subparsers."""
    parser = subparsers.add_parser(
        "export", help="write a checkpoint's model as safetensors (one file, or sharded with an index)",
        description="Write the model of checkpoint D (or of the latest complete checkpoint in the directory D) "
                    "as safetensors, tensor by tensor.")
    parser.add_argument("checkpoint", metavar="D", help="checkpoint directory, or a --checkpoint-dir of `run`")
    parser.add_argument("--out", metavar="FILE", required=True, help="the .safetensors file to write")
    parser.add_argument("--max-shard-size", metavar="SIZE", default=None,
                        help="split into files of at most SIZE of tensor data (e.g. 5GB, 500MB, 2GiB) with "
                             "FILE.index.json, as Hugging Face does")
    parser.set_defaults(command=main)


def main(args) -> int:
    """Export the checkpoint (``args`` from `add_parser`); the exit code."""
    from ..checkpoint.export import export_safetensors, parse_size  # torch.distributed.checkpoint: 1.4 s to import

    if args.max_shard_size is not None:
        parse_size(args.max_shard_size)  # a bad size is an error before anything is read
    path = checkpoint_path(Path(args.checkpoint))
    done = export_safetensors(path, args.out, max_shard_size=args.max_shard_size)
    where = ", ".join(str(f) for f in done.files[:3]) + (" ..." if len(done.files) > 3 else "")
    print(f"exported {done.tensors} tensors ({done.bytes / 1e6:.1f} MB) from {path} to {where}"
          + (f"; index {done.index}" if done.index else ""))
    return 0


def checkpoint_path(path: Path) -> Path:
    """``path`` itself when it is a checkpoint, else the latest complete checkpoint in it."""
    if (path / ".metadata").is_file() or path.name.endswith(".tmp"):
        return path
    latest = CheckpointDir(path).latest()
    if latest is None:
        raise CheckpointError(f"{path} is neither a checkpoint nor a directory with a complete one "
                              "(step-<k> with a shardlang.json)", path=path)
    return latest
