"""No hangs: a rank that stops reaching collectives makes the others fail within the timeout, naming it and the op.

Note [collective timeout] in `shardlang.runtime.watch`. The command line case runs
`tests/jobs/late_rank.py` (rank 1 sleeps at step 2) as a subprocess with a short
``--timeout`` (long enough for the ranks to finish compiling within it: the start-up check is a collective too); the API case runs on the shared 2-rank pool with ``sl.compile(timeout=)``.
"""

from __future__ import annotations

import ast
import time

import pytest

from shardlang.runtime import FailureKind, WorkerError

import watch_workers
from test_cli import shardlang

LATE_JOB = "tests/jobs/late_rank.py"
STUCK_S = 120.0  # tests/jobs/late_rank.py's sleep


def test_run_fails_within_the_timeout_naming_the_late_rank_and_the_op():
    started = time.monotonic()
    result = shardlang("run", LATE_JOB, "--nproc", "2", "--steps", "3", "--timeout", "5")
    elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stderr
    assert "step 1/3" in result.stdout and "step 2/3" not in result.stdout
    headline = result.stderr.splitlines()[0]
    # The late rank comes first, as the cause; rank 0's error names the step, the op and the late rank.
    assert headline.index("rank 1 was late") < headline.index("rank 0 raised CollectiveTimeoutError")
    assert "waited 5 s for its peers at step 2, schedule op 1 (wait for op 0: all_gather of unit '0'" in headline
    assert "late: rank 1 (last began step 1" in headline
    assert "late_rank.py:32 in make_batch" in headline  # where in the user's code rank 1 was stuck
    # The job is named by the command and its file, never by an internal function; stacks only with --verbose.
    assert headline.startswith(f"shardlang: error: shardlang run {LATE_JOB} failed: ")
    assert "_run_rank" not in result.stderr and "Python stack" not in result.stderr
    assert elapsed < STUCK_S  # the timeout ended the run, not rank 1's sleep


def test_api_timeout_names_the_late_rank_and_op(run_on):
    timeout_s, late_s = 1.5, 2.0
    with pytest.raises(WorkerError) as info:
        run_on(2, watch_workers.late_rank_with_api_timeout, timeout_s, late_s)
    failures = {f.rank: f for f in info.value.failures}
    assert all(f.kind is FailureKind.RAISED for f in failures.values())
    rank0 = ast.literal_eval(failures[0].detail.split(": ", 1)[1])
    assert rank0["kind"] == "CollectiveTimeoutError"
    assert (rank0["step"], rank0["op"], rank0["late"]) == (2, 1, (1,))
    assert timeout_s <= rank0["waited"] < late_s  # it failed within the timeout, before rank 1 arrived
    assert "rank 0 waited 1.5 s" in rank0["message"] and "late: rank 1 (last began step 1" in rank0["message"]
