"""Checkpoints and weights files on a 2-D mesh: DCP in FSDP2 + TP's layout, both ways, exact resume, loading at
other meshes, and Hugging Face safetensors read as each rank's 2-D slice.

A checkpoint names global tensors in chunks, as DTensors on a (dp, tp) mesh do: a rank's
chunks are its FSDP shard of its tp block, placed at the block's start. So the same files
load at (fsdp, tp) = (2, 2), (1, 4), (4, 1), into one process, and into FSDP2 + TP
(torchtitan's Llama plan, then ``fully_shard``), all in float64 against one process.
"""

from __future__ import annotations

import pytest
from torch.distributed.checkpoint import FileSystemReader

import parity
import tensor_parallel_workers as workers

STEPS = 2  # steps before the save, and after it
TOLERANCE = 1e-10


def _mean_losses(results) -> list[float]:
    """The global batch's loss per step: ranks that share rows (tp) count once each, so the mean is the mean."""
    return [sum(r[0][k] for r in results) / len(results) for k in range(len(results[0][0]))]


@pytest.fixture(scope="module")
def saved_2x2(run_on, tmp_path_factory):
    """llama_tiny trained 2 steps at (fsdp, tp) = (2, 2), saved, trained 2 more: (path, the run's results)."""
    path = str(tmp_path_factory.mktemp("tp_ckpt") / "step-2")
    return path, run_on(4, workers.save_midway, "llama_tiny", 2, path, STEPS)


def test_a_2d_checkpoint_resumes_exactly_on_the_same_mesh(run_on, saved_2x2):
    path, uninterrupted = saved_2x2
    resumed = run_on(4, workers.load_and_continue, "llama_tiny", 2, path, STEPS)
    for rank, ((losses, params, restored), (ref_losses, ref_params)) in enumerate(zip(resumed, uninterrupted)):
        assert restored == (STEPS, STEPS, False)
        assert losses == ref_losses, f"rank {rank}"  # the same mesh: bit for bit
        assert parity.max_relative_difference(params, ref_params) == 0.0, f"rank {rank}"


@pytest.mark.parametrize("world, tp", [(4, 4), (4, None), (1, None), (2, 2)])
def test_a_2d_checkpoint_loads_at_another_mesh(run_on, references, saved_2x2, world, tp):
    path, _ = saved_2x2
    ref_losses, ref_params, _ = references("llama_tiny", "adamw", steps=2 * STEPS)
    results = run_on(world, workers.load_and_continue, "llama_tiny", tp, path, STEPS)
    assert _mean_losses(results) == pytest.approx(ref_losses[STEPS:], rel=1e-12)
    for rank, (_losses, params, _restored) in enumerate(results):
        assert parity.max_relative_difference(params, ref_params) < TOLERANCE, f"rank {rank}"


@pytest.fixture(scope="module")
def fsdp2_tp_saved(run_on, tmp_path_factory):
    """FSDP2 + TP's checkpoint of llama_tiny after 2 steps at (dp, tp) = (2, 2)."""
    path = str(tmp_path_factory.mktemp("fsdp2_tp") / "step-2")
    run_on(4, workers.fsdp2_tp_run, 2, path, STEPS, True)
    return path


def test_shardlang_writes_fsdp2_tp_s_keys_and_global_shapes(saved_2x2, fsdp2_tp_saved):
    theirs = FileSystemReader(fsdp2_tp_saved).read_metadata().state_dict_metadata
    ours = FileSystemReader(saved_2x2[0]).read_metadata().state_dict_metadata
    tensors = {k: tuple(md.size) for k, md in theirs.items() if hasattr(md, "size") and md.size}
    assert "model.layers.0.attention.wq.weight" in tensors and "optimizer.state.output.weight.exp_avg" in tensors
    assert {k: tuple(ours[k].size) for k in tensors if k in ours} == tensors


def test_an_fsdp2_tp_checkpoint_loads_into_shardlang_and_continues(run_on, references, fsdp2_tp_saved):
    ref_losses, ref_params, _ = references("llama_tiny", "adamw", steps=2 * STEPS)
    results = run_on(4, workers.load_and_continue, "llama_tiny", 2, fsdp2_tp_saved, STEPS)
    for rank, (_losses, params, restored) in enumerate(results):
        assert restored == (STEPS, STEPS, True), f"rank {rank}"  # the step count comes from the optimizer's
        assert parity.max_relative_difference(params, ref_params) < TOLERANCE, f"rank {rank}"
    assert _mean_losses(results) == pytest.approx(ref_losses[STEPS:], rel=1e-12)


def test_a_shardlang_2d_checkpoint_loads_into_fsdp2_tp_and_continues(run_on, references, saved_2x2):
    ref_losses, ref_params, _ = references("llama_tiny", "adamw", steps=2 * STEPS)
    results = run_on(4, workers.fsdp2_tp_run, 2, saved_2x2[0], STEPS, False)
    assert _mean_losses(results) == pytest.approx(ref_losses[STEPS:], rel=1e-12)
    for rank, (_losses, params) in enumerate(results):
        assert parity.max_relative_difference(params, ref_params) < TOLERANCE, f"rank {rank}"


def test_export_of_a_2d_checkpoint_loads_strictly_into_the_model(references, saved_2x2, tmp_path):
    import safetensors.torch
    import torch

    from models import CASES
    from shardlang.checkpoint.export import export_safetensors

    export_safetensors(saved_2x2[0], tmp_path / "model.safetensors")
    model = CASES["llama_tiny"].build(torch.float64)
    model.load_state_dict(safetensors.torch.load_file(tmp_path / "model.safetensors"), strict=True)
    _, at_save, _ = references("llama_tiny", "adamw", steps=STEPS)
    assert parity.max_relative_difference(dict(model.named_parameters()), at_save) < TOLERANCE


def test_run_saves_on_a_2d_mesh_and_resumes_on_another(tmp_path, capfd):
    import re
    import shutil

    from models import EXAMPLES
    from shardlang.cli import main

    ckpt = tmp_path / "ckpt"
    job = [str(EXAMPLES / "llama.py"), "--spec", str(EXAMPLES / "llama_tp.toml")]
    assert main(["run", *job, "--nproc", "4", "--steps", "3", "--checkpoint-dir", str(ckpt),
                 "--checkpoint-every", "2"]) == 0
    uninterrupted = dict(re.findall(r"^step (\d+/\d+)  loss (\S+)", capfd.readouterr().out, flags=re.M))
    shutil.rmtree(ckpt / "step-00000003")
    assert main(["run", *job, "--nproc", "2", "--steps", "3", "--checkpoint-dir", str(ckpt), "--resume"]) == 0
    out = capfd.readouterr().out
    assert f"resumed from {ckpt / 'step-00000002'} (step 2, written by 4 ranks)" in out
    [(k, loss)] = re.findall(r"^step (\d+/\d+)  loss (\S+)", out, flags=re.M)
    assert k == "3/3" and float(loss) == pytest.approx(float(uninterrupted["3/3"]), rel=1e-5)  # float32, 1x2


def test_a_checkpoint_of_the_data_axis_alone_loads_onto_a_2d_mesh(run_on, references, tmp_path):
    path = str(tmp_path / "step-2")
    run_on(4, workers.save_midway, "llama_tiny", None, path, STEPS)
    ref_losses, ref_params, _ = references("llama_tiny", "adamw", steps=2 * STEPS)
    results = run_on(4, workers.load_and_continue, "llama_tiny", 2, path, STEPS)
    assert _mean_losses(results) == pytest.approx(ref_losses[STEPS:], rel=1e-12)
    for rank, (_losses, params, _restored) in enumerate(results):
        assert parity.max_relative_difference(params, ref_params) < TOLERANCE, f"rank {rank}"


@pytest.mark.parametrize("world, tp", [(2, 2), (4, 2), (4, 4)])
def test_hf_weights_load_into_a_meta_model_on_a_2d_mesh_like_load_state_dict(run_on, tmp_path, world, tp):
    import torch

    from materialize_workers import load_tensors, train_torch
    from models import CASES

    weights = workers.save_llama_weights(str(tmp_path / "hf"))
    case = CASES["llama_tiny"]
    reference = case.build(torch.float64, seed=99)  # other values, all overwritten by the files
    reference.load_state_dict(load_tensors(weights), strict=True)
    ref_losses, ref_params, _ = train_torch(case, reference, "adamw", torch.float64, STEPS)
    results = run_on(world, workers.train_from_weights, tp, weights, STEPS)
    assert _mean_losses(results) == pytest.approx(ref_losses, rel=1e-12)
    for rank, (_losses, params) in enumerate(results):
        assert parity.max_relative_difference(params, ref_params) < TOLERANCE, f"rank {rank}"
