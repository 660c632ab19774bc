"""examples/llama.py: the model's pieces against torch's and Meta's formulations, the Llama-3 shapes,
parity with one process at 1, 2 and 4 ranks, and a plan of a big shape."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import parity
import shardlang as sl
from models import EXAMPLES, load_llama_module
from shardlang.cli import main

STEPS = 3
FLOAT64_TOLERANCE = 1e-9


@pytest.fixture(scope="module")
def llama():
    return load_llama_module()


def test_shapes_are_llama3s(llama):
    """Parameter counts: Llama-3-8B and -70B as published; 1b is 3.2-1B untied. (70b counted, not built: 13 s.)"""
    counts = {"70b": llama.SIZES["70b"].n_params}
    for name in ("1b", "8b"):
        with torch.device("meta"):
            model = llama.Llama(llama.SIZES[name])
        counts[name] = sum(p.numel() for p in model.parameters())
        assert counts[name] == llama.SIZES[name].n_params
    assert counts["8b"] == 8_030_261_248
    assert counts["70b"] == 70_553_706_496
    # Llama-3.2-1B ties its head: 1,235,814,400 parameters, plus one untied 128256 x 2048 head here.
    assert counts["1b"] == 1_235_814_400 + 128256 * 2048


def test_every_module_with_parameters_can_be_initialised_from_meta(llama):
    """Built on meta, then allocated and ``reset_parameters()`` module by module, as a materialiser does."""
    with torch.device("meta"):
        model = llama.Llama(llama.LlamaConfig())
    assert all(p.is_meta for p in model.parameters()) and not list(model.buffers())
    model.to_empty(device="cpu")
    for name, module in model.named_modules():
        if list(module.parameters(recurse=False)):
            assert hasattr(module, "reset_parameters"), name
            module.reset_parameters()
    tokens = llama.make_tokens(0, 2, 8, llama.LlamaConfig().vocab_size)
    assert math.isfinite(llama.loss_fn(model, tokens).item())


def test_grouped_query_attention_is_sdpas(llama):
    """The explicit repeat of KV heads computes what sdpa's own ``enable_gqa`` does."""
    config = llama.LlamaConfig(dim=48, n_heads=6, n_kv_heads=2)
    torch.manual_seed(0)
    attention = llama.Attention(config).double()
    x = torch.randn(2, 5, config.dim, dtype=torch.float64)
    cos, sin = llama.rotary_tables(5, config.head_dim, config.rope_theta, torch.float64)
    b, t = 2, 5
    q = attention.wq(x).view(b, t, 6, 8).transpose(1, 2)
    k = attention.wk(x).view(b, t, 2, 8).transpose(1, 2)
    v = attention.wv(x).view(b, t, 2, 8).transpose(1, 2)
    q, k = llama.apply_rotary(q, cos, sin), llama.apply_rotary(k, cos, sin)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    expected = attention.wo(y.transpose(1, 2).reshape(b, t, -1))
    torch.testing.assert_close(attention(x, cos, sin), expected, rtol=1e-12, atol=1e-12)


def test_rotary_is_metas_complex_rotation(llama):
    """Pairs (x[2i], x[2i+1]) turn by t * theta^(-2i/d): Meta's reference multiplies by polar(1, angle)."""
    head_dim, seq, theta = 16, 7, 500000.0
    x = torch.randn(2, 3, seq, head_dim, dtype=torch.float64)
    cos, sin = llama.rotary_tables(seq, head_dim, theta, torch.float64)
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].double() / head_dim)
    freqs_cis = torch.polar(torch.ones(seq, head_dim // 2, dtype=torch.float64), torch.outer(torch.arange(seq).double(), freqs))
    expected = torch.view_as_real(torch.view_as_complex(x.reshape(2, 3, seq, -1, 2)) * freqs_cis).flatten(-2)
    torch.testing.assert_close(llama.apply_rotary(x, cos, sin), expected, rtol=0, atol=1e-6)


def test_rotary_scores_depend_on_relative_position_only(llama):
    head_dim = 8
    q, k = torch.randn(head_dim, dtype=torch.float64), torch.randn(head_dim, dtype=torch.float64)
    cos, sin = llama.rotary_tables(12, head_dim, 10000.0, torch.float64)
    rotated = lambda v, t: llama.apply_rotary(v.view(1, 1, 1, -1), cos[t : t + 1], sin[t : t + 1]).flatten()  # noqa: E731
    score = lambda tq, tk: float(rotated(q, tq) @ rotated(k, tk))  # noqa: E731
    # The angles are float32, as in Meta's code, whatever the model's dtype.
    assert score(5, 2) == pytest.approx(score(9, 6), rel=1e-6)
    assert score(5, 2) != pytest.approx(score(5, 3), rel=1e-3)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_sharded_llama_trains_like_one_process(run_on, references, world_size):
    results = run_on(world_size, parity.train_sharded, "llama_tiny", "adamw", "float64", STEPS)
    ref_losses, ref_params, _ = references("llama_tiny", "adamw")
    for rank, (losses, params, _buffers, _schedule) in enumerate(results):
        assert parity.max_relative_difference(params, ref_params) < FLOAT64_TOLERANCE, f"rank {rank}"
    for k in range(STEPS):
        assert sum(r[0][k] for r in results) / world_size == pytest.approx(ref_losses[k], rel=1e-12)


def test_plan_of_a_70b_layer_at_1024_ranks(llama):
    """Two layers of the 70B shape, planned for 1024 ranks: each rank holds 1/1024 of the weights."""
    config = llama.LlamaConfig(**{**llama.SIZES["70b"].__dict__, "n_layers": 2, "max_seq_len": 256})
    world = 1024
    batch = llama.make_tokens(0, 1, config.max_seq_len, config.vocab_size)
    plan = sl.plan(lambda: llama.Llama(config), llama.loss_fn, llama.spec, optimizer=llama.optimizer,
                   example_batch=batch, world_size=world)
    schedule = plan.schedule
    assert {f.unit for f in plan.flats} == {"", "layers.0", "layers.1", "output", "tok_embeddings"}
    weights = config.n_params * 4
    held = sum(f.shard_numel * 4 for f in plan.flats)
    assert weights / world <= held < weights / world * 1.01  # padding only
    gathers = [op for op in schedule.ops if op.kind is sl.OpKind.ALL_GATHER]
    assert {op.unit for op in gathers} >= {"layers.0", "layers.1", "tok_embeddings", "output"}


def test_llama_size_is_checked(monkeypatch, capsys):
    monkeypatch.setenv("LLAMA_SIZE", "7b")
    assert main(["plan", str(EXAMPLES / "llama.py"), "--world", "2"]) == 2
    err = capsys.readouterr().err
    assert "LLAMA_SIZE='7b'" in err and "tiny, 1b, 8b, 70b" in err


def test_llama_seq_sets_the_sequence_length_and_is_checked(llama):
    assert llama.seq_from_env("8b", {"LLAMA_SEQ": "8192"}) == 8192
    assert llama.seq_from_env("tiny", {}) == llama.SIZES["tiny"].max_seq_len
    with pytest.raises(sl.SpecError, match=r"LLAMA_SEQ='8k' is not a sequence length; expected an integer >= 1"):
        llama.seq_from_env("8b", {"LLAMA_SEQ": "8k"})
