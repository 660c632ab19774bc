"""The plan's communication formulas follow mixed precision and recompute: every ``matches`` of a correct
schedule is true (compiler/analysis/formulas.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import shardlang as sl
from shardlang.compiler.analysis.plan_report import communication_check
from shardlang.step.batch import split_batch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import gpt  # noqa: E402

PRECISIONS = {"fp32": None, "bf16-fp32": sl.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
              "bf16": sl.MixedPrecision(param_dtype=torch.bfloat16)}
MIXES = {"zero3": None, "mixed": [("blocks.0", "zero2"), ("blocks.1", "zero1")], "ddp": [("blocks.*", "ddp")]}


def _plan(world: int, mesh: sl.Mesh, precision, recompute, strategies) -> sl.Step:
    spec = sl.Spec(mesh=mesh, units=["blocks.*"], recompute=recompute, strategies=strategies,
                   options=sl.Options(mixed_precision=precision))
    return sl.plan(lambda: gpt.GPT(gpt.GPTConfig()), gpt.lm_loss, spec,
                   example_batch=split_batch(gpt.make_tokens(0), world, 0), world_size=world)


CASES = [(p, None, m) for p in PRECISIONS for m in MIXES] + [("bf16-fp32", r, m) for r in ("full", "selective")
                                                              for m in ("zero3", "mixed")]


@pytest.mark.parametrize("precision, recompute, mix", CASES)
def test_every_formula_matches_under_mixed_precision_and_recompute(precision, recompute, mix):
    rules = None if recompute is None else [("blocks.*", recompute)]
    plan = _plan(4, sl.Mesh(fsdp=-1), PRECISIONS[precision], rules, MIXES[mix])
    rows = communication_check(plan.schedule)
    assert all(row.matches for row in rows), [(r.kind, r.planned, r.formula) for r in rows]
    if precision != "fp32" and mix == "zero3":  # the gathers move half the master bytes
        flats = [f for f in plan.schedule.flats if f.sharded]
        assert all(f.gathered_bytes * 2 == f.padded_bytes for f in flats)
        assert all(f.reduced_bytes == (f.padded_bytes if precision == "bf16-fp32" else f.padded_bytes // 2)
                   for f in flats)


@pytest.mark.parametrize("precision", ["bf16-fp32", "bf16"])
def test_formulas_match_on_a_hybrid_mesh_under_mixed_precision(precision):
    plan = _plan(4, sl.Mesh(replicate=2, fsdp=2), PRECISIONS[precision], None, None)
    assert all(row.matches for row in communication_check(plan.schedule))
