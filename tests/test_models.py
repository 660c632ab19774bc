"""Sanity of the test models and examples/gpt.py's model, in plain PyTorch (no sharding)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from models import CASES, GLOBAL_BATCH, load_gpt_module

DTYPES = [torch.float32, torch.float64]
FRONT_END = ("Spec", "Mesh", "shard", "AdamW")  # what examples/gpt.py uses at import


def _needs_front_end(name: str) -> None:
    """gpt_tiny loads examples/gpt.py, which builds its ``spec`` with shardlang at import."""
    if name != "gpt_tiny":
        return
    import shardlang

    missing = [n for n in FRONT_END if not hasattr(shardlang, n)]
    if missing:
        names = ", ".join(f"shardlang.{n}" for n in missing)
        pytest.skip(f"examples/gpt.py needs {names} (front end not built yet)")


def _tensors(batch) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return list(batch.values())
    return list(batch)


@pytest.fixture(params=sorted(CASES))
def case(request):
    _needs_front_end(request.param)
    return CASES[request.param]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_backward(case, dtype):
    model = case.build(dtype)
    assert all(p.dtype == dtype for p in model.parameters())
    batch = case.make_batch(0, dtype)
    for t in _tensors(batch):
        assert t.dtype == (dtype if t.is_floating_point() else torch.int64)
    loss = case.loss_fn(model, batch)
    assert loss.dim() == 0 and loss.dtype == dtype and math.isfinite(loss.item())
    loss.backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
        else:
            assert p.grad is None, name


def test_build_is_seeded_and_leaves_global_rng_alone(case):
    state = torch.random.get_rng_state()
    a, b = case.build(), case.build()
    assert torch.equal(state, torch.random.get_rng_state())
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(pa, pb), na
    c = case.build(seed=1)
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))


def test_make_batch_is_deterministic_and_divides_by_4(case):
    b0, b0_again, b1 = case.make_batch(0), case.make_batch(0), case.make_batch(1)
    for t, u in zip(_tensors(b0), _tensors(b0_again), strict=True):
        assert torch.equal(t, u)
    assert any(not torch.equal(t, u) for t, u in zip(_tensors(b0), _tensors(b1)))
    for t in _tensors(b0):
        assert t.shape[0] == GLOBAL_BATCH and t.shape[0] % 4 == 0
    b64 = case.make_batch(0, torch.float64)
    for t32, t64 in zip(_tensors(b0), _tensors(b64)):
        assert torch.equal(t32, t64.to(t32.dtype))


def test_gpt_head_is_tied_to_the_embedding():
    _needs_front_end("gpt_tiny")
    for dtype in DTYPES:
        model = CASES["gpt_tiny"].build(dtype)
        assert model.head.weight is model.tok_emb.weight
        names = [n for n, _ in model.named_parameters()]
        assert "tok_emb.weight" in names and "head.weight" not in names


def test_gpt_module_names():
    _needs_front_end("gpt_tiny")
    model = CASES["gpt_tiny"].build()
    names = {n for n, _ in model.named_modules()}
    assert {"tok_emb", "pos_emb", "blocks", "ln_f", "head"} <= names
    for i in range(len(model.blocks)):
        assert {f"blocks.{i}.{s}" for s in ("ln1", "attn", "ln2", "mlp")} <= names
    assert isinstance(model.blocks, nn.ModuleList)


def test_gpt_learns_in_ten_steps():
    _needs_front_end("gpt_tiny")
    case = CASES["gpt_tiny"]
    model = case.build()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses = []
    for step in range(10):
        loss = case.loss_fn(model, case.make_batch(step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses


def test_gpt_example_job_default_size():
    _needs_front_end("gpt_tiny")
    gpt = load_gpt_module()
    from shardlang.step.materialize import Init, materialize_module

    model = gpt.build_model()
    assert all(p.is_meta for p in model.parameters())  # built on meta: shardlang materialises it
    assert sum(p.numel() for p in model.parameters()) < 300_000
    materialize_module(model, Init(seed=0, init_weights=gpt.init_weights))
    proj = model.blocks[0].mlp.proj.weight
    assert abs(float(proj.std()) - gpt.residual_std(model.config)) < 0.2 * gpt.residual_std(model.config)
    batch = gpt.make_batch(0)
    assert batch.shape[0] % 4 == 0 and batch.dtype == torch.int64
    assert math.isfinite(gpt.loss_fn(model, batch).item())
    big = gpt.GPTConfig(n_layer=4, n_embd=128, n_head=4)
    assert big.n_layer == 4 and gpt.GPTConfig().n_layer == 2


def test_frozen_model_has_frozen_and_trainable_params():
    model = CASES["frozen"].build()
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {"base.weight", "base.bias"}
    assert any(p.requires_grad for p in model.parameters())


def test_frozen_gradient_flows_through_the_frozen_base():
    case = CASES["frozen"]
    model = case.build()
    case.loss_fn(model, case.make_batch(0)).backward()
    assert model.adapter.weight.grad.abs().sum() > 0


def test_prime_model_has_no_even_dims():
    model = CASES["prime"].build()
    for name, p in model.named_parameters():
        assert all(d % 2 == 1 for d in p.shape), (name, tuple(p.shape))
    assert any(p.dim() == 0 for p in model.parameters())


def test_convnet_has_batchnorm_running_stats():
    case = CASES["convnet_bn"]
    model = case.build(torch.float64)
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert bns and all(m.training and m.track_running_stats for m in bns)
    buffers = dict(model.named_buffers())
    stats = ("running_mean", "running_var", "num_batches_tracked")
    assert {f"blocks.{i}.bn.{s}" for i in (0, 1) for s in stats} <= set(buffers)
    assert buffers["blocks.0.bn.running_mean"].dtype == torch.float64
    before = buffers["blocks.0.bn.running_mean"].clone()
    case.loss_fn(model, case.make_batch(0, torch.float64))
    assert not torch.equal(before, buffers["blocks.0.bn.running_mean"])
    assert case.batch_coupled
