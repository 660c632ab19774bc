"""Hugging Face models, as their users have them: built on meta, loaded from a `save_pretrained` directory.

No job code beyond building the model: the model's own ``_init_weights`` gives
the tensors no file holds (the rotary embedding's ``inv_freq``, BERT's
``position_ids``) their values (Note [the model's own initialiser]), and the
directory is read as ``save_pretrained`` wrote it (several shards and an index).
Each model trains three steps at N=1, 2, 4 against ``from_pretrained`` +
``torch.optim.AdamW`` in one process. Needs ``transformers`` (installed by
``pip install -e '.[dev]'``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the Hugging Face tests need transformers (pip install -e '.[dev]')")

import torch  # noqa: E402

import hf_workers as w  # noqa: E402

STEPS = 3


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: w.save_pretrained(name, str(root / name)) for name in w.UNITS}


@pytest.fixture(scope="module")
def reference(saved):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = w.train_reference(name, saved[name], STEPS)
        return cache[name]
    return get


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_hugging_face_model_trains_like_from_pretrained(run_on, saved, reference, name, world_size):
    losses, params = run_on(world_size, w.train_sharded, name, saved[name], STEPS)[0]
    ref_losses, ref_params = reference(name)
    assert losses == pytest.approx(ref_losses, rel=1e-9)
    assert set(params) == set(ref_params)
    for param, value in ref_params.items():
        # atol: BERT's key biases get no gradient (softmax ignores a shift), only rounding noise near 1e-15
        torch.testing.assert_close(params[param], value, rtol=1e-9, atol=1e-12, msg=param)


def test_the_directory_is_sharded_with_an_index(saved):
    from pathlib import Path

    files = sorted(p.name for p in Path(saved["llama"]).iterdir())
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 1
