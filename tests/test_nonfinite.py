"""Options(skip_nonfinite=True): a step with an inf or nan gradient is skipped inside the compiled step, and counted.

Parity at world sizes 1, 2 and 4 (float64): a batch with one inf input at step
2 makes the first layer's weight gradient nan (on rank 0's rows only; the
reduction spreads it); the step is skipped on every rank (the decision comes
from the all-reduced norm), the count is 1, the step count is one short, and
the parameters equal one process with torch.optim that did not step there.
"""

from __future__ import annotations

import math

import pytest

import nonfinite_workers as w
import parity
import shardlang as sl
from shardlang.cli import main as cli_main
from shardlang.errors import SpecError

from test_cli import shardlang

STEPS, BAD = 4, 1
TOLERANCE = 1e-12


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("optimizer, options", [("adamw", {}), ("sgd", {"clip_grad_norm": 1.0})])
def test_nonfinite_step_is_skipped_like_one_process(run_on, world_size, optimizer, options):
    reference = w.reference_skipping("mlp", optimizer, STEPS, BAD, options.get("clip_grad_norm"))
    for rank, (losses, params, skipped, done, reports) in enumerate(
            run_on(world_size, w.train_skipping, "mlp", optimizer, STEPS, BAD, options)):
        assert (skipped, done) == (1, STEPS - 1), f"rank {rank}"
        assert all(math.isfinite(v) for v in losses)  # tanh saturates: only the gradient goes non-finite
        assert parity.max_relative_difference(params, reference) < TOLERANCE, f"rank {rank}"
        assert [r is None for r in reports] == [k != BAD for k in range(STEPS)]
        # The report names the norm and the unit whose gradient is non-finite (only fc1's here).
        assert reports[BAD] == ("loss finite; gradient norm nan, first in unit 'fc1' (backward order; 1 of 3 units); "
                                "update skipped (1 so far)"), f"rank {rank}"


def test_without_the_option_the_nonfinite_step_poisons_the_parameters(run_on):
    """The test above is not vacuous: without skipping, the same batch makes the parameters nan."""
    params = run_on(2, w.train_plain, "mlp", "adamw", STEPS, BAD)[0][0]
    assert any(not bool(p.isfinite().all()) for p in params.values())


def test_skip_nonfinite_must_be_a_bool():
    with pytest.raises(SpecError, match="skip_nonfinite"):
        sl.Options(skip_nonfinite="yes")


# ---- shardlang run: a non-finite loss stops the run (--max-nonfinite), before saving ----------------------------

NAN_JOB = "tests/jobs/nan_batch.py"  # the batch of step 2 holds a nan, in rank 1's rows at N=2


def test_run_stops_on_every_rank_at_a_nonfinite_loss_before_saving_it(tmp_path):
    ckpt = tmp_path / "ckpt"
    result = shardlang("run", NAN_JOB, "--nproc", "2", "--steps", "4", "--checkpoint-dir", str(ckpt),
                       "--checkpoint-every", "1")
    assert result.returncode == 1, result.stderr
    assert "step 1/4" in result.stdout and "step 2: " in result.stdout and "step 3/4" not in result.stdout
    assert "NonFiniteError: step 2: the loss or gradient norm was not finite on 1 step (--max-nonfinite 1)" in \
        result.stderr
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000001"]  # step 2's poisoned state never saved


def test_max_nonfinite_allows_that_many_steps(tmp_path, capsys):
    # After step 2's nan update the parameters are nan, so every later loss is nan too.
    assert cli_main(["run", NAN_JOB, "--steps", "4", "--max-nonfinite", "2"]) == 1
    captured = capsys.readouterr()
    assert "step 3: loss nan" in captured.out and "step 4/4" not in captured.out
    assert "not finite on 2 steps (--max-nonfinite 2)" in captured.err


def test_with_skip_nonfinite_the_run_counts_and_goes_on(monkeypatch, capsys):
    monkeypatch.setenv("NAN_JOB_SKIP", "1")
    assert cli_main(["run", NAN_JOB, "--steps", "4"]) == 0
    out = capsys.readouterr().out
    assert "step 2: loss nan; gradient norm nan" in out and "update skipped (1 so far)" in out
    assert "step 4/4" in out and "trained 4 steps" in out


def test_run_stops_on_every_rank_when_the_step_is_not_reported():
    # --log-every 10: step 2 is not gathered for a line, so the ranks decide with one all-reduce of their own.
    result = shardlang("run", NAN_JOB, "--nproc", "2", "--steps", "4", "--log-every", "10")
    assert result.returncode == 1, result.stderr
    assert "step 2: " in result.stdout and "NonFiniteError: step 2:" in result.stderr
