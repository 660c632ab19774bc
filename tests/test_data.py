"""Prepared token data: ``shardlang data prepare`` and ``sl.data.tokens`` (docs/data.md).

Preparation: every kind of input (text, folders, JSON lines, Parquet, empty
files, invalid UTF-8), the three tokenizers, a second run that does nothing, a
killed run that resumes, the same stream whatever the workers. Batches: a rank's
rows are the global batch's, every epoch visits every sequence once, the seed
decides the order. Training: ``check`` at N=1, 2, 4, an exact mid-epoch resume
at N=2 and a resume at N=4 from N=2's checkpoint. Bad input: errors that name
the file and the value.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import attrs
import numpy as np
import pytest
import torch

import shardlang as sl
from shardlang.cli import main
from shardlang.cli.common import rank_batch, split_for_rank
from shardlang.cli.job import load_job
from shardlang.data import preparation as preparing
from shardlang.data import read_index
from shardlang.errors import DataError, ShardlangRuntimeError

TOKENS_JOB = str(Path(__file__).resolve().parent / "jobs" / "tokens.py")
WORDS = "the a sharded model trains on every rank while gathers and reduce scatters move its bytes".split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + ".\n"


def _corpus(root: Path, files: int = 12, seed: int = 0) -> Path:
    rng = random.Random(seed)
    folder = root / "corpus"
    folder.mkdir(parents=True)
    for i in range(files):
        (folder / f"doc{i:02d}.txt").write_text(_text(rng, 40 + 7 * i))
    return folder


def _stream(directory: Path, split: str = "train") -> np.ndarray:
    index = read_index(directory)
    arrays = [np.asarray(a) for a in index.open_split(split)]
    return np.concatenate(arrays) if arrays else np.empty(0, dtype=index.dtype)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """A byte-tokenized corpus with a validation split, shared by the batch and training tests."""
    root = tmp_path_factory.mktemp("data")
    preparing.prepare([str(_corpus(root, files=40))], root / "prepared", val_fraction=0.25, workers=1,
                      progress=False)
    return root / "prepared"


# ---- preparing ------------------------------------------------------------------------------------------


def test_prepare_reads_every_kind_of_input(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="Parquet inputs need pyarrow (pip install -e '.[dev]')")
    import pyarrow.parquet as pq

    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.txt").write_text("first document\n")
    (folder / "b.md").write_text("# second\n")
    (folder / "bad.txt").write_bytes(b"caf\xe9 latin-1\n")  # invalid UTF-8: replaced by U+FFFD
    (folder / "docs.jsonl").write_text(json.dumps({"text": "line one", "id": 1}) + "\n\n"
                                       + json.dumps({"text": "line two"}) + "\n")
    (folder / "empty.txt").write_text("")
    pq.write_table(pa.table({"text": ["row one", "row two"], "n": [1, 2]}), folder / "rows.parquet")
    (folder / ".hidden.txt").write_text("left out")
    report = preparing.prepare([str(folder)], tmp_path / "out", val_fraction=0.0, workers=1, progress=False)
    expected = ["first document\n", "# second\n", "caf\ufffd latin-1\n", "line one", "line two", "row one", "row two"]
    stream = _stream(tmp_path / "out")
    assert stream.dtype == np.uint8
    want = b"".join(d.encode() + b"\0" for d in expected)
    assert stream.tobytes() == want
    assert report.documents == {"train": 7, "val": 0} and report.replaced_files == 1
    assert "invalid UTF-8" in report.summary()


def test_a_second_run_does_nothing_and_a_killed_run_resumes(tmp_path, monkeypatch):
    monkeypatch.setattr(preparing, "GROUP_BYTES", 600)  # several groups from a small corpus
    corpus = _corpus(tmp_path)
    out = tmp_path / "out"
    first = preparing.prepare([str(corpus)], out, workers=1, progress=False)
    assert first.groups >= 4 and not first.up_to_date
    index = json.loads((out / "index.json").read_text())
    again = preparing.prepare([str(corpus)], out, workers=1, progress=False)
    assert again.up_to_date and again.tokens == first.tokens
    # A run killed after some groups: the index and the last group's files were never written.
    (out / "index.json").unlink()
    last = first.groups - 1
    for name in (f"part-{last:05d}.json", f"train-{last:05d}.npy"):
        (out / name).unlink()
    resumed = preparing.prepare([str(corpus)], out, workers=1, progress=False)
    assert resumed.groups_done_before == first.groups - 1 and not resumed.up_to_date
    assert json.loads((out / "index.json").read_text()) == index
    # A changed input is no longer up to date.
    (corpus / "doc00.txt").write_text("changed\n")
    assert not preparing.prepare([str(corpus)], out, workers=1, progress=False).up_to_date


def test_the_stream_does_not_depend_on_the_workers(tmp_path, monkeypatch):
    monkeypatch.setattr(preparing, "GROUP_BYTES", 600)
    corpus = _corpus(tmp_path)
    one = preparing.prepare([str(corpus)], tmp_path / "one", val_fraction=0.3, workers=1, progress=False)
    two = preparing.prepare([str(corpus)], tmp_path / "two", val_fraction=0.3, workers=2, progress=False)
    assert one.tokens == two.tokens and one.tokens["val"] > 0
    for split in ("train", "val"):
        assert np.array_equal(_stream(tmp_path / "one", split), _stream(tmp_path / "two", split))


def test_a_trained_bpe_and_its_tokenizer_json_give_the_same_tokens(tmp_path):
    pytest.importorskip("tokenizers", reason="BPE needs tokenizers (pip install -e '.[dev]')")
    from tokenizers import Tokenizer

    corpus = _corpus(tmp_path)
    trained = preparing.prepare([str(corpus)], tmp_path / "bpe", "train-bpe:300", val_fraction=0.0, workers=1,
                                progress=False)
    index = read_index(tmp_path / "bpe")
    assert index.vocab_size == 300 and index.dtype == "uint16" and index.tokenizer["eod"] == "<|endoftext|>"
    tokenizer = Tokenizer.from_file(str(tmp_path / "bpe" / "tokenizer.json"))
    stream = _stream(tmp_path / "bpe")
    first_doc = stream[:int(np.argmax(stream == index.eod))]
    assert tokenizer.decode(first_doc.tolist()) == (corpus / "doc00.txt").read_text()
    reused = preparing.prepare([str(corpus)], tmp_path / "json", str(tmp_path / "bpe" / "tokenizer.json"),
                               val_fraction=0.0, workers=1, progress=False)
    assert reused.tokens == trained.tokens
    assert np.array_equal(_stream(tmp_path / "json"), stream)


def test_the_command_prints_what_it_wrote_and_then_that_it_is_up_to_date(tmp_path, capsys):
    corpus = _corpus(tmp_path)
    args = ["data", "prepare", str(corpus), "--out", str(tmp_path / "out"), "--workers", "1"]
    assert main(args) == 0
    assert re.search(r"MB/s\n  train: [\d,]+ tokens in \d+ documents", capsys.readouterr().out)
    assert main(args) == 0
    assert "up to date" in capsys.readouterr().out


# ---- batches --------------------------------------------------------------------------------------------


def test_rows_are_the_global_batch_rows_at_every_world_size(data):
    batches = sl.data.tokens(data, seq_len=16, global_batch=8, seed=1)
    for k in (0, 5):
        whole = batches(k)
        assert whole.shape == (8, 17) and whole.dtype == torch.int64
        for world in (1, 2, 4):
            per = 8 // world
            assert torch.equal(torch.cat([batches.rows(k, r * per, (r + 1) * per) for r in range(world)]), whole)


def test_ranks_that_differ_only_in_tp_read_the_same_rows(data, monkeypatch):
    """A row reader is asked for the rows the mesh's data axes give a rank, as a whole global batch is split."""
    monkeypatch.setenv("SHARDLANG_TEST_DATA", str(data))
    job = load_job(TOKENS_JOB)
    for mesh in (sl.Mesh(fsdp=-1, tp=2), sl.Mesh(dp=2, tp=2), sl.Mesh(tp=2, fsdp=-1)):
        on_mesh = attrs.evolve(job, spec=sl.Spec(mesh=mesh))
        read = [rank_batch(on_mesh, 3, 4, rank) for rank in range(4)]
        split = [split_for_rank(on_mesh, on_mesh.make_batch(3), 4, rank, 3) for rank in range(4)]
        assert all(torch.equal(r, s) for r, s in zip(read, split)), mesh
        parts = {mesh.batch_split(4, rank) for rank in range(4)}
        assert len(parts) == 2 and all(r.shape[0] == 4 for r in read), mesh  # two row groups of 4, tp peers share


def test_a_global_batch_the_data_parts_do_not_divide_is_named(data, monkeypatch):
    """At 6 ranks as fsdp=3 x tp=2 the 8 rows are cut in 3 parts, not 6: the error counts data-parallel parts."""
    monkeypatch.setenv("SHARDLANG_TEST_DATA", str(data))
    job = attrs.evolve(load_job(TOKENS_JOB), spec=sl.Spec(mesh=sl.Mesh(fsdp=-1, tp=2)))
    with pytest.raises(ShardlangRuntimeError, match=r"global batch size 8 does not divide into 3 data-parallel parts "
                                                    r"\(mesh .*tp.*\); use a multiple of 3, e\.g\. 6"):
        rank_batch(job, 0, 6, 0)


def test_every_epoch_visits_every_sequence_once_in_an_order_of_the_seed(data):
    batches = sl.data.tokens(data, seq_len=16, global_batch=8, seed=1)
    n = batches.sequences
    stream = _stream(data)
    for epoch in (0, 1):
        seen = [batches.sample(epoch * n + i) for i in range(n)]
        assert sorted(seen) == list(range(n))
    assert [batches.sample(i) for i in range(n)] != [batches.sample(n + i) for i in range(n)]  # reshuffled
    other = sl.data.tokens(data, seq_len=16, global_batch=8, seed=2)
    assert [other.sample(i) for i in range(n)] != [batches.sample(i) for i in range(n)]
    row = batches(0)[0]
    j = batches.sample(0)
    assert row.tolist() == stream[j * 17:(j + 1) * 17].tolist()  # packed: a window of the stream, EOD included


# ---- training -------------------------------------------------------------------------------------------


def _losses(text: str) -> dict[str, float]:
    return {k: float(v) for k, v in re.findall(r"^step (\d+)/\d+  loss (\S+)", text, flags=re.M)}


def test_check_passes_at_1_2_4_on_prepared_data(data, monkeypatch, capsys):
    monkeypatch.setenv("SHARDLANG_TEST_DATA", str(data))
    assert main(["check", TOKENS_JOB, "--world-sizes", "1,2,4", "--steps", "2"]) == 0, capsys.readouterr()


def test_resume_mid_epoch_is_exact_and_another_world_size_reads_the_same_batches(data, tmp_path, monkeypatch,
                                                                                  capfd):
    monkeypatch.setenv("SHARDLANG_TEST_DATA", str(data))
    assert sl.data.tokens(data, seq_len=16, global_batch=8).sequences > 4 * 8  # 4 steps stay inside epoch 0
    ckpt = tmp_path / "ckpt"
    assert main(["run", TOKENS_JOB, "--nproc", "2", "--checkpoint-dir", str(ckpt), "--steps", "4",
                 "--checkpoint-every", "2", "--eval-every", "2"]) == 0
    out = capfd.readouterr().out
    uninterrupted = _losses(out)
    assert list(uninterrupted) == ["1", "2", "3", "4"] and len(re.findall(r"val loss", out)) == 2
    for world, compare in ((2, lambda got, want: got == want), (4, lambda got, want: got == pytest.approx(want,
                                                                                                           rel=1e-5))):
        shutil.rmtree(ckpt / "step-00000004")  # stopped after step 2: resume from step-00000002
        assert main(["run", TOKENS_JOB, "--nproc", str(world), "--checkpoint-dir", str(ckpt), "--steps", "4",
                     "--resume"]) == 0
        resumed = _losses(capfd.readouterr().out)
        assert compare(resumed, {k: uninterrupted[k] for k in ("3", "4")}), (world, resumed, uninterrupted)


# ---- bad input ------------------------------------------------------------------------------------------


def test_a_missing_index_names_the_directory_and_the_command(tmp_path):
    with pytest.raises(DataError, match=r"'nowhere' does not exist .*`shardlang data prepare INPUT\.\.\. "
                                        r"--out nowhere`"):
        sl.data.tokens("nowhere", seq_len=8, global_batch=2)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"has no index.json"):
        sl.data.tokens(tmp_path / "empty", seq_len=8, global_batch=2)


def test_a_damaged_shard_is_named_with_its_checksums(data, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(data, copy)
    shard = copy / "train-00000.npy"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"train-00000\.npy: checksum [0-9a-f]{16} differs from [0-9a-f]{16}"):
        sl.data.tokens(copy, seq_len=8, global_batch=2)


def test_an_index_that_names_a_file_outside_the_directory_is_refused(data, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(data, copy)
    index = json.loads((copy / "index.json").read_text())
    index["splits"]["train"][0]["file"] = "../../etc/passwd"
    (copy / "index.json").write_text(json.dumps(index))
    with pytest.raises(DataError, match=r"shard file '\.\./\.\./etc/passwd' of split 'train' is not a name like"):
        read_index(copy)


def test_seq_len_longer_than_the_stream_names_both(data):
    total = read_index(data).tokens("val")
    with pytest.raises(DataError, match=rf"split 'val' holds {total:,} tokens, fewer than one sequence of "
                                        rf"seq_len \+ 1 = {total + 1:,}"):
        sl.data.tokens(data, seq_len=total, global_batch=2, split="val")


def test_a_vocabulary_larger_than_the_embedding_is_refused_before_training(data, monkeypatch, capsys):
    monkeypatch.setenv("SHARDLANG_TEST_DATA", str(data))
    monkeypatch.setenv("SHARDLANG_TEST_VOCAB", "64")
    assert main(["run", TOKENS_JOB, "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"the data's vocabulary \(.*index\.json\) has 256 tokens, more than the 64 rows of the "
                     r"model's input embedding 'tok_emb'", err), err


def test_bad_inputs_name_the_file_line_and_value(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match=r"a\.jsonl:2: no 'text' field \(it has \['body'\]\); .*--text-field"):
        preparing.prepare([str(tmp_path / "a.jsonl")], tmp_path / "o1", workers=1, progress=False)
    (tmp_path / "b.jsonl").write_text("not json\n")
    with pytest.raises(DataError, match=r"b\.jsonl:1: not a JSON line"):
        preparing.prepare([str(tmp_path / "b.jsonl")], tmp_path / "o2", workers=1, progress=False)
    with pytest.raises(DataError, match=r"input 'missing' does not exist"):
        preparing.prepare(["missing"], tmp_path / "o3", workers=1, progress=False)
    with pytest.raises(DataError, match=r"--tokenizer 'nope' is neither 'byte', 'train-bpe:VOCAB' nor"):
        preparing.prepare([str(tmp_path / "a.jsonl")], tmp_path / "o4", "nope", workers=1, progress=False)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match=r"holds files that are not prepared data \(\['notes.txt'\]\)"):
        preparing.prepare([str(tmp_path / "a.jsonl")], tmp_path / "mine", workers=1, progress=False)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match=r"no training documents"):
        preparing.prepare([str(tmp_path / "empty.txt")], tmp_path / "o5", workers=1, progress=False)
