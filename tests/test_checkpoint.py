"""Checkpoints (docs/checkpoints.md): exact resume at N=1, 2, 4, resharding on load, the chunk layout.

Exact resume: a run that saves at step k and is resumed to 2k gives the same losses and the
same parameters, bit for bit, as the run that went on without stopping. Every case of a
world size runs in one worker call (compiles dominate).
"""

from __future__ import annotations

import math

import pytest
import torch

import checkpoint_workers as w
from shardlang.checkpoint import store
from shardlang.checkpoint.layout import Chunk, range_chunks

ZERO = {"mesh": {"fsdp": -1}}
ZERO2 = {"mesh": {"fsdp": -1}, "strategies": [{"pattern": "*", "strategy": "zero2"}]}
ZERO1 = {"mesh": {"fsdp": -1}, "strategies": [{"pattern": "*", "strategy": "zero1"}]}
DDP = {"mesh": {"fsdp": -1}, "strategies": [{"pattern": "*", "strategy": "ddp"}]}
DIM0 = {"mesh": {"fsdp": -1}, "rules": [{"pattern": "*", "layout": "shard", "axis": "fsdp", "dim": 0}]}
HYBRID = {"mesh": {"replicate": 2, "fsdp": 2}}

# Between them: float32 and float64, every strategy, dim layouts, dropout, accumulation, an lr schedule,
# tied and frozen parameters, a 0-dim parameter and sizes nothing divides, and an async save.
RESUME_CASES = [
    {"case": "prime", "dtype": "float64", "spec": {**ZERO, "options": {"microbatches": 2}}, "schedule": "lambda"},
    {"case": "prime", "dtype": "float32", "spec": ZERO1},
    {"case": "mlp_dropout", "dtype": "float32", "spec": ZERO2, "optimizer": "sgd"},
    {"case": "frozen", "dtype": "float64", "spec": DDP, "optimizer": "adam", "async": True},
    {"case": "gpt_tiny", "dtype": "float32", "spec": DIM0, "schedule": "warmup_cosine"},
]


def _with_paths(cases, root):
    return [{**c, "path": str(root / str(i))} for i, c in enumerate(cases)]


# DCP's checkpointer process needs a process group: N > 1 only.
PROCESS_CASE = {"case": "gpt_tiny", "dtype": "float32", "spec": ZERO, "async": "process"}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_resume_is_exact(run_on, tmp_path, world_size):
    extra = ([PROCESS_CASE] if world_size > 1 else []) + ([{"case": "mlp_dropout", "spec": HYBRID}] if world_size == 4
                                                           else [])
    cases = _with_paths(RESUME_CASES + extra, tmp_path)
    uninterrupted = run_on(world_size, w.train_save_continue, cases)
    resumed = run_on(world_size, w.load_continue, cases)
    for rank in range(world_size):
        for c, a, b in zip(cases, uninterrupted[rank], resumed[rank]):
            where = f"rank {rank}, {c}"
            assert b["steps"] == b["data_position"] == 2, where
            assert a["losses"] == b["losses"], where
            assert a["lrs"] == b["lrs"], where
            assert a["params"].keys() == b["params"].keys()
            for name in a["params"]:
                assert torch.equal(a["params"][name], b["params"][name]), f"{where}: {name}"


PRIME_DIM0 = {"mesh": {"fsdp": -1}, "rules": [{"pattern": "scale", "layout": "replicate"},
                                              {"pattern": "*", "layout": "shard", "axis": "fsdp", "dim": 0}]}
RESHARD_TARGETS = [  # (world size, spec for gpt_tiny, spec for prime)
    (2, DIM0, PRIME_DIM0),
    (2, ZERO2, ZERO2),
    (4, HYBRID, HYBRID),
    (1, ZERO, ZERO),
]


def test_reshard_on_load_continues_the_trajectory(run_on, tmp_path):
    """Saved at N=4 under flat ZeRO-3; loaded at N=2 with dim-0 layouts, N=2 under ZeRO-2, 2x2 hybrid, N=1."""
    saved = [{"case": case, "dtype": "float64", "spec": ZERO, "path": str(tmp_path / case), "schedule": "lambda"}
             for case in ("gpt_tiny", "prime")]
    references = run_on(4, w.train_save_continue, saved)[0]
    for world, *specs in RESHARD_TARGETS:
        loaded = run_on(world, w.load_continue, [{**c, "spec": spec} for c, spec in zip(saved, specs)])[0]
        for c, spec, reference, got in zip(saved, specs, references, loaded):
            where = (c["case"], world, spec)
            assert got["world_size"] == 4 and got["steps"] == 2, where
            assert got["lrs"] == reference["lrs"], where
            assert got["losses"] == pytest.approx(reference["losses"], rel=1e-12), where
            for name, ref in reference["params"].items():
                scale = ref.abs().max().clamp_min(1e-30)
                assert float((got["params"][name] - ref).abs().max() / scale) < 1e-9, (*where, name)


def test_range_chunks_cover_exactly_the_range():
    shape = (3, 4, 5)
    total = math.prod(shape)
    for lo in range(0, total, 7):
        for hi in range(lo, total + 1, 11):
            chunks = range_chunks(shape, lo, hi)
            seen = torch.zeros(shape, dtype=torch.int64)
            for c in chunks:
                index = tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))
                seen[index] += 1
            expected = torch.zeros(total, dtype=torch.int64)
            expected[lo:hi] = 1
            assert torch.equal(seen.reshape(-1), expected), (lo, hi, chunks)
            assert len(chunks) <= 2 * len(shape) - 1


def test_range_chunks_of_a_row_and_a_scalar():
    assert range_chunks((3, 4), 2, 9) == [Chunk((0, 2), (1, 2)), Chunk((1, 0), (1, 4)), Chunk((2, 0), (1, 1))]
    assert range_chunks((3, 4), 4, 12) == [Chunk((1, 0), (2, 4))]
    assert range_chunks((), 0, 1) == [Chunk((), ())]
    assert range_chunks((5,), 3, 3) == []


@pytest.mark.parametrize("world_size, checkpointer", [(1, None), (2, "thread"), (2, "process"), (4, None)])
def test_a_steps_saves_share_one_plan_and_each_holds_the_state_it_was_saved_with(run_on, tmp_path, world_size,
                                                                                 checkpointer):
    """DCP's plan cache serves a step's second save (Note [cached save plans]); each checkpoint still loads the
    state of its own moment, and a checkpointer process's digests reach the manifest and leave no file."""
    case = {"case": "prime", "dtype": "float64", "spec": ZERO, "path": str(tmp_path / "ckpt")}
    if checkpointer:
        case["async"] = checkpointer
    saved = run_on(world_size, w.save_twice, case)
    first = saved[0]
    assert all(r["cached"] for r in saved) == (checkpointer != "process")
    for files, listed in zip(first["manifests"], first["listed"]):
        assert sorted(files) == [n for n in listed if n != store.MANIFEST]  # no digests file left behind
        data = [n for n in files if n.endswith(".distcp")]
        assert data and all("segments" in files[n] for n in data)  # digested as written, item by item
    assert any(not torch.equal(a, first["params"][1][n]) for n, a in first["params"][0].items())
    for k in range(2):
        loaded = run_on(world_size, w.load_params, {**case, "path": f"{case['path']}-{'ab'[k]}"})[0]
        for name, value in first["params"][k].items():
            assert torch.equal(loaded[name], value), (k, name)
