"""``shardlang calibrate [--nproc N] [--reps R] [--max-payload SIZE] [--mesh AXES] [--job FILE [--spec FILE]]
--out machine.json``:
measure this machine for the cost model.

Short probes on the real backend (Note [calibration] in `shardlang.tune.calibrate`):
the link's latency and bandwidth per collective and message size on N local
ranks, the compute rate and per-op overhead with the threads one rank gets,
how much gloo's copies slow compute on the same cores, and one step on the N
ranks (the 10M GPT's, or ``--job``'s) that the compute model is scaled to
predict. ``plan`` and ``tune`` take the file with ``--calibration``.

Example::

    $ shardlang calibrate --nproc 2 --out machine.json
    $ shardlang calibrate --nproc 2 --job examples/gpt.py --out machine.json   # fitted on this job's step
    $ shardlang tune examples/gpt.py --world 2 --calibration machine.json
    $ shardlang calibrate --nproc 4 --mesh fsdp=2,tp=2 --out machine.json    # a link per axis too
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import SpecError
from ..spec.mesh import Mesh
from ..tune.calibrate import PAYLOADS, StepJob, calibrate, probe_payloads
from .args import add_spec_argument, byte_size, output_file, positive, spec_path
from .job import load_job


def add_parser(subparsers) -> None:
    """Register ``shardlang calibrate`` on the top-level parser's subparsers."""
    parser = subparsers.add_parser(
        "calibrate", help="measure this machine's link and compute for the cost model",
        description="Measure the link (each collective, 64 KiB to --max-payload) on N local ranks, the compute with "
                    "the threads one rank gets, their contention, and one step on the N ranks (the 10M GPT's, or "
                    "--job's) that the compute model is fitted to; write a calibration that plan and tune take with "
                    "--calibration (docs/tune.md).")
    parser.add_argument("--nproc", metavar="N", type=positive("a number of ranks"), default=2,
                        help="local ranks to measure the link on (default 2; at least 2)")
    parser.add_argument("--reps", metavar="R", type=positive("a number of repetitions"), default=9,
                        help="repetitions of each probe (default 9)")
    parser.add_argument("--max-payload", metavar="SIZE", type=byte_size, default=PAYLOADS[-1],
                        help="the largest collective the link is probed at (default 16MiB; from 64KiB, x4 a step): "
                             "probe as far as the job's largest collective")
    parser.add_argument("--job", metavar="FILE", default=None,
                        help="a job file whose step (on the N ranks, with its spec) the compute model is fitted to "
                             "(default: examples/gpt.py at GPT_SIZE=10M); calibrate on the job you will tune")
    parser.add_argument("--mesh", metavar="AXES", type=mesh_axes, default=None,
                        help="also probe each axis's own groups, e.g. fsdp=2,tp=2 (-1 fills the rest of --nproc): "
                             "plan and tune then cost each axis's collectives on its link (docs/tune.md)")
    add_spec_argument(parser)
    parser.add_argument("--out", metavar="PATH", type=output_file, required=True, help="the calibration file")
    parser.set_defaults(command=main)


def mesh_axes(text: str) -> dict[str, int]:
    """``--mesh fsdp=2,tp=2`` as ``{"fsdp": 2, "tp": 2}`` (in order)."""
    axes: dict[str, int] = {}
    for part in text.split(","):
        name, _, size = part.strip().partition("=")
        try:
            value = int(size)
        except ValueError:
            value = 0
        if not name.isidentifier() or not (value >= 1 or value == -1) or name in axes:
            raise argparse.ArgumentTypeError(f"{text!r} is not a mesh: expected axis=size pairs, each axis once, "
                                             "sizes >= 1 or one -1, e.g. fsdp=2,tp=2")
        axes[name] = value
    return axes


def main(args) -> int:
    """Measure and write the calibration; prints what it measured."""
    if args.spec and not args.job:
        raise SpecError(f"--spec {args.spec}: a spec replaces a job's; give the job with --job FILE")
    job = StepJob()
    if args.job:
        load_job(args.job, spec_path(args))  # a bad job or spec is an error now, not after the probes
        job = StepJob(str(Path(args.job).resolve()), spec_path(args), args.job)
    payloads = probe_payloads(args.max_payload)
    mesh = Mesh(**args.mesh).bind(args.nproc).axes if args.mesh else ()
    on_axes = f", and on the groups of {', '.join(n for n, k in mesh if k > 1)}" if mesh else ""
    print(f"shardlang calibrate: {args.nproc} local ranks{on_axes}, {len(payloads)} payloads x 3 collectives, "
          f"{args.reps} repetitions each; the step of {job.name}", flush=True)
    calibration = calibrate(args.nproc, args.reps, job, payloads, mesh)
    Path(args.out).write_text(calibration.to_json())
    print(calibration.summary())
    print(f"wrote {args.out}: shardlang plan JOB --world N --calibration {args.out}")
    return 0
