"""Plot a ``shardlang run --metrics`` file: the training loss per step, and the validation loss.

Usage: ``python tools/plot_metrics.py run.jsonl out.png [--title TEXT]`` (needs matplotlib).
docs/data.md's loss curve was drawn with it.
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics")
    parser.add_argument("out")
    parser.add_argument("--title", default=None)
    args = parser.parse_args()
    rows = [json.loads(line) for line in open(args.metrics)]
    train = [r for r in rows if "loss" in r]
    val = [r for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1, label="training loss (global batch)")
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats)")
    ax.grid(alpha=0.3)
    ax.legend()
    if args.title:
        ax.set_title(args.title, fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
