"""`shardlang check` tells rounding noise from bugs (shardlang.compare, Note [scale of a parameter]).

The false failure: examples/bert.py's key biases have a zero gradient in exact
arithmetic and stay at rounding noise, which the older measure (relative to
the parameter's own size) calls a difference of 0.5 or more. The planted bugs
are patched into the compiled graph by a test-only pass, in this process (world
size 1), so shipped code is unchanged.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from shardlang.cli import check, main
from shardlang.compare import Movement, relative_difference, scaled_difference
from shardlang.compiler import compile as compile_module
from shardlang.compiler.passes._order import optimizer_gradients
from shardlang.compiler.passes.elide_local_reductions import elide_local_reductions
from shardlang.job import build, global_batch, load_job
from shardlang.runtime.dist import DistContext

ROOT = Path(__file__).resolve().parents[1]
BERT, MLP, GPT = (str(ROOT / "examples" / name) for name in ("bert.py", "mlp.py", "gpt.py"))


def test_bert_key_biases_are_noise_that_the_old_measure_fails_and_the_scaled_one_passes():
    job = load_job(BERT)
    batches = [global_batch(job, k) for k in range(3)]
    _, ref_params, _, movement = check._train_reference(job, build(job, 0), batches)
    _, params = check._train_sharded(DistContext.single(), job, batches, 0, None)
    old, old_worst = relative_difference(params, ref_params)
    new, new_worst = scaled_difference(params, ref_params, movement)
    limit = check.tolerance(torch.float64, job.optimizer)
    assert old > 0.1 and old_worst.endswith("attn.key.bias")  # the false failure of issue 12
    assert float(ref_params[old_worst].abs().max()) < 1e-13  # ... on a parameter that is all rounding noise
    assert new < limit / 100


def test_a_parameter_whose_gradient_is_exactly_zero_passes():
    movement = Movement({"w": torch.tensor([0.5, -0.5]), "b": torch.zeros(3)}, [1e-3, 1e-3])
    noise = {"w": torch.tensor([0.5, -0.5]), "b": torch.tensor([3e-16, -2e-16, 0.0])}
    other = {"w": torch.tensor([0.5, -0.5]), "b": torch.tensor([-1e-16, 4e-16, 0.0])}
    assert relative_difference(noise, other)[0] > 0.5  # noise against noise, relative to noise
    diff, _ = scaled_difference(noise, other, movement)
    assert diff < 1e-9
    exact = {"w": torch.tensor([0.5, -0.5]), "b": torch.zeros(3)}
    assert scaled_difference(exact, exact, Movement({}, []))[0] == 0.0  # nothing moved at all: absolute


def _planting(monkeypatch, bug):
    """Run ``bug(graph)`` on every compiled graph, after shardlang's own passes.

    Before `elide_local_reductions`, the last of them: a bug planted on a gradient must find the gradient, which
    at N = 1 that pass would have replaced by the member gradients (it leaves the pack where the bug reads it).
    """
    original = compile_module.run_passes

    def run_passes(gm, ctx, passes, **kwargs):
        gm = original(gm, ctx, tuple(p for p in passes if p is not elide_local_reductions), **kwargs)
        bug(gm.graph)
        gm.graph.lint()
        gm.recompile()
        return original(gm, ctx, (elide_local_reductions,), **kwargs) if elide_local_reductions in passes else gm

    monkeypatch.setattr(compile_module, "run_passes", run_passes)


def _scale_one_gradient(graph):
    """One unit's averaged gradient times (1 + 1e-6), before its optimizer update reads it."""
    flat, grad = next(iter(optimizer_gradients(graph).items()))
    with graph.inserting_after(grad):
        scaled = graph.call_function(torch.ops.aten.mul.Tensor, (grad, 1 + 1e-6))
    grad.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)


def _update_one_flat_twice(graph):
    """One flat parameter's Adam update (``addcdiv_`` into its storage) applied twice."""
    update = next(n for n in graph.nodes if n.target is torch.ops.aten.addcdiv_.default)
    with graph.inserting_after(update):
        graph.node_copy(update)


def _check_world_1(path, *extra):
    return main(["check", path, "--world-sizes", "1", *extra])


@pytest.mark.parametrize("path, bug, extra", [
    (MLP, _scale_one_gradient, ("--steps", "2", "--dtype", "float64")),
    (GPT, _update_one_flat_twice, ("--steps", "2", "--dtype", "float64")),
], ids=["gradient-times-1+1e-6", "shard-updated-twice"])
def test_a_planted_bug_still_fails(monkeypatch, capsys, path, bug, extra):
    assert _check_world_1(path, *extra) == 0
    clean = capsys.readouterr().out
    _planting(monkeypatch, bug)
    assert _check_world_1(path, *extra) == 1
    out = capsys.readouterr().out
    assert re.search(r"^1\s+\S+\s+\S+\s+FAIL\s+\S+$", out, re.MULTILINE), out
    assert "PASS" in clean


def test_check_passes_on_varying_shapes_and_a_partial_batch(capsys):
    """examples/bert.py alternates sequence lengths and its third batch is the partial end of an epoch."""
    job = load_job(BERT)
    shapes = [tuple(global_batch(job, k)[0].shape) for k in range(3)]
    assert shapes == [(8, 12), (8, 20), (4, 12)]
    assert main(["check", BERT, "--world-sizes", "1,4"]) == 0  # 4: the partial batch is one row per rank
    out = capsys.readouterr().out
    rows = re.findall(r"^([14])\s+(\S+)\s+\S+\s+(PASS|FAIL)\s+\S+$", out, re.MULTILINE)
    assert [(w, v) for w, _, v in rows] == [("1", "PASS"), ("4", "PASS")], out
