"""The command line: ``shardlang run | plan | diff | check`` on a job file (see `shardlang.cli.job`), and ``export``.

- ``shardlang run FILE --nproc N [--trace PATH]``: train on N local CPU ranks
  (gloo), or on the ranks torchrun started (when WORLD_SIZE is set); rank 0
  prints the global loss of each step, then the schedule's summary and table;
  with ``--trace``, the last steps are profiled into a Chrome trace whose ranges
  carry the schedule's op names (`shardlang.cli.profile`).
- ``shardlang plan FILE --world N [--json] [--chrome-trace PATH] [--plot PNG]``:
  compile for N ranks with fake tensors, no processes; print the plan (schedule,
  memory per op and its peak, communication against the formulas, predicted
  time), or one JSON object (`Plan.to_dict`); write the predicted timeline as a
  Chrome trace, or memory over the schedule as a picture.
- ``shardlang diff A B``: compare two plans (job files planned here, or saved
  ``plan --json`` files): what moved, the bytes, the peak, the predicted time.
- ``shardlang check FILE --world-sizes 1,2,4``: train sharded at each world size
  and once in one process with ``torch.optim`` on the same global batches;
  compare the parameters; exit 1 when a world size is outside the tolerance.
- ``shardlang export D --out model.safetensors [--max-shard-size SIZE]``: write a
  checkpoint's model as safetensors, one file or Hugging Face's sharded layout.
- ``shardlang tune FILE --world N [--memory-budget SIZE] [--measure K]``: choose
  units, strategies, mesh, recompute and prefetch; write the spec as TOML.
- ``shardlang calibrate --out machine.json``: measure the link and the compute for
  the cost model (``plan`` and ``tune`` take it with ``--calibration``).
- ``shardlang data prepare INPUT... --out DIR``: tokenize text into token shards
  that a job reads with ``sl.data.tokens``.

One module per command (`run`, `plan`, `diff`, `check`, `tune`, `calibrate`, `export`, `data`), each with
``add_parser(subparsers)`` and ``main(args) -> int``; `COMMANDS` registers them.
`args` holds the argument types, `common` what the commands share. To add a
command, write ``cli/<name>.py`` with those two functions and list it in
`COMMANDS`.

Exit codes: 0 success; 1 a check failed, training stopped on a non-finite loss
(`NonFiniteError`), or a rank failed unexpectedly (its traceback is printed);
2 bad input (arguments, job file, spec, batch), reported as one
``shardlang: error: ...`` line.

Example::

    $ shardlang plan examples/gpt.py --world 64 --json | jq .bytes_per_rank
    $ torchrun --nproc-per-node 4 -m shardlang run examples/gpt.py --steps 100
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import NoReturn

from ..compiler import VERBOSE_ENV, drop_no_action_warnings, verbose
from ..errors import NonFiniteError, ShardlangError
from ..runtime.launcher import FailureKind, PoolState, RankFailure, WorkerError
from . import calibrate, check, data, diff, export, plan, run, tune
from .check import TOLERANCES, max_relative_difference, tolerance

COMMANDS = (run, plan, diff, check, tune, calibrate, export, data)  # in the order ``shardlang --help`` lists them

__all__ = ["COMMANDS", "TOLERANCES", "failure_text", "main", "max_relative_difference", "run_program", "tolerance"]


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 failed, 2 bad input).

    Example::

        >>> main(["plan", "examples/mlp.py", "--world", "2"])   # doctest: +SKIP
        0
    """
    args = _parser().parse_args(argv)
    if args.verbose:  # the ranks inherit it (Note [torch's logs])
        os.environ[VERBOSE_ENV] = "1"
    drop_no_action_warnings()
    try:
        return args.command(args)
    except WorkerError as exc:
        if verbose():
            traceback.print_exc()
        line = _own_error_line(exc)
        if line is None:
            print(f"shardlang: error: {failure_text(exc, verbose())}", file=sys.stderr)
            return 1
        print(f"shardlang: error: {line}", file=sys.stderr)
        return 1 if f"{NonFiniteError.__name__}:" in line else 2
    except ShardlangError as exc:
        if verbose():
            traceback.print_exc()
        print(f"shardlang: error: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, NonFiniteError) else 2
    except BrokenPipeError:  # `shardlang plan ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def run_program() -> NoReturn:
    """The program ``shardlang`` and ``python -m shardlang``: `main`, then the process's exit with its code.

    A rank that torchrun started (``WORLD_SIZE`` set) leaves as the local launcher's ranks do
    (Note [a rank's exit] in `shardlang.runtime.worker`); any other process exits as usual.
    """
    code = main()
    if "WORLD_SIZE" in os.environ:
        from ..runtime.worker import leave_rank

        leave_rank(code)
    sys.exit(code)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: ``shardlang: error: ...``, exit 2."""

    def error(self, message: str):
        self.exit(2, f"shardlang: error: {message} (see '{self.prog} --help')\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="shardlang", description="Train, plan and check sharded training jobs.")
    parser.add_argument("--verbose", action="store_true",
                        help=f"show torch's own logs while tracing and compiling, and full tracebacks "
                             f"(also {VERBOSE_ENV}=1)")
    verbs = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.add_parser(verbs)
    return parser


def failure_text(exc: WorkerError, verbose: bool = False) -> str:
    """What a user reads when a job's ranks failed: each rank in one line, with where in the user's code a
    stopped or late rank was; the traceback of a rank that raised an error other than shardlang's own. With
    ``verbose``, every traceback and stack (the exception's whole message).

    Example::

        >>> error = WorkerError("shardlang run a.py", (RankFailure(1, FailureKind.LATE, "(stopped)",
        ...     'Current thread (most recent call first):\n  File "/jobs/a.py", line 9 in make_batch'),), (),
        ...     PoolState.CLOSED)
        >>> failure_text(error)
        'shardlang run a.py failed: rank 1 was late (stopped), at /jobs/a.py:9 in make_batch'
    """
    if verbose:
        return str(exc)
    own = _subclass_names(ShardlangError)
    parts, tracebacks = [], []
    for failure in exc.failures:
        part = failure.headline()
        raised_own = failure.kind is FailureKind.RAISED and failure.detail.split(":", 1)[0] in own
        if failure.kind is FailureKind.RAISED and not raised_own and failure.traceback:
            tracebacks.append(f"--- rank {failure.rank} ---\n{failure.traceback.rstrip()}")
        elif not raised_own:
            where = failure.user_frame()
            part += f", at {where}" if where else ""
        parts.append(part)
    lines = [f"{exc.what} failed: " + "; ".join(parts), *tracebacks]
    if any(f.traceback for f in exc.failures) and not tracebacks:
        lines.append(f"(--verbose or {VERBOSE_ENV}=1 shows every rank's traceback)")
    return "\n".join(lines)


def _own_error_line(exc: WorkerError) -> str | None:
    """One line for a job that failed because ranks raised the same shardlang error; None otherwise.

    The launcher sends back each rank's ``"Type: message"``, not the exception itself,
    so shardlang's own errors are recognised by their class names.
    """
    own = _subclass_names(ShardlangError)
    causes = [f for f in exc.failures if f.kind is not FailureKind.STOPPED]
    if not causes or any(f.kind is not FailureKind.RAISED or f.detail.split(":", 1)[0] not in own for f in causes):
        return None
    details = dict.fromkeys(f.detail for f in causes)
    if len(details) != 1:
        return None
    ranks = ", ".join(str(f.rank) for f in causes)
    return f"rank{'s' if len(causes) > 1 else ''} {ranks}: {next(iter(details))}"


def _subclass_names(cls: type) -> set[str]:
    names = {cls.__name__}
    for sub in cls.__subclasses__():
        names |= _subclass_names(sub)
    return names
