"""Loading HF folders: errors that name the problem; orbax round trip of converted params."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from gdn_jax.config import ModelConfig
from gdn_jax.weights import load_hf_weights, load_model, restore_params, save_params

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "hf_tiny"


def _copy_with(tmp: Path, edit_tensors=None, edit_config=None) -> Path:
    out = tmp / "model"
    out.mkdir()
    tensors = load_file(FIXTURE / "model.safetensors")
    cfg = json.loads((FIXTURE / "config.json").read_text())
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(cfg)
    save_file(tensors, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_missing_tensor_is_named(tmp_path):
    name = "model.layers.1.linear_attn.A_log"
    folder = _copy_with(tmp_path, edit_tensors=lambda t: t.pop(name))
    with pytest.raises(ValueError, match=f"missing tensor.*{name}"):
        load_hf_weights(folder)


def test_misshaped_tensor_is_named(tmp_path):
    name = "model.layers.3.self_attn.k_proj.weight"
    folder = _copy_with(tmp_path, edit_tensors=lambda t: t.__setitem__(name, t[name][:-1]))
    with pytest.raises(ValueError, match=f"{name}.*shape"):
        load_hf_weights(folder)


def test_unsupported_model_type_is_named(tmp_path):
    folder = _copy_with(tmp_path, edit_config=lambda c: c.__setitem__("model_type", "llama"))
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        load_hf_weights(folder)


def test_unknown_model_name_is_an_error():
    with pytest.raises(ValueError, match="neither a preset"):
        load_model("no-such-model")


def test_config_reads_layer_pattern_and_rope(tmp_path):
    cfg = ModelConfig.from_pretrained(FIXTURE)
    assert cfg.linear_layer_ids == (0, 1, 2) and cfg.full_layer_ids == (3,)
    assert cfg.rotary_dim == 8 and cfg.rope_theta == 10000.0
    assert hash(cfg) == hash(ModelConfig.from_pretrained(FIXTURE))  # hashable: static under jit


def test_orbax_round_trip_restores_identical_params(tmp_path):
    cfg, graphdef, params = load_hf_weights(FIXTURE)
    save_params(params, tmp_path / "ckpt")
    _, restored = restore_params(tmp_path / "ckpt", cfg)
    a, b = jax.tree.leaves(nnx.to_pure_dict(params)), jax.tree.leaves(nnx.to_pure_dict(restored))
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
