"""``shardlang calibrate [--nproc N] [--reps R] [--max-payload SIZE] [--job FILE [--spec FILE]] --out machine.json``:
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
"""

from __future__ import annotations

from pathlib import Path

from ..errors import SpecError
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
    add_spec_argument(parser)
    parser.add_argument("--out", metavar="PATH", type=output_file, required=True, help="the calibration file")
    parser.set_defaults(command=main)


def main(args) -> int:
    """Measure and write the calibration; prints what it measured."""
    if args.spec and not args.job:
        raise SpecError(f"--spec {args.spec}: a spec replaces a job's; give the job with --job FILE")
    job = StepJob()
    if args.job:
        load_job(args.job, spec_path(args))  # a bad job or spec is an error now, not after the probes
        job = StepJob(str(Path(args.job).resolve()), spec_path(args), args.job)
    payloads = probe_payloads(args.max_payload)
    print(f"shardlang calibrate: {args.nproc} local ranks, {len(payloads)} payloads x 3 collectives, "
          f"{args.reps} repetitions each; the step of {job.name}", flush=True)
    calibration = calibrate(args.nproc, args.reps, job, payloads)
    Path(args.out).write_text(calibration.to_json())
    print(calibration.summary())
    print(f"wrote {args.out}: shardlang plan JOB --world N --calibration {args.out}")
    return 0
