"""A job's ``data``: loaders users already have (Note [loader batches], docs/data.md).

A StatefulDataLoader (over a shuffled Hugging Face dataset, and over a Hugging
Face IterableDataset) resumes exactly from the state the checkpoint kept, also
across an epoch's end; a plain DataLoader resumes by skipping and says so once;
``check`` passes at N=1, 2, 4 on a loader. The state is JSON in the checkpoint.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from shardlang.cli import main
from shardlang.data.loaders import LoaderBatches
from shardlang.errors import DataError

pytest.importorskip("torchdata", reason="StatefulDataLoader needs torchdata (pip install -e '.[dev]')")
pytest.importorskip("datasets", reason="the Hugging Face dataset cases need datasets (pip install -e '.[dev]')")

LOADER_JOB = str(Path(__file__).resolve().parent / "jobs" / "loader.py")


def _losses(text: str) -> dict[str, str]:
    return dict(re.findall(r"^step (\d+)/\d+  loss (\S+)", text, flags=re.M))


@pytest.mark.parametrize("kind, resumed_at, world", [("stateful", 3, 1), ("stateful", 5, 2), ("hf-iterable", 3, 1),
                                                     ("plain", 3, 1)])
def test_a_loader_resumes_exactly(kind, resumed_at, world, tmp_path, monkeypatch, capfd):
    """Steps 1-7 (an epoch is 5 batches): a run stopped after ``resumed_at`` steps (mid-epoch, or at an epoch's
    end) goes on as one that never stopped, into the next epoch."""
    monkeypatch.setenv("SHARDLANG_TEST_LOADER", kind)
    ckpt = tmp_path / "ckpt"
    common = [LOADER_JOB, "--nproc", str(world), "--checkpoint-dir", str(ckpt)]
    assert main(["run", *common, "--steps", "7", "--checkpoint-every", str(resumed_at)]) == 0
    uninterrupted = _losses(capfd.readouterr().out)
    assert len(uninterrupted) == 7
    for later in ckpt.iterdir():
        if later.name != f"step-{resumed_at:08d}":
            shutil.rmtree(later)
    assert main(["run", *common, "--steps", "7", "--resume"]) == 0
    out = capfd.readouterr().out
    assert _losses(out) == {k: v for k, v in uninterrupted.items() if int(k) > resumed_at}
    skipped = f"resuming by reading and dropping its first {resumed_at} batches"
    assert (skipped in out) == (kind == "plain"), out


def test_check_passes_at_1_2_4_on_a_loader(monkeypatch, capsys):
    monkeypatch.setenv("SHARDLANG_TEST_LOADER", "stateful")
    assert main(["check", LOADER_JOB, "--world-sizes", "1,2,4", "--steps", "2"]) == 0, capsys.readouterr()


def test_loader_batches_read_in_order_start_over_and_roll_into_the_next_epoch():
    batches = LoaderBatches([torch.tensor([k]) for k in range(3)])
    assert [int(batches(k)) for k in (0, 0, 2, 3, 1)] == [0, 0, 2, 0, 1]
    assert batches.epoch == 0 and batches.position == 2  # started over for step 1
    with pytest.raises(DataError, match=r"gave no batch in epoch 1"):
        LoaderBatches([])(0)


def test_a_job_with_both_data_and_make_batch_is_refused(tmp_path, capsys):
    job = tmp_path / "both.py"
    job.write_text(Path(LOADER_JOB).read_text() + "\ndef make_batch(step):\n    return None\n")
    assert main(["plan", str(job), "--world", "2"]) == 2
    assert "defines both make_batch and data; define one" in capsys.readouterr().err


def test_a_loader_state_that_is_not_json_is_refused_at_save():
    from shardlang.checkpoint.state_dict import data_state_to_json
    from shardlang.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"cannot be saved as JSON: it holds a object; .* never pickled"):
        data_state_to_json({"position": 1, "loader": {"sampler": object()}})
