"""``shardlang diff A B [--world N] [--world-b M] [--json]``: compare two plans.

Each of A and B is a job file (planned here for ``--world`` ranks) or a saved
``shardlang plan --json`` file; prints what moved, the bytes, the peak and the
predicted time.

Example::

    $ shardlang plan examples/gpt.py --world 4 --json > before.json
    $ shardlang diff before.json examples/gpt.py --world 4
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from ..compiler import CostModel
from ..errors import SpecError
from .args import add_model_arguments, cost_model, positive
from .common import shown
from .plan import plan_job


def add_parser(subparsers) -> None:
    """Register ``shardlang diff`` on the top-level parser's subparsers."""
    parser = subparsers.add_parser(
        "diff", help="compare two plans: what moved, the bytes, the peak, the time",
        description="Compare plans A and B. Each is a job file (planned here for --world ranks) or a JSON file "
                    "written by 'shardlang plan --json'.")
    parser.add_argument("a", metavar="A", help="job file (.py) or plan JSON")
    parser.add_argument("b", metavar="B", help="job file (.py) or plan JSON")
    parser.add_argument("--world", metavar="N", type=positive("a world size"), default=None,
                        help="world size to plan job files for (required for a job file)")
    parser.add_argument("--world-b", metavar="M", type=positive("a world size"), default=None,
                        help="world size for B when it differs from A's")
    parser.add_argument("--json", action="store_true", help="print the comparison as one JSON object")
    add_model_arguments(parser)
    parser.set_defaults(command=main)


def main(args) -> int:
    """Compare the two plans and print the comparison; the exit code."""
    from ..compiler import diff_plans

    stdout = sys.stdout
    quiet = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    model = cost_model(args)
    with quiet:
        a, label_a = _plan_source(args.a, args.world, model, "--world")
        b, label_b = _plan_source(args.b, args.world_b or args.world, model, "--world (or --world-b)")
    comparison = diff_plans(a, b, labels=(label_a, label_b))
    if args.json:
        stdout.write(comparison.to_json(indent=2) + "\n")
        stdout.flush()
    else:
        print(comparison.text())
    return 0


def _plan_source(source: str, world: int | None, model: CostModel, flag: str):
    """A plan to compare: a saved ``plan --json`` file, or a job file planned for ``world`` ranks."""
    import json

    path = Path(source)
    if path.suffix == ".json":
        try:
            with open(path) as f:
                data = json.load(f)
        except FileNotFoundError:
            raise SpecError(f"plan file {source} does not exist") from None
        except json.JSONDecodeError as exc:
            raise SpecError(f"{source} is not a plan JSON file (write one with 'shardlang plan FILE --world N "
                            f"--json > {path.name}'): {exc}") from None
        if not isinstance(data, dict) or "ops" not in data or "world_size" not in data:
            raise SpecError(f"{source} is JSON but not a plan; write one with 'shardlang plan FILE --world N --json'")
        return data, f"{shown(path)} (world {data['world_size']})"
    if world is None:
        raise SpecError(f"{source} is a job file: give {flag} N to plan it")
    _, plan = plan_job(source, world, model)
    return plan, f"{shown(path.resolve())} (world {world})"
