"""Checkpoints from others run no code (Note [checkpoints run no code] in `shardlang.checkpoint.untrusted`).

A crafted pickle in ``.metadata`` (DCP's index), in a non-tensor value, or in the
lr schedule of an old checkpoint, with ``shardlang.json`` recomputed to match so
that the checksums pass: loading, resuming and exporting refuse it with a
`CheckpointError` naming the file and the type, and the payload never runs.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil

import pytest
import torch

import shardlang as sl
from shardlang.checkpoint import store
from shardlang.checkpoint.export import export_safetensors
from shardlang.checkpoint.planner import EntryLoadPlanner
from shardlang.checkpoint.state_dict import schedule_from_saved
from shardlang.checkpoint.untrusted import SafeReader
from shardlang.errors import CheckpointError

from test_checkpoint_errors import _step
from test_cli import shardlang


class Payload:
    """Unpickling this creates ``marker``: the proof that a file ran code."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _recompute_manifest(path) -> None:
    manifest = json.loads((path / store.MANIFEST).read_text())
    manifest["files"] = store.describe(sorted(p for p in path.iterdir() if p.is_file() and p.name != store.MANIFEST))
    (path / store.MANIFEST).write_text(json.dumps(manifest))


@pytest.fixture
def crafted(tmp_path):
    """A real checkpoint whose ``.metadata`` is replaced by a payload, its manifest recomputed."""
    path = tmp_path / "ckpt" / "step-00000001"
    _step().save(path)
    marker = tmp_path / "ran"
    (path / ".metadata").write_bytes(pickle.dumps(Payload(str(marker))))
    _recompute_manifest(path)
    return path, marker


def test_crafted_metadata_is_refused_by_load(crafted):
    path, marker = crafted
    step = _step()
    with pytest.raises(CheckpointError, match=r"\.metadata asks to load posix\.mkdir.*refused, not run"):
        step.load(path)
    assert not marker.exists()


def test_crafted_metadata_is_refused_by_export_in_python_and_on_the_command_line(crafted, tmp_path):
    path, marker = crafted
    with pytest.raises(CheckpointError, match=r"posix\.mkdir"):
        export_safetensors(path, tmp_path / "out.safetensors")
    result = shardlang("export", str(path), "--out", str(tmp_path / "cli.safetensors"))
    assert result.returncode == 2 and "posix.mkdir" in result.stderr and "refused" in result.stderr, result.stderr
    assert not marker.exists()


def test_a_crafted_value_is_refused_by_the_planner(tmp_path):
    marker = tmp_path / "ran"
    data = io.BytesIO()
    torch.save(Payload(str(marker)), data)
    data.seek(0)
    planner = EntryLoadPlanner("ckpt/step-1")
    planner.set_up_planner({"optimizer": {"param_groups": {"0": {"lr": 0.0}}}})

    class Read:  # the one field of a ReadItem that load_bytes reads
        class dest_index:
            fqn = "optimizer.param_groups.0.lr"

    with pytest.raises(CheckpointError, match=r"'optimizer.param_groups.0.lr'.*refused, not run"):
        planner.load_bytes(Read, data)
    assert not marker.exists()
    plain = io.BytesIO()
    torch.save(0.25, plain)
    plain.seek(0)
    planner.load_bytes(Read, plain)  # plain data still loads
    assert planner.original_state_dict["optimizer"]["param_groups"]["0"]["lr"] == 0.25


def test_an_old_pickled_lr_schedule_loads_plain_data_only(tmp_path):
    marker = tmp_path / "ran"
    legacy = io.BytesIO()
    torch.save({"last_epoch": 3, "base_lrs": [0.1]}, legacy)
    assert schedule_from_saved(legacy.getvalue(), "old")["last_epoch"] == 3  # format 1 keeps loading
    evil = io.BytesIO()
    torch.save(Payload(str(marker)), evil)
    with pytest.raises(CheckpointError, match="shardlang.lr_schedule"):
        schedule_from_saved(evil.getvalue(), "old")
    assert not marker.exists()


def test_the_lr_schedule_is_saved_as_json_and_resumes(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    batch = (torch.randn(4, 3), torch.randn(4, 2))
    loss = lambda m, b: ((m(b[0]) - b[1]) ** 2).mean()  # noqa: E731
    schedule = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)  # noqa: E731
    step = sl.compile(model, loss, sl.Spec(sl.Mesh(fsdp=1)), optimizer=sl.SGD(lr=0.1), example_batch=batch,
                      lr_schedule=schedule)
    for _ in range(3):
        step(batch)
    step.save(tmp_path / "c")
    reader = SafeReader(str(tmp_path / "c"))
    assert "shardlang.lr_schedule" in reader.read_metadata().state_dict_metadata
    other = sl.compile(torch.nn.Linear(3, 2), loss, sl.Spec(sl.Mesh(fsdp=1)), optimizer=sl.SGD(lr=0.1),
                       example_batch=batch, lr_schedule=schedule)
    other.load(tmp_path / "c")
    assert other.lr_schedule.scheduler.state_dict() == step.lr_schedule.scheduler.state_dict()
    assert torch.equal(other(batch), step(batch))


@pytest.mark.parametrize("name", ["../outside", "/etc/passwd", "..", "a/b"])
def test_a_manifest_naming_files_outside_its_directory_is_refused(tmp_path, name):
    path = tmp_path / "step-00000001"
    _step().save(path)
    manifest = json.loads((path / store.MANIFEST).read_text())
    manifest["files"][name] = {"bytes": 1, "xxh3_64": 0}
    (path / store.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="not a file of its directory"):
        _step().load(path)


def test_a_malformed_manifest_is_named(tmp_path):
    path = tmp_path / "step-00000001"
    _step().save(path)
    (path / store.MANIFEST).write_text(json.dumps({"files": {".metadata": {"bytes": "many"}}}))
    with pytest.raises(CheckpointError, match=r"the entry of '\.metadata'"):
        _step().load(path)
    (path / store.MANIFEST).write_text("[]")
    with pytest.raises(CheckpointError, match="no \"files\" object"):
        _step().load(path)
    shutil.rmtree(path)
