"""Models larger than one rank: meta construction, materialisation unit by unit, pretrained weights, ownership.

Parity: a model built on the meta device and materialised by each rank
(Note [materialisation]) trains like one process that materialised the whole
model the same way (`materialize_module`) and ran torch.optim, at N=1, 2, 4
and under specs with other units, strategies and layouts (Note [initial
values]). A model loaded from safetensors (one file, or the Hugging Face
layout) trains like one process that ran ``load_state_dict``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
from unittest import mock

import pytest
import safetensors
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import shardlang as sl
from shardlang.compiler.layout.flat import Member, member_piece
from shardlang.compiler.layout.placement import LayoutKind, ParamInfo, Placement
from shardlang.step.materialize import Init, materialize_module, module_seed
from shardlang.step.ownership import is_released
from shardlang.step.weights import Block, WeightFiles

import materialize_workers as w
import parity

STEPS = 3
TOLERANCE = 1e-9  # float64, as test_parity.py


@functools.cache
def meta_reference(case: str, optimizer: str = "adamw"):
    return w.reference(case, optimizer, "float64", STEPS)


@functools.cache
def weights_reference(path: str):
    return w.reference("gpt_tiny", "adamw", "float64", STEPS, weights=path)


def assert_matches(result, ref):
    losses, params, buffers = result
    _, ref_params, ref_buffers = ref
    assert parity.max_relative_difference(params, ref_params) < TOLERANCE
    for name, b in ref_buffers.items():
        assert parity.max_relative_difference({name: buffers[name].double()}, {name: b.double()}) < 1e-9, name


# ---- meta construction -------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("case", ["gpt_tiny", "convnet_bn", "hf_style"])
def test_meta_model_trains_like_one_process(run_on, case, world_size):
    results = run_on(world_size, w.train_meta, case, "adamw", "float64", STEPS)
    ref_losses = meta_reference(case)[0]
    assert_matches(results[0], meta_reference(case))
    if not w.META_CASES[case].batch_coupled:  # each rank's loss is its shard's; their mean is the batch's
        for k in range(STEPS):
            assert sum(r[0][k] for r in results) / world_size == pytest.approx(ref_losses[k], rel=1e-12)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("variant", ["root_only", "zero1", "dim0"])
def test_every_spec_starts_from_the_same_weights(run_on, variant, world_size):
    result = run_on(world_size, w.train_meta, "hf_style", "adamw", "float64", STEPS, variant)[0]
    assert_matches(result, meta_reference("hf_style"))


def test_frozen_parameters_stay_frozen_on_meta(run_on):
    assert_matches(run_on(2, w.train_meta, "frozen", "sgd", "float64", STEPS)[0], meta_reference("frozen", "sgd"))


def test_initial_values_come_from_the_seed_and_the_module_name():
    a, b = (materialize_module(w.meta_model("gpt_tiny", "float32"), Init(seed=s)) for s in (0, 1))
    again = materialize_module(w.meta_model("gpt_tiny", "float32"), Init(seed=0))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), again.parameters()))
    assert not torch.equal(a.blocks[0].mlp.fc.weight, b.blocks[0].mlp.fc.weight)
    assert not torch.equal(a.blocks[0].mlp.fc.weight, a.blocks[1].mlp.fc.weight)  # each module its own seed
    assert a.head.weight is a.tok_emb.weight  # ties survive
    assert module_seed(0, "blocks.0") == module_seed(0, "blocks.0") != module_seed(0, "blocks.1")


def test_a_rank_holds_one_unit_at_a_time(run_on):
    peak, largest_unit, whole = run_on(2, w.materialise_peak, "hf_style", "units")[0]
    assert peak <= largest_unit < whole


class NoInit(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gain = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return self.fc(x) * self.gain


def no_init_loss(model, batch):
    return model(batch).pow(2).mean()


def test_a_meta_module_without_reset_parameters_is_an_error_before_allocating():
    with torch.device("meta"):
        model = NoInit()
    with mock.patch("shardlang.step.materialize._allocate") as allocate, \
            pytest.raises(sl.SpecError, match=r"module '<root>' \(NoInit\) holds 'gain' on the meta device but has "
                                              r"no reset_parameters\(\)"):
        sl.compile(model, no_init_loss, sl.Spec(sl.Mesh(fsdp=1)), example_batch=torch.ones(2, 4))
    allocate.assert_not_called()


def test_init_weights_that_leaves_a_parameter_unset_is_an_error():
    with torch.device("meta"):
        model = NoInit()
    with pytest.raises(sl.SpecError, match=r"'gain' has no initial value .*'<root>' \(NoInit\)"):
        sl.compile(model, no_init_loss, sl.Spec(sl.Mesh(fsdp=1)), example_batch=torch.ones(2, 4),
                   init_weights=lambda module: None)


def test_init_weights_covers_a_module_without_reset_parameters():
    with torch.device("meta"):
        model = NoInit()

    def init(module):
        if isinstance(module, NoInit):
            module.gain.fill_(2.0)

    step = sl.compile(model, no_init_loss, sl.Spec(sl.Mesh(fsdp=1)), example_batch=torch.ones(2, 4),
                      init_weights=init, optimizer=sl.SGD(lr=0.0))
    assert torch.equal(step.full_parameters()["gain"], torch.full((4,), 2.0))


# ---- pretrained weights ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    return {"file": w.save_pretrained("gpt_tiny", "float64", str(root / "single"), sharded=False),
            "hf_layout": w.save_pretrained("gpt_tiny", "float64", str(root / "hf"), sharded=True)}


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("layout", ["file", "hf_layout"])
def test_pretrained_weights_train_like_load_state_dict(run_on, saved, layout, world_size):
    result = run_on(world_size, w.train_meta, "gpt_tiny", "adamw", "float64", STEPS, "units", saved[layout])[0]
    assert_matches(result, weights_reference(saved[layout]))


def test_pretrained_weights_with_buffers(run_on, tmp_path):
    path = w.save_pretrained("convnet_bn", "float64", str(tmp_path / "bn"), sharded=True)
    result = run_on(2, w.train_meta, "convnet_bn", "adamw", "float64", STEPS, "units", path)[0]
    assert_matches(result, w.reference("convnet_bn", "adamw", "float64", STEPS, weights=path))


@pytest.mark.parametrize("variant", ["dim0", "zero1"])
def test_pretrained_weights_under_other_layouts(run_on, saved, variant):
    result = run_on(4, w.train_meta, "gpt_tiny", "adamw", "float64", STEPS, variant, saved["hf_layout"])[0]
    assert_matches(result, weights_reference(saved["hf_layout"]))


@st.composite
def members(draw):
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    kind = draw(st.sampled_from([LayoutKind.SHARD_FLAT, LayoutKind.SHARD_DIM, LayoutKind.REPLICATE]))
    dim = draw(st.integers(0, len(shape) - 1)) if kind is LayoutKind.SHARD_DIM else None
    world = draw(st.integers(1, 5))
    placement = Placement(kind=kind, axis=None if kind is LayoutKind.REPLICATE else "fsdp", dim=dim)
    info = ParamInfo(name="p", shape=torch.Size(shape), dtype=torch.float32, trainable=True, unit="",
                     placement=placement)
    return Member(info=info, world=1 if kind is LayoutKind.REPLICATE else world, offset=0)


@settings(max_examples=60, deadline=None)
@given(member=members(), data=st.data())
def test_a_slice_read_from_the_file_is_the_piece_cut_from_the_tensor(tmp_path_factory, member, data):
    from safetensors.torch import save_file

    full = torch.arange(member.info.numel, dtype=torch.float64).reshape(member.info.shape)
    path = tmp_path_factory.mktemp("piece") / "p.safetensors"
    save_file({"p": full}, str(path))
    rank = data.draw(st.integers(0, member.world - 1))
    sliced = member.kind is not LayoutKind.REPLICATE and member.world > 1
    # a sharded piece comes through get_slice: the whole tensor is never read
    with mock.patch.object(WeightFiles, "read", side_effect=AssertionError("read whole")) if sliced \
            else contextlib.nullcontext():
        got = WeightFiles.open(path).read_piece("p", member, rank)
    assert torch.equal(got, member_piece(member, full.float(), rank))


@settings(max_examples=60, deadline=None)
@given(member=members(), data=st.data())
def test_a_slice_read_from_a_tp_block_is_the_piece_cut_from_the_block(tmp_path_factory, member, data):
    """On a tensor axis a member is a rank's tp block: the file is read at the block's place, nothing more."""
    from safetensors.torch import save_file

    shape = list(member.info.shape)
    dim, tp = data.draw(st.integers(0, len(shape) - 1)), data.draw(st.integers(1, 4))
    at = data.draw(st.integers(0, tp - 1))
    shape[dim] *= tp
    full = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    path = tmp_path_factory.mktemp("block") / "p.safetensors"
    save_file({"p": full}, str(path))
    rank = data.draw(st.integers(0, member.world - 1))
    block = Block(dim, at * member.info.shape[dim], member.info.shape[dim])
    with mock.patch.object(WeightFiles, "_handle", wraps=None) as handle:
        real = safetensors.safe_open(str(path), framework="pt")
        handle.return_value = mock.Mock(get_slice=real.get_slice,
                                        get_tensor=mock.Mock(side_effect=AssertionError("read whole")))
        got = WeightFiles.open(path).read_piece("p", member, rank, block)
    assert torch.equal(got, member_piece(member, full.chunk(tp, dim)[at].float(), rank))


def test_weights_that_do_not_fit_the_model_are_errors_naming_the_tensor_and_file(tmp_path):
    from safetensors.torch import save_file

    model = w.META_CASES["gpt_tiny"].build(torch.float64)
    good = {n: p.detach().clone() for n, p in model.named_parameters()}
    cases = {
        "missing": ({k: v for k, v in good.items() if k != "ln_f.bias"}, r"parameter 'ln_f.bias' is not in"),
        "unexpected": ({**good, "extra.weight": torch.zeros(2)},
                       r"tensor 'extra.weight' in .*unexpected\.safetensors is not a parameter or buffer of GPT"),
        "misshapen": ({**good, "ln_f.bias": torch.zeros(3)},
                      r"tensor 'ln_f.bias' in .*misshapen\.safetensors has shape \[3\]; the model's 'ln_f.bias' has "
                      r"shape \[16\]"),
    }
    for name, (tensors, message) in cases.items():
        save_file(tensors, str(tmp_path / f"{name}.safetensors"))
        with torch.device("meta"):
            meta = w.META_CASES["gpt_tiny"].builder()
        with pytest.raises(sl.SpecError, match=message):
            sl.compile(meta, w.META_CASES["gpt_tiny"].loss_fn, sl.Spec(sl.Mesh(fsdp=1)),
                       example_batch=w.META_CASES["gpt_tiny"].make_batch(0),
                       weights=str(tmp_path / f"{name}.safetensors"))
    with pytest.raises(sl.SpecError, match=r"weights 'nowhere.safetensors' does not exist"):
        WeightFiles.open("nowhere.safetensors")


# ---- the step owns the state -------------------------------------------------------------------


def test_after_compile_the_module_holds_no_storage_and_says_where_the_weights_are():
    case = w.META_CASES["gpt_tiny"]
    model = case.build(torch.float64)  # real weights, sharded as they are
    batch = case.make_batch(0)
    step = sl.compile(model, case.loss_fn, sl.Spec(sl.Mesh(fsdp=1), units=case.units), example_batch=batch)
    assert is_released(model)
    assert all(t.is_meta for t in (*model.parameters(), *model.buffers()))
    assert model.head.weight is model.tok_emb.weight
    with pytest.raises(sl.ShardlangRuntimeError, match=r"owns its weights now.*step\.load_into\(model\)"):
        model(batch[:, :-1])
    # still traceable: planned and compiled again from the released module
    sl.plan(model, case.loss_fn, sl.Spec(sl.Mesh(fsdp=-1), units=case.units), example_batch=batch, world_size=4)
    with pytest.raises(sl.ShardlangRuntimeError, match=r"already compiled into a step, which took its weights"):
        sl.compile(model, case.loss_fn, sl.Spec(sl.Mesh(fsdp=1), units=case.units), example_batch=batch)
    step(batch)
    step.load_into(model)
    assert not is_released(model) and model.head.weight is model.tok_emb.weight
    assert all(torch.equal(p, step.full_parameters()[n]) for n, p in model.named_parameters())
    assert torch.equal(case.loss_fn(model, batch), case.loss_fn(model, batch))  # callable again


def test_a_released_module_compiles_again_to_the_same_state(run_on):
    first, second = run_on(2, w.compile_twice_after_release, "gpt_tiny")[1]
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("world, hybrid", [(2, False), (4, False), (4, True)])
def test_full_state_dict_is_gathered_to_rank_0_only(run_on, world, hybrid):
    results = run_on(world, w.state_dict_on_rank0, "convnet_bn", hybrid)
    (sd, params, issued), others = results[0], results[1:]
    reference = w.meta_model("convnet_bn", "float64").state_dict()
    assert list(sd) == list(reference) or set(sd) == set(reference)
    assert all(torch.equal(sd[n], p) for n, p in params.items())
    assert issued.get("gather") and not issued.get("all_gather")  # to rank 0, not to every rank
    for rank, (other, _, sent) in enumerate(others, start=1):
        assert other == {}, f"rank {rank}"
        in_rank0_group = not hybrid or rank < world // 2  # the replicate axis is the outer one
        assert sent.get("gather", 0) == (issued["gather"] if in_rank0_group else 0) and not sent.get("all_gather")


def test_full_state_dict_names_tied_parameters_by_every_name():
    case = w.META_CASES["gpt_tiny"]
    with torch.device("meta"):
        model = case.builder()
    step = sl.compile(model, case.loss_fn, sl.Spec(sl.Mesh(fsdp=1), units=case.units),
                      example_batch=case.make_batch(0))
    sd = step.full_state_dict()
    assert set(sd) == set(case.build().state_dict())
    assert torch.equal(sd["head.weight"], sd["tok_emb.weight"])


def test_plan_and_check_take_a_meta_job_with_a_dtype(tmp_path, capsys):
    from shardlang.cli import main

    job = tmp_path / "meta_job.py"
    job.write_text(
        "import torch\nimport shardlang as sl\n"
        "def build_model():\n"
        "    with torch.device('meta'):\n"
        "        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))\n"
        "def loss_fn(model, batch):\n    return model(batch).pow(2).mean()\n"
        "def make_batch(step):\n    return torch.randn(8, 4, generator=torch.Generator().manual_seed(step))\n"
        "dtype = torch.float64\n"
        "optimizer = sl.SGD(lr=0.1)\n")
    assert main(["plan", str(job), "--world", "2"]) == 0
    assert main(["check", str(job), "--world-sizes", "1"]) == 0
    assert "PASS" in capsys.readouterr().out


@pytest.mark.parametrize("meta", [False, True], ids=["real", "meta"])
def test_a_job_dtype_keeps_tied_weights_tied_under_plan_and_check(tmp_path, capsys, meta, run_on):
    """plan builds under a fake mode, where Module.to(dtype) cannot swap a tied parameter.

    check's ranks run on the shared worker pools (spawning dominates), at N = 1, 2 and 4.
    """
    from shardlang.cli import check, main

    job = tmp_path / "tied_job.py"
    device = "torch.device('meta')" if meta else "contextlib.nullcontext()"
    job.write_text(
        "import contextlib\nimport torch\nimport shardlang as sl\n"
        "class Tied(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.emb = torch.nn.Embedding(16, 8)\n"
        "        self.head = torch.nn.Linear(8, 16, bias=False)\n"
        "        self.head.weight = self.emb.weight\n"
        "    def forward(self, x):\n        return self.head(self.emb(x))\n"
        f"def build_model():\n    with {device}:\n        return Tied()\n"
        "def loss_fn(model, batch):\n    return model(batch).logsumexp(-1).mean()\n"
        "def make_batch(step):\n    return torch.randint(0, 16, (4, 3), generator=torch.Generator().manual_seed(step))\n"
        "dtype = torch.float64\n"
        "optimizer = sl.SGD(lr=0.1)\n")
    assert main(["plan", str(job), "--world", "2", "--json"]) == 0
    flats = json.loads(capsys.readouterr().out)["flats"]
    assert sum(f["padded_bytes"] for f in flats) == 16 * 8 * 8  # one float64 copy of the tied weight
    with mock.patch.object(check, "launch", lambda fn, world, *args, **_: run_on(world, fn, *args)):
        assert main(["check", str(job), "--world-sizes", "1,2,4"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line[:1].isdigit()]
    assert [(row[0], row[3]) for row in rows] == [("1", "PASS"), ("2", "PASS"), ("4", "PASS")]
