"""Checkpoints and the ecosystem: FSDP2 both ways, ``dcp_to_torch_save``, safetensors export (docs/checkpoints.md)."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import checkpoint_workers as w
from shardlang.checkpoint.export import export_safetensors
from shardlang.cli import main
from training_workers import CASES

GPT = {"case": "gpt_tiny", "dtype": "float64", "spec": {"mesh": {"fsdp": -1}}, "steps": 2}


def _close(got: dict, reference: dict, tolerance: float = 1e-9):
    for name, ref in reference.items():
        scale = ref.abs().max().clamp_min(1e-30)
        assert float((got[name] - ref).abs().max() / scale) < tolerance, name


def test_an_fsdp2_checkpoint_loads_into_shardlang_and_continues(run_on, tmp_path):
    c = {**GPT, "path": str(tmp_path / "fsdp2")}
    reference = run_on(2, w.fsdp_run, c, True)[0]
    keys = set(torch.distributed.checkpoint.FileSystemReader(c["path"]).read_metadata().state_dict_metadata)
    assert "model.head.weight" in keys and "optimizer.state.tok_emb.weight.exp_avg" in keys  # FSDP2's layout
    [got] = run_on(2, w.load_continue, [c])[0]
    assert got["foreign"] and got["steps"] == 2 and got["data_position"] == 2
    assert got["losses"] == pytest.approx(reference["losses"], rel=1e-10)
    _close(got["params"], reference["params"])


def test_a_shardlang_checkpoint_loads_into_fsdp2_and_continues(run_on, tmp_path):
    c = {**GPT, "path": str(tmp_path / "shardlang"), "spec": {"mesh": {"fsdp": -1}, "strategies": [
        {"pattern": "*", "strategy": "zero1"}]}}
    [reference] = run_on(2, w.train_save_continue, [c])[0]
    got = run_on(2, w.fsdp_run, c, False)[0]
    assert got["step"] == 4.0
    assert got["losses"] == pytest.approx(reference["losses"], rel=1e-10)
    _close(got["params"], reference["params"])


@pytest.fixture(scope="module")
def saved(run_on, tmp_path_factory):
    """gpt_tiny (tied head) saved at N=2 under dim-0 layouts, with what it held."""
    path = tmp_path_factory.mktemp("interop") / "gpt"
    c = {**GPT, "path": str(path), "spec": {"mesh": {"fsdp": -1}, "rules": [
        {"pattern": "*", "layout": "shard", "axis": "fsdp", "dim": 0}]}}
    return path, run_on(2, w.save_only, c)[0]


def _fresh_model():
    return CASES["gpt_tiny"].build(torch.float64)


def _assert_holds(model, held):
    state = model.state_dict()
    for name, value in held["params"].items():
        assert torch.equal(state[name], value), name
    assert torch.equal(state["head.weight"], held["params"]["tok_emb.weight"])


def test_dcp_to_torch_save_gives_a_state_dict_that_loads_strictly(saved, tmp_path):
    path, held = saved
    dcp_to_torch_save(path, tmp_path / "model.pt")
    sd = torch.load(tmp_path / "model.pt", weights_only=False)
    model = _fresh_model()
    model.load_state_dict(sd["model"], strict=True)
    _assert_holds(model, held)


def test_export_writes_one_safetensors_file_that_loads_strictly(saved, tmp_path, capsys):
    path, held = saved
    assert main(["export", str(path), "--out", str(tmp_path / "model.safetensors")]) == 0
    assert "exported" in capsys.readouterr().out
    model = _fresh_model()
    model.load_state_dict(safetensors.torch.load_file(tmp_path / "model.safetensors"), strict=True)
    _assert_holds(model, held)


def test_export_with_a_max_shard_size_writes_the_sharded_layout_and_index(saved, tmp_path):
    path, held = saved
    done = export_safetensors(path, tmp_path / "out" / "model.safetensors", max_shard_size="40KB")
    assert len(done.files) > 1 and done.index == tmp_path / "out" / "model.safetensors.index.json"
    index = json.loads(done.index.read_text())
    assert set(index["weight_map"].values()) == {f.name for f in done.files}
    assert done.files[0].name == f"model-00001-of-{len(done.files):05d}.safetensors"
    merged = {}
    for f in done.files:
        part = safetensors.torch.load_file(f)
        assert sum(t.numel() * t.element_size() for t in part.values()) <= 40_000 or len(part) == 1
        merged.update(part)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in merged.values())
    model = _fresh_model()
    model.load_state_dict(merged, strict=True)
    _assert_holds(model, held)


def test_export_errors_are_named(saved, tmp_path, capsys):
    path, _ = saved
    assert main(["export", str(path), "--out", str(tmp_path / "m.safetensors"), "--max-shard-size", "lots"]) == 2
    assert "max shard size 'lots' is not a size" in capsys.readouterr().err
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "m.safetensors")]) == 2
    assert "is neither a checkpoint nor a directory with a complete one" in capsys.readouterr().err
