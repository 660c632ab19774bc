"""Batches of varying shape (shardlang.step.variants): one graph per shape, one state, ranks may differ in a step."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import shardlang as sl
import shapes_workers as w
from models import CASES
from parity import max_relative_difference
from shardlang.step.variants import ShapeWarning

STEPS = 4


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("case", ["gpt_tiny", "convnet_bn"])
def test_varying_shapes_match_one_process(run_on, case, world_size):
    """Shapes change every step and differ across ranks; the parameters match one process to rounding."""
    results = run_on(world_size, w.train_sharded, case, "adamw", "float64", STEPS)
    ref_losses, ref_params, ref_buffers = w.train_reference(case, "adamw", "float64", STEPS, world_size)
    for rank, (losses, params, buffers, shapes, digests) in enumerate(results):
        assert max_relative_difference(params, ref_params) < 1e-10
        assert losses == pytest.approx([step[rank] for step in ref_losses], rel=1e-10)
        for name, ref in ref_buffers.items():  # BatchNorm: statistics over every rank's rows, however many
            assert torch.allclose(buffers[name], ref, rtol=1e-10, atol=1e-12), name
        assert len(shapes) == len({str(b) for b in _shapes_of(case, world_size, rank)})
        assert len(digests) == 1  # every shape issues the same collectives
    assert len({r[4][0] for r in results}) == 1  # ... on every rank


def _shapes_of(case, world, rank):
    return [tuple(t.shape for t in torch.utils._pytree.tree_leaves(w.rank_batches(case, world, k, torch.float64)[rank]))
            for k in range(STEPS)]


def test_accumulation_with_varying_shapes_matches_one_process(run_on):
    """Each rank splits its own rows into micro-batches, whatever their number this step."""
    for accumulation in ("per_microbatch", "keep"):
        options = {"microbatches": 2, "accumulation": accumulation}
        results = run_on(2, w.train_sharded, "gpt_tiny", "adamw", "float64", STEPS, options, (2, 4, 6))
        ref = w.train_reference("gpt_tiny", "adamw", "float64", STEPS, 2, (2, 4, 6))
        assert max_relative_difference(results[0][1], ref[1]) < 1e-10


def _mlp_step(**kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    loss = lambda m, b: (m(b[0]) - b[1]).pow(2).mean()  # noqa: E731
    example = (torch.randn(6, 4), torch.randn(6, 2))
    return model, loss, sl.compile(copy.deepcopy(model), loss, sl.Spec(sl.Mesh(fsdp=1)),
                                   optimizer=sl.SGD(lr=0.1), example_batch=example, **kwargs)


def test_each_shape_compiles_once_and_shares_the_state():
    model, loss, step = _mlp_step()
    graphs = []
    for rows in (6, 3, 6, 3, 5):
        step((torch.randn(rows, 4), torch.randn(rows, 2)))
        graphs.append(step.graph_for((torch.randn(rows, 4), torch.randn(rows, 2))))
    assert [s[0][0] for s in step.batch_shapes] == [(6, 4), (3, 4), (5, 4)]
    assert graphs[0] is graphs[2] and graphs[1] is graphs[3] and graphs[0] is not graphs[1]
    assert step.steps_done == 5  # one step count, one state, for every graph


def test_too_many_shapes_warn_naming_them():
    _, _, step = _mlp_step(shape_limit=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step((torch.randn(3, 4), torch.randn(3, 2)))  # 2 shapes: at the limit, no warning
    with pytest.warns(ShapeWarning, match=r"3 batch shapes \(limit 2\): \(6, 4\) \(6, 2\), \(3, 4\) \(3, 2\), "
                                          r"\(2, 4\) \(2, 2\)"):
        step((torch.randn(2, 4), torch.randn(2, 2)))


def test_memory_budget_keeps_the_first_prefetch_for_every_shape():
    """A budget's search picks a depth for the first shape; a longer batch must not pick another."""
    case = CASES["gpt_tiny"]
    model = case.build(torch.float64)
    short = w.rank_batches("gpt_tiny", 1, 3, torch.float64)[0]
    long = torch.randint(32, (8, 17))
    planned = sl.plan(model, case.loss_fn, sl.Spec(sl.Mesh(fsdp=4), units=case.units), example_batch=short,
                      world_size=4)
    budget = planned.memory.peak + 1
    spec = sl.Spec(sl.Mesh(fsdp=1), units=case.units, options=sl.Options(memory_budget=budget * 4))
    step = sl.compile(model, case.loss_fn, spec, example_batch=short)
    assert step.schedule_for(long).options["prefetch"] == step.schedule.options["prefetch"]


def test_collectives_digest_ignores_the_batch_shape():
    case = CASES["gpt_tiny"]
    spec = sl.Spec(sl.Mesh(fsdp=4), units=case.units)
    a = sl.plan(case.build(), case.loss_fn, spec, example_batch=torch.randint(32, (2, 17)), world_size=4).schedule
    b = sl.plan(case.build(), case.loss_fn, spec, example_batch=torch.randint(32, (3, 9)), world_size=4).schedule
    assert a.collectives_digest() == b.collectives_digest()
    assert a.collective_sequence() and a.collective_sequence() == b.collective_sequence()
    spec8 = sl.Spec(sl.Mesh(fsdp=2), units=case.units)
    c = sl.plan(case.build(), case.loss_fn, spec8, example_batch=torch.randint(32, (2, 17)), world_size=2).schedule
    assert a.collectives_digest() != c.collectives_digest()


def test_batch_norm_statistics_reduce_the_count_with_the_sums():
    """BatchNorm's first all-reduce carries channels + 1 elements: its size depends on no batch shape."""
    case = CASES["convnet_bn"]
    spec = sl.Spec(sl.Mesh(fsdp=2))
    plans = [sl.plan(case.build(), case.loss_fn, spec, world_size=2,
                     example_batch=(torch.randn(rows, 3, 8, 8), torch.randint(10, (rows,)))).schedule
             for rows in (2, 5)]
    stats = [[op.bytes for op in p.ops if op.detail == "batch statistics"] for p in plans]
    assert stats[0] == stats[1]
    assert stats[0][0] == (8 + 1) * 4 and stats[0][1] == 8 * 4  # sum and count; centred second moment


def test_plan_shows_the_schedule_for_the_batch_of_a_given_step(capsys):
    """`shardlang plan --batch-step K` plans make_batch(K)'s shape: same collectives, other memory."""
    import json
    from pathlib import Path

    from shardlang.cli import main

    bert = str(Path(__file__).resolve().parents[1] / "examples" / "bert.py")
    plans = []
    for k in (0, 1, 2):
        assert main(["plan", bert, "--world", "4", "--batch-step", str(k), "--json"]) == 0
        plans.append(json.loads(capsys.readouterr().out))
    collectives = [[(op["kind"], op["bytes"]) for op in p["ops"] if op["kind"] != "compute" and op["bytes"]]
                   for p in plans]
    assert collectives[0] and collectives[0] == collectives[1] == collectives[2]
    assert plans[1]["memory"]["peak"] > plans[0]["memory"]["peak"] > plans[2]["memory"]["peak"]  # per rank (2, 20) > (2, 12) > (1, 12)
    assert main(["plan", bert, "--world", "4", "--batch-step", "2"]) == 0
    assert "per-rank batch of step 2: (1, 12) (1, 12)" in capsys.readouterr().out
