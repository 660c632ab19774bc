"""Parity: the sharded step trains exactly like one process, at world sizes 1, 2 and 4.

Every case trains K=3 steps on the same global batches, sharded (each rank
takes its rows) and on one process with torch.optim on the whole batch. In
float64 every parameter must match within 1e-9 relative (max |a-b| / max |b|
per parameter); in practice the difference is rounding, around 1e-15.
"""

from __future__ import annotations

import pytest

import parity

STEPS = 3
CASES = ["mlp", "gpt_tiny", "prime", "frozen", "convnet_bn"]
FLOAT64_TOLERANCE = 1e-9


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("case", CASES)
def test_sharded_training_matches_one_process(run_on, references, case, optimizer, world_size):
    results = run_on(world_size, parity.train_sharded, case, optimizer, "float64", STEPS)
    ref_losses, ref_params, ref_buffers = references(case, optimizer)
    for rank, (losses, params, buffers, _schedule) in enumerate(results):
        assert parity.max_relative_difference(params, ref_params) < FLOAT64_TOLERANCE, f"rank {rank}"
        for name, ref in ref_buffers.items():  # BatchNorm statistics: replicated, equal to one process's
            assert parity.max_relative_difference({name: buffers[name].double()}, {name: ref.double()}) < 1e-9, name
    # Each rank's loss is its shard's mean; their mean is the global batch's loss.
    for k in range(STEPS):
        mean_loss = sum(r[0][k] for r in results) / world_size
        assert mean_loss == pytest.approx(ref_losses[k], rel=1e-12)


@pytest.mark.parametrize("world_size", [2, 4])
def test_parity_without_resharding(run_on, references, world_size):
    results = run_on(world_size, parity.train_sharded, "gpt_tiny", "adamw", "float64", STEPS,
                     {"reshard_after_forward": False})
    _, ref_params, _ = references("gpt_tiny", "adamw")
    assert parity.max_relative_difference(results[0][1], ref_params) < FLOAT64_TOLERANCE


@pytest.mark.parametrize("optimizer", ["sgd_nesterov", "adam"])
def test_other_optimizers_match_torch_optim(run_on, references, optimizer):
    results = run_on(2, parity.train_sharded, "prime", optimizer, "float64", STEPS)
    _, ref_params, _ = references("prime", optimizer)
    assert parity.max_relative_difference(results[0][1], ref_params) < FLOAT64_TOLERANCE


# float32: the sharded step sums gradients in another order (a reduction over
# ranks instead of one batch reduction) and runs AdamW through torch's
# capturable formula, so it rounds differently from torch.optim. AdamW divides
# by sqrt(v) + eps: for a near-zero gradient a rounding-level difference
# becomes an lr-sized one, so a fixed tolerance on the float32 reference would
# be arbitrary. The yardstick instead is float64: one process in float32 is
# itself ~2e-4 (relative, per parameter) away from the float64 result after 3
# AdamW steps on this model (measured 2.3e-4); the sharded float32 result must
# be no further from float64 than twice that (measured 1.5e-4 to 2.0e-4 at
# N=2 and 4), and within 1e-3 of the float32 reference (measured 1.7e-4 to
# 3.0e-4). A real bug (a missing 1/N, a wrong shard) shows up at 1e-1.
FLOAT32_CEILING = 1e-3


@pytest.mark.parametrize("world_size", [2, 4])
def test_float32_gpt_is_as_accurate_as_one_process(run_on, references, world_size):
    results = run_on(world_size, parity.train_sharded, "gpt_tiny", "adamw", "float32", STEPS)
    _, ref32, _ = references("gpt_tiny", "adamw", "float32")
    _, ref64, _ = references("gpt_tiny", "adamw", "float64")
    as_double = lambda params: {k: v.double() for k, v in params.items()}  # noqa: E731
    torch_error = parity.max_relative_difference(as_double(ref32), ref64)
    sharded_error = parity.max_relative_difference(as_double(results[0][1]), ref64)
    assert sharded_error <= 2 * torch_error
    assert parity.max_relative_difference(results[0][1], ref32) < FLOAT32_CEILING
