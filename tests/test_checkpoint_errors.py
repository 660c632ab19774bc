"""Checkpoints that must not load: another model, another shape or dtype, damaged or unfinished files.

Each is a `CheckpointError` that names the tensor or the file, and the state is left as it was.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import checkpoint_workers as w
import shardlang as sl
from shardlang.runtime.dist import DistContext


class Net(nn.Module):
    def __init__(self, d_in: int = 4, extra: bool = False):
        super().__init__()
        self.fc = nn.Linear(d_in, 3)
        self.out = nn.Linear(3, 2)
        if extra:
            self.more = nn.Linear(2, 2)

    def forward(self, x):
        y = self.out(torch.tanh(self.fc(x)))
        return self.more(y) if hasattr(self, "more") else y


def _step(d_in: int = 4, extra: bool = False, dtype=torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    model = Net(d_in, extra).to(dtype)
    batch = (torch.randn(4, d_in, dtype=dtype), torch.randn(4, 2, dtype=dtype))
    step = sl.compile(model, lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(), sl.Spec(sl.Mesh(fsdp=1)),
                      optimizer=sl.AdamW(lr=1e-2), example_batch=batch, dist_context=DistContext.single())
    step(batch)
    return step


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "step-1"
    _step().save(path)
    return path


def _copy(saved, tmp_path):
    import shutil

    target = tmp_path / "copy"
    shutil.copytree(saved, target)
    return target


def _unchanged(step, before):
    after = step.full_parameters()
    return all(torch.equal(before[k], after[k]) for k in before)


def test_a_checkpoint_of_another_model_names_the_tensors(saved):
    step = _step(extra=True, seed=1)
    before = step.full_parameters()
    with pytest.raises(sl.CheckpointError, match=r"has no keys? 'model\.more\.weight'.*another model") as info:
        step.load(saved)
    assert info.value.key == "model.more.weight"
    assert _unchanged(step, before)


def test_tensors_the_model_lacks_are_an_error_too(tmp_path):
    _step(extra=True).save(tmp_path / "big")
    with pytest.raises(sl.CheckpointError, match=r"has tensors this model does not: 'model\.more\.bias'"):
        _step().load(tmp_path / "big")


def test_a_tensor_of_another_shape_is_named(saved):
    step = _step(d_in=5, seed=1)
    before = step.full_parameters()
    with pytest.raises(sl.CheckpointError, match=r"'model\.fc\.weight' has shape \(3, 4\) there and \(3, 5\) here"):
        step.load(saved)
    assert _unchanged(step, before)


def test_a_tensor_of_another_dtype_is_named(saved):
    with pytest.raises(sl.CheckpointError, match=r"'model\.fc\.weight' is torch\.float32 there and torch\.float64"):
        _step(dtype=torch.float64).load(saved)


def test_a_truncated_file_is_named(saved, tmp_path):
    path = _copy(saved, tmp_path)
    data = path / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-100])
    step = _step(seed=1)
    before = step.full_parameters()
    with pytest.raises(sl.CheckpointError, match=r"__0_0\.distcp has \d+ bytes, the manifest says \d+ \(truncated"):
        step.load(path)
    assert _unchanged(step, before)


def test_a_corrupt_file_is_named(saved, tmp_path):
    path = _copy(saved, tmp_path)
    data = path / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(sl.CheckpointError, match=r"__0_0\.distcp does not match its checksum \(corrupt\)"):
        _step().load(path)


def _flip_middle_byte(file):
    raw = bytearray(file.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    file.write_bytes(bytes(raw))


def _manifest(path):
    return json.loads((path / "shardlang.json").read_text())


def _write_manifest(path, manifest):
    (path / "shardlang.json").write_text(json.dumps(manifest))


CORRUPT = r"__0_0\.distcp does not match its checksum \(corrupt\)"


@pytest.mark.parametrize("segments, named", [
    (True, CORRUPT + r": bytes \d+\.\.\d+$"),  # Note [segment digests]: the damaged item's byte range
    (False, CORRUPT + "$"),  # a manifest without segments (older): every file is checked whole
])
def test_a_corrupt_file_is_caught_with_and_without_segment_digests(saved, tmp_path, segments, named):
    path = _copy(saved, tmp_path)
    if not segments:
        manifest = _manifest(path)
        for entry in manifest["files"].values():
            entry.pop("segments", None)
        _write_manifest(path, manifest)
        _step().load(path)  # intact, it loads
    _flip_middle_byte(path / "__0_0.distcp")
    with pytest.raises(sl.CheckpointError, match=named):
        _step().load(path)


def test_malformed_segments_are_named(saved, tmp_path):
    path = _copy(saved, tmp_path)
    manifest = _manifest(path)
    entry = manifest["files"]["__0_0.distcp"]
    entry["segments"] = [[0, entry["bytes"] + 1, 0]]
    _write_manifest(path, manifest)
    with pytest.raises(sl.CheckpointError, match=r"the segments of '__0_0\.distcp' are not \[start, end, digest\] "
                                                 r"triples of increasing, non-overlapping ranges within its \d+ bytes"):
        _step().load(path)


def test_missing_metadata_and_unfinished_saves_are_named(saved, tmp_path):
    path = _copy(saved, tmp_path)
    (path / ".metadata").unlink()
    with pytest.raises(sl.CheckpointError, match=r"\.metadata is missing"):
        _step().load(path)
    unfinished = tmp_path / "step-2.tmp"
    unfinished.mkdir()
    with pytest.raises(sl.CheckpointError, match=r"not a complete shardlang checkpoint.*unfinished save"):
        _step().load(unfinished)
    with pytest.raises(sl.CheckpointError, match=r"no checkpoint at .*nowhere: not a directory"):
        _step().load(tmp_path / "nowhere")


def test_a_damaged_file_fails_every_rank(run_on, tmp_path):
    """At N=2 the rank that checks the bad file tells the other: both raise, neither hangs."""
    case = {"case": "prime", "spec": {"mesh": {"fsdp": -1}}, "path": str(tmp_path / "c")}
    run_on(2, w.save_only, case)
    data = tmp_path / "c" / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[:10])
    messages = run_on(2, w.load_error, case)
    assert all("__1_0.distcp has 10 bytes" in m for m in messages), messages


def test_an_unknown_checkpointer_is_refused_by_name():
    from shardlang.checkpoint.background import Checkpointer

    with pytest.raises(sl.CheckpointError, match=r"checkpointer is 'disk'; valid values are \['thread', 'process'\]"):
        Checkpointer.parse("disk")
    assert Checkpointer.parse("process") is Checkpointer.PROCESS
