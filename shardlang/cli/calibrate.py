"""``shardlang calibrate [--nproc N] [--reps R] --out machine.json``: measure this machine for the cost model.

Short probes on the real backend (Note [calibration] in `shardlang.tune.calibrate`):
the link's latency and bandwidth per collective and message size on N local
ranks, the compute rate and per-op overhead with the threads one rank gets,
and how much gloo's copies slow compute on the same cores. ``plan`` and
``tune`` take the file with ``--calibration``.

Example::

    $ shardlang calibrate --nproc 2 --out machine.json
    $ shardlang tune examples/gpt.py --world 2 --calibration machine.json
"""

from __future__ import annotations

from pathlib import Path

from ..tune.calibrate import PAYLOADS, calibrate
from .args import output_file, positive


def add_parser(subparsers) -> None:
    """Register ``shardlang calibrate`` on the top-level parser's subparsers."""
    parser = subparsers.add_parser(
        "calibrate", help="measure this machine's link and compute for the cost model",
        description="Measure the link (each collective, 64 KiB to 16 MiB) on N local ranks, the compute with the "
                    "threads one rank gets, and their contention; write a calibration that plan and tune take "
                    "with --calibration (docs/tune.md).")
    parser.add_argument("--nproc", metavar="N", type=positive("a number of ranks"), default=2,
                        help="local ranks to measure the link on (default 2; at least 2)")
    parser.add_argument("--reps", metavar="R", type=positive("a number of repetitions"), default=9,
                        help="repetitions of each probe (default 9)")
    parser.add_argument("--out", metavar="PATH", type=output_file, required=True, help="the calibration file")
    parser.set_defaults(command=main)


def main(args) -> int:
    """Measure and write the calibration; prints what it measured."""
    print(f"shardlang calibrate: {args.nproc} local ranks, {len(PAYLOADS)} payloads x 3 collectives, "
          f"{args.reps} repetitions each", flush=True)
    calibration = calibrate(args.nproc, args.reps)
    Path(args.out).write_text(calibration.to_json())
    print(calibration.summary())
    print(f"wrote {args.out}: shardlang plan JOB --world N --calibration {args.out}")
    return 0
