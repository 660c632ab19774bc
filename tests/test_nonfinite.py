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
from shardlang.errors import SpecError

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
