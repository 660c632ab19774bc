"""Regenerate the pictures in docs/plan.md from the GPT example (needs matplotlib).

    python tools/make_doc_images.py [--world 4]

Writes docs/plan_report.png (the text of ``shardlang plan``), docs/plan_memory.png
(``--plot``), docs/plan_trace.png (the lanes of ``--chrome-trace``, drawn with
`shardlang.cli.plot.plot_trace`, since a browser is not at hand) and
docs/run_trace.png (the lanes of a measured ``shardlang run --trace``).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shardlang import api  # noqa: E402
from shardlang.step.batch import split_batch  # noqa: E402
from shardlang.compiler.analysis.plan_report import make_plan  # noqa: E402
from shardlang.compiler.analysis.timeline import chrome_trace  # noqa: E402
from shardlang.cli.job import build, global_batch, load_job  # noqa: E402
from shardlang.cli.plot import _pyplot, plot_memory, plot_trace  # noqa: E402

DOCS = ROOT / "docs"
GPT = ROOT / "examples" / "gpt.py"


def text_png(text: str, path: Path, title: str) -> None:
    """A terminal-like picture of ``text`` (monospace, as printed)."""
    plt = _pyplot()
    lines = text.splitlines()
    width = max(len(line) for line in lines)
    fig = plt.figure(figsize=(0.068 * width + 0.4, 0.15 * len(lines) + 0.6), dpi=110)
    fig.patch.set_facecolor("#1e1e1e")
    fig.text(0.01, 0.995, f"$ {title}\n" + text, family="monospace", fontsize=7.6, color="#e8e8e8", va="top")
    fig.savefig(path, facecolor=fig.get_facecolor())
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    args = parser.parse_args()
    job = load_job(GPT)
    batch = split_batch(global_batch(job, 0), args.world, 0)
    compiled = api.plan(lambda: build(job), job.loss_fn, job.spec, optimizer=job.optimizer, example_batch=batch,
                        world_size=args.world)
    plan = make_plan(compiled)
    text_png(plan.report(), DOCS / "plan_report.png", f"shardlang plan examples/gpt.py --world {args.world}")
    plot_memory(plan, DOCS / "plan_memory.png", title=f"examples/gpt.py, world {args.world}: memory per rank")
    plot_trace(chrome_trace(plan.schedule, plan.timeline, plan.memory), DOCS / "plan_trace.png",
               title=f"examples/gpt.py, world {args.world}: predicted timeline (gloo on loopback, CPU)")
    with tempfile.TemporaryDirectory() as tmp:
        measured = Path(tmp) / "run.json"
        subprocess.run([sys.executable, "-m", "shardlang", "run", str(GPT), "--nproc", str(args.world), "--steps",
                        "3", "--trace", str(measured)], cwd=ROOT, check=True, capture_output=True)
        plot_trace(measured, DOCS / "run_trace.png", only=r"^(\d+ |gloo:|step )",
                   title=f"examples/gpt.py, world {args.world}, rank 0: measured (shardlang run --trace)")
    for name in ("plan_report", "plan_memory", "plan_trace", "run_trace"):
        print(DOCS / f"{name}.png")


if __name__ == "__main__":
    main()
