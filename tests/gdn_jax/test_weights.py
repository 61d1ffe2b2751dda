"""Loading HF folders: errors that name the problem; orbax round trip of converted params."""

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from gdn_jax.config import ModelConfig, get_preset
from gdn_jax.model.weights import load_hf_weights, load_model, restore_params, save_hf_weights, save_params

pytestmark = pytest.mark.startup

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


def test_missing_part_of_a_fused_projection_is_named(tmp_path):
    """in_proj_z is one of the four HF tensors stacked into the GDN layer's fused in_proj: loading without it names
    it, rather than leaving its rows of the fused matrix unset."""
    name = "model.layers.0.linear_attn.in_proj_z.weight"
    folder = _copy_with(tmp_path, edit_tensors=lambda t: t.pop(name))
    with pytest.raises(ValueError, match=f"missing tensor.*{name}"):
        load_hf_weights(folder)


def test_fused_projections_stack_the_hf_tensors_in_order():
    """The fused matrices hold the HF tensors, in the HF layout [out, in], stacked in the order of `fused_parts`."""
    cfg, _, params = load_hf_weights(FIXTURE)
    tensors = load_file(FIXTURE / "model.safetensors")
    pure = nnx.to_pure_dict(params)
    gdn = np.asarray(pure["layers"][0]["linear_attn"]["in_proj"]["kernel"], np.float32)
    want = np.concatenate([tensors[f"model.layers.0.linear_attn.in_proj_{p}.weight"] for p in ("qkv", "z", "b", "a")])
    np.testing.assert_array_equal(gdn, want.astype(np.float32))
    mlp = np.asarray(pure["layers"][3]["mlp"]["gate_up_proj"]["kernel"], np.float32)
    want = np.concatenate([tensors[f"model.layers.3.mlp.{p}_proj.weight"] for p in ("gate", "up")])
    np.testing.assert_array_equal(mlp, want.astype(np.float32))


def test_misshaped_tensor_is_named(tmp_path):
    name = "model.layers.3.self_attn.k_proj.weight"
    folder = _copy_with(tmp_path, edit_tensors=lambda t: t.__setitem__(name, t[name][:-1]))
    with pytest.raises(ValueError, match=rf"{name}.*shape \(63, 64\), expected \(64, 64\)"):
        load_hf_weights(folder)


def test_a_misshaped_conv_weight_is_named_with_the_shapes_of_the_hf_layout(tmp_path):
    """The message gives the shape the file holds and the one the HF layout has ([C, 1, K]), not the [C, K] the
    loader keeps."""
    name = "model.layers.1.linear_attn.conv1d.weight"
    folder = _copy_with(tmp_path, edit_tensors=lambda t: t.__setitem__(name, t[name][:-1]))
    with pytest.raises(ValueError, match=rf"{name}.*shape \(127, 1, 4\), expected \(128, 1, 4\)"):
        load_hf_weights(folder)


def test_a_conv_weight_with_more_than_one_input_channel_is_named(tmp_path):
    """The depthwise conv's HF weight is [C, 1, K]; [C, 2, K] is no Qwen3.5 conv, not a weight to take a slice of."""
    name = "model.layers.0.linear_attn.conv1d.weight"
    folder = _copy_with(tmp_path, edit_tensors=lambda t: t.__setitem__(name, np.repeat(t[name], 2, axis=1)))
    with pytest.raises(ValueError, match=rf"{name}.*shape \(\d+, 2, 4\)"):
        load_hf_weights(folder)


def test_an_integer_tensor_is_named(tmp_path):
    name = "model.norm.weight"
    folder = _copy_with(tmp_path, edit_tensors=lambda t: t.__setitem__(name, t[name].astype(np.int32)))
    with pytest.raises(ValueError, match=f"{name}.*dtype I32, expected a floating-point dtype"):
        load_hf_weights(folder)


def test_a_float8_tensor_without_a_quantization_config_is_named(tmp_path):
    """Float8 weights come with scales that only a quantized config describes: without one the raw values would be
    the weights. Named from the file's header, whatever the array library could make of them."""
    import ml_dtypes

    name = "model.layers.0.mlp.down_proj.weight"
    folder = _copy_with(tmp_path, edit_tensors=lambda t: t.__setitem__(name, t[name].astype(ml_dtypes.float8_e4m3fn)))
    with pytest.raises(ValueError, match=rf"{name}' in .*model.safetensors has dtype F8_E4M3, expected a "
                                         rf"floating-point dtype \(F16, BF16, F32, F64\)"):
        load_hf_weights(folder)


@pytest.mark.parametrize("name, value", [("model.layers.0.mlp.down_proj.weight", np.nan),
                                         ("model.embed_tokens.weight", np.inf),
                                         ("model.layers.1.linear_attn.A_log", -np.inf)])
def test_a_tensor_holding_nan_or_infinity_is_named(tmp_path, name, value):
    """A damaged checkpoint loaded, and every logit came out NaN: the engine answered token 0 over and over, as a
    normal finish."""
    def damage(t):
        t[name] = t[name].copy()
        t[name].flat[3] = value
    with pytest.raises(ValueError, match=f"tensor '{name}' in .* holds NaN or infinite values"):
        load_hf_weights(_copy_with(tmp_path, edit_tensors=damage))


def test_a_tied_models_own_lm_head_holding_nan_is_named(tmp_path):
    def damage(t):
        t["lm_head.weight"] = np.full_like(t["model.embed_tokens.weight"], np.nan)
    folder = _copy_with(tmp_path, edit_tensors=damage, edit_config=lambda c: c.update(tie_word_embeddings=True))
    with pytest.raises(ValueError, match="tensor 'lm_head.weight' in .* holds NaN or infinite values"):
        load_hf_weights(folder)


def _shard(folder: Path, tensors: dict, split: str) -> None:
    """Rewrites the folder as two shards and an index: the tensors up to `split` (in name order) in the first."""
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    first = {n: tensors[n] for n in names if n <= split}
    second = {n: tensors[n] for n in names if n > split}
    save_file(first, folder / "a.safetensors")
    save_file(second, folder / "b.safetensors")
    weight_map = {n: "a.safetensors" for n in first} | {n: "b.safetensors" for n in second}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_a_tensor_stored_twice_is_named_with_both_files(tmp_path):
    """Two copies of one weight (in two shards, or under the text and the multimodal prefix in one file): the copy
    read last silently won, and the model's numbers depended on the file order."""
    folder = _copy_with(tmp_path)
    tensors = load_file(folder / "model.safetensors")
    name = "model.norm.weight"
    _shard(folder, tensors, split="model.layers.2")
    extra = load_file(folder / "a.safetensors") | {name: np.full_like(tensors[name], 7.0)}
    save_file(extra, folder / "a.safetensors")
    with pytest.raises(ValueError, match=f"tensor '{name}' is stored twice in .*: as '{name}' in a.safetensors and "
                                         f"as '{name}' in b.safetensors"):
        load_hf_weights(folder)
    prefixed = tmp_path / "prefixed"
    prefixed.mkdir()
    (prefixed / "config.json").write_text((FIXTURE / "config.json").read_text())
    alias = "model.language_model.layers.0.mlp.down_proj.weight"
    save_file(tensors | {alias: tensors["model.layers.0.mlp.down_proj.weight"]}, prefixed / "model.safetensors")
    with pytest.raises(ValueError, match=f"'model.layers.0.mlp.down_proj.weight' is stored twice .*as '{alias}' in "
                                         f"model.safetensors and as 'model.layers.0.mlp.down_proj.weight' in"):
        load_hf_weights(prefixed)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/tmp/outside.safetensors"])
def test_an_index_naming_a_shard_outside_the_folder_is_refused(tmp_path, shard):
    folder = _copy_with(tmp_path)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.norm.weight": shard}}))
    with pytest.raises(ValueError, match=f"names shard\\(s\\) outside the folder: {shard}"):
        load_hf_weights(folder)


def test_a_config_of_more_layers_than_the_checkpoint_is_named_before_the_model_is_built(tmp_path, monkeypatch):
    """The names are checked against the files' headers first: building a 400-layer model only to find layer 4
    missing took minutes."""
    import gdn_jax.model.weights as weights

    def edit(c):
        c.pop("layer_types")
        c["num_hidden_layers"] = 400
    folder = _copy_with(tmp_path, edit_config=edit)
    monkeypatch.setattr(weights, "abstract_model", lambda *a, **k: pytest.fail("the model was built first"))
    with pytest.raises(ValueError, match="missing tensor.*model.layers.4."):
        load_hf_weights(folder)


def test_a_damaged_orbax_checkpoint_is_named(tmp_path):
    cfg, _, params = load_hf_weights(FIXTURE)
    save_params(params, tmp_path / "ckpt")
    for meta in (tmp_path / "ckpt").rglob("_METADATA"):
        meta.write_text("{bad")
    with pytest.raises(ValueError, match=f"{tmp_path / 'ckpt'}: cannot restore params for"):
        restore_params(tmp_path / "ckpt", cfg)
    with pytest.raises(ValueError, match=f"no params saved at {tmp_path / 'nothing'}"):
        restore_params(tmp_path / "nothing", cfg)


def test_a_broken_checkpoint_file_is_named(tmp_path):
    """A truncated shard, an index naming a shard that is not there, an index without its weight map."""
    folder = _copy_with(tmp_path)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=f"{weights} cannot be read as safetensors"):
        load_hf_weights(folder)
    weights.write_bytes(data)
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ValueError, match="names shard\\(s\\) missing .*model-00002-of-00002.safetensors"):
        load_hf_weights(folder)
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="is no safetensors index"):
        load_hf_weights(folder)
    index.write_text(json.dumps({"weight_map": {"model.norm.weight": 1}}))  # a shard named by no file name
    with pytest.raises(ValueError, match="is no safetensors index"):
        load_hf_weights(folder)


def test_unsupported_model_type_is_named(tmp_path):
    folder = _copy_with(tmp_path, edit_config=lambda c: c.__setitem__("model_type", "llama"))
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        load_hf_weights(folder)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.pop("vocab_size"), "the model config lacks 'vocab_size'"),
    (lambda c: c.__setitem__("hidden_size", None), "the model config lacks 'hidden_size'"),
    (lambda c: c.__setitem__("tie_word_embeddings", "false"), "'tie_word_embeddings' must be true or false"),
    (lambda c: c.__setitem__("eos_token_id", "1"), "'eos_token_id' must be a token id"),
    (lambda c: c.__setitem__("rms_norm_eps", "1e-6"), "'rms_norm_eps' must be a small positive number"),
    (lambda c: c.__setitem__("rms_norm_eps", 1e30), r"'rms_norm_eps' must be a small positive number \(0 < eps < 1\)"),
    (lambda c: c.__setitem__("rms_norm_eps", float("inf")), "'rms_norm_eps' must be a small positive number"),
    (lambda c: c.__setitem__("eos_token_id", 99999), r"'eos_token_id' is 99999, outside the vocabulary \[0, 512\)"),
    (lambda c: c.__setitem__("num_key_value_heads", 3),
     r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
    (lambda c: c.update(model_type="qwen3_5", text_config=[1]), "'text_config' must be a JSON object, got \\[1\\]"),
    (lambda c: c.__setitem__("num_key_value_heads", 0), "'num_key_value_heads' must be a positive int, got 0"),
    (lambda c: c.__setitem__("hidden_size", "64"), "'hidden_size' must be a positive int, got '64'"),
    (lambda c: c.__setitem__("vocab_size", 512.0), "'vocab_size' must be a positive int, got 512.0"),
    (lambda c: c.update(model_type="qwen3_5"), "a qwen3_5 config needs its text_config"),
])
def test_a_config_field_missing_or_of_the_wrong_type_is_named(tmp_path, edit, message):
    """A string "false" is true in Python: such fields are refused, not converted (the model would be another).
    Nonsense values a model would still compute with (an rms_norm_eps of 1e30: constant logits; an EOS the
    vocabulary cannot produce: requests that never end) are refused too; the error names config.json."""
    folder = _copy_with(tmp_path, edit_config=edit)
    with pytest.raises(ValueError, match=message) as e:
        load_hf_weights(folder)
    assert str(e.value).startswith(f"{folder / 'config.json'}: ")


def test_unknown_model_name_is_an_error():
    with pytest.raises(ValueError, match="neither a shipped model"):
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


def test_save_hf_weights_round_trips_through_the_loader(tmp_path):
    """The HF folder the training script ships (config.json + model.safetensors in the HF layout) loads back to the
    same config and params, and its tensors have the HF names and shapes of the reference fixture."""
    cfg, _, params = load_hf_weights(FIXTURE)
    save_hf_weights(tmp_path / "out", cfg, params)
    cfg2, _, params2 = load_hf_weights(tmp_path / "out")
    assert dataclasses.replace(cfg2, name=cfg.name) == cfg
    for a, b in zip(jax.tree.leaves(nnx.to_pure_dict(params)), jax.tree.leaves(nnx.to_pure_dict(params2))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ours, ref = load_file(tmp_path / "out" / "model.safetensors"), load_file(FIXTURE / "model.safetensors")
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in ref.items() if not k.startswith("mtp.")}


def test_hf_config_dict_round_trips():
    cfg = dataclasses.replace(get_preset("hybrid-1024"), tie_word_embeddings=True, partial_rotary_factor=0.5)
    assert ModelConfig.from_hf_config(cfg.to_hf_config(), name=cfg.name) == cfg


def test_a_config_without_head_dim_takes_the_transformers_default():
    """transformers' Qwen3_5TextConfig defaults head_dim to 256 (a field of its own), not hidden_size / heads: the
    fixture's hidden 64 over 4 heads would give 16, an attention of another shape."""
    cfg = json.loads((FIXTURE / "config.json").read_text())
    cfg.pop("head_dim")
    assert ModelConfig.from_hf_config(cfg).head_dim == 256
    cfg["head_dim"] = None
    assert ModelConfig.from_hf_config(cfg).head_dim == 256


def _fixture_config(**edits) -> dict:
    cfg = json.loads((FIXTURE / "config.json").read_text())
    cfg.update(edits)
    return cfg


def test_rope_fields_are_read_as_transformers_reads_them():
    """The released layout (rope_parameters with the multimodal rotary's mrope fields) and the legacy one (a
    `rope_scaling` dict, which transformers takes over rope_parameters, and top-level rope_theta /
    partial_rotary_factor that fill in what the dict lacks)."""
    released = _fixture_config(rope_parameters={"mrope_interleaved": True, "mrope_section": [11, 11, 10],
                                                "rope_type": "default", "rope_theta": 10_000_000,
                                                "partial_rotary_factor": 0.25})
    cfg = ModelConfig.from_hf_config(released)
    assert (cfg.rope_theta, cfg.partial_rotary_factor) == (1e7, 0.25)
    legacy = _fixture_config(rope_parameters=None, rope_theta=1e6, partial_rotary_factor=0.5,
                             rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2], "rope_theta": 5e6})
    cfg = ModelConfig.from_hf_config(legacy)
    assert (cfg.rope_theta, cfg.partial_rotary_factor, cfg.rotary_dim) == (5e6, 0.5, 16)
    top_level = _fixture_config(rope_parameters={"rope_type": "default", "rope_theta": None}, rope_theta=2e6)
    assert ModelConfig.from_hf_config(top_level).rope_theta == 2e6  # a null in the dict is an absent value


@pytest.mark.parametrize("edit, message", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262144,
                          "rope_theta": 1e7, "partial_rotary_factor": 0.25}}, "unsupported rope_type 'yarn'"),
    ({"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}}, "unsupported rope_type 'linear'"),
    ({"rope_parameters": {"rope_theta": "1e7"}}, "'rope_theta' must be a finite positive number, got '1e7'"),
    ({"rope_parameters": {"rope_theta": float("inf")}}, "'rope_theta' must be a finite positive number, got inf"),
    ({"rope_parameters": {"partial_rotary_factor": 2}}, "'partial_rotary_factor' must be at most 1"),
    ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
    ({"attention_bias": True}, "unsupported attention_bias True"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     "quantized checkpoint .*quant_method 'fp8'"),
])
def test_a_config_this_model_does_not_compute_is_named(edit, message):
    """A scaled RoPE (YaRN for a longer context, say) or another activation was ignored: the model ran with the plain
    rotation and SiLU, silently another model than the config's. A quantized checkpoint is named as such, not by the
    first scale tensor the loader does not know, and attention biases by the field, not by the first bias tensor."""
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config(_fixture_config(**edit))


def test_optional_config_fields_set_to_null_take_their_defaults():
    """A null linear_conv_kernel_dim became a None in the config (a failure far off, in the conv), a null
    full_attention_interval a TypeError; both take transformers' default, 4."""
    cfg = ModelConfig.from_hf_config(_fixture_config(linear_conv_kernel_dim=None, layer_types=None,
                                                     full_attention_interval=None, max_position_embeddings=None))
    assert cfg.linear_conv_kernel_dim == 4 and cfg.max_position_embeddings == 32768
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)


def test_layer_types_derived_named_or_remapped():
    cfg = ModelConfig.from_hf_config(_fixture_config(layer_types=None, full_attention_interval=2))
    assert cfg.full_layer_ids == (1, 3) and cfg.linear_layer_ids == (0, 2)
    # transformers' legacy names
    cfg = ModelConfig.from_hf_config(_fixture_config(layer_types=["mamba", "attention", "mamba", "attention"]))
    assert cfg.full_layer_ids == (1, 3) and cfg.linear_layer_ids == (0, 2)
    with pytest.raises(ValueError, match="'full_attention_interval' must be a positive int, got 0"):
        ModelConfig.from_hf_config(_fixture_config(layer_types=None, full_attention_interval=0))
    with pytest.raises(ValueError, match="'layer_types' must be a list"):
        ModelConfig.from_hf_config(_fixture_config(layer_types="full_attention"))


def test_a_config_json_that_is_not_json_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON"):
        ModelConfig.from_pretrained(tmp_path)


def test_a_folder_with_a_vocabulary_but_no_tokenizer_json_is_named(tmp_path):
    """vocab.json + merges.txt without tokenizer.json: the byte-level ids would be the wrong ids for the model's
    vocabulary (text in, garbage out); a folder with no tokenizer files keeps the byte-level tokenizer."""
    from gdn_jax.tokenizer import ByteTokenizer, get_tokenizer

    assert isinstance(get_tokenizer(str(tmp_path), 512, 1), ByteTokenizer)
    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(ValueError, match="no tokenizer.json, only vocab.json, merges.txt"):
        get_tokenizer(str(tmp_path), 248320, 1)
    (tmp_path / "tokenizer.json").write_text("{not a tokenizer")
    with pytest.raises(ValueError, match=r"tokenizer\.json cannot be read as a tokenizer"):
        get_tokenizer(str(tmp_path), 248320, 1)


@pytest.mark.parametrize("name", ["tokenizer.json", "generation_config.json", "chat_template.jinja"])
def test_an_optional_file_that_is_a_link_to_nothing_or_a_directory_is_named(tmp_path, name):
    """A download cut short leaves links to missing files in a cache's folder: taken for absent files, the model ran
    with the byte-level tokenizer (every prompt the wrong ids) or without its sampling defaults."""
    from gdn_jax.chat import load_chat_template
    from gdn_jax.engine import LLM

    folder = tmp_path / "m"
    folder.mkdir()
    for f in FIXTURE.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    (folder / name).symlink_to(tmp_path / "missing-blob")
    with pytest.raises(ValueError, match=f"{folder / name} is a link to nothing"):
        load_chat_template(folder) if name.endswith(".jinja") else LLM(str(folder), max_model_len=64, verbose=False)
    (folder / name).unlink()
    (folder / name).mkdir()
    with pytest.raises(ValueError, match=f"{folder / name} is not a file"):
        load_chat_template(folder) if name.endswith(".jinja") else LLM(str(folder), max_model_len=64, verbose=False)


def test_a_tokenizer_with_ids_beyond_the_models_vocabulary_is_named(tmp_path):
    from tokenizers import Tokenizer, models

    from gdn_jax.tokenizer import get_tokenizer

    vocab = {"<unk>": 0, "a": 5, "far": 900}
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"tokenizer\.json has token ids up to 900, outside the model's vocabulary "
                                         r"of 512 ids"):
        get_tokenizer(str(tmp_path), 512, 1)
    assert get_tokenizer(str(tmp_path), 901, 1).encode("far") == [900]


def test_a_chat_template_that_is_not_utf8_a_list_of_objects_or_jinja_is_named_with_its_file(tmp_path):
    from gdn_jax.chat import ChatTemplate, load_chat_template

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": ["x", 1]}))
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: chat_template must be a string or a list of"):
        load_chat_template(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for %}"}))
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: the chat template does not parse \(line 1\)"):
        ChatTemplate.from_folder(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{% if %}")  # the file wins over tokenizer_config.json
    with pytest.raises(ValueError, match=r"chat_template\.jinja: the chat template does not parse \(line 1\)"):
        ChatTemplate.from_folder(tmp_path)
    (tmp_path / "chat_template.jinja").write_bytes(b"\xff\xfe{{ x }}")
    with pytest.raises(ValueError, match=r"chat_template\.jinja is not UTF-8 text"):
        load_chat_template(tmp_path)


def test_a_folder_without_a_tokenizer_and_too_few_ids_for_bytes_is_named(tmp_path):
    """Without a tokenizer.json the byte-level tokenizer stands in; a model with fewer ids than it needs is an error
    naming the folder and the missing file (it named only a byte tokenizer the user never asked for)."""
    from gdn_jax.tokenizer import get_tokenizer

    with pytest.raises(ValueError, match=f"model folder {tmp_path} has no tokenizer.json, and its vocabulary of 200 "
                                         f"ids is too small for the byte-level tokenizer"):
        get_tokenizer(str(tmp_path), 200, 1)


def test_stored_dtype_to_requested_dtype(tmp_path):
    """bfloat16 tensors load into float32 exactly; float32 tensors load into bfloat16 rounded to nearest even (torch's
    `.to(torch.bfloat16)`); A_log and dt_bias stay float32 whatever the requested dtype."""
    import jax.numpy as jnp
    import ml_dtypes

    tensors = load_file(FIXTURE / "model.safetensors")
    folder = _copy_with(tmp_path, edit_tensors=lambda t: t.update({k: v.astype(ml_dtypes.bfloat16) for k, v in t.items()}))
    pure = nnx.to_pure_dict(load_hf_weights(folder, dtype=jnp.float32)[2])
    conv = tensors["model.layers.0.linear_attn.conv1d.weight"][:, 0, :]
    np.testing.assert_array_equal(np.asarray(pure["layers"][0]["linear_attn"]["conv1d"]),
                                  conv.astype(ml_dtypes.bfloat16).astype(np.float32))
    pure = nnx.to_pure_dict(load_hf_weights(FIXTURE, dtype=jnp.bfloat16)[2])
    embed = np.asarray(pure["embed_tokens"])
    assert embed.dtype == ml_dtypes.bfloat16
    assert embed.view(np.uint16).tolist() == tensors["model.embed_tokens.weight"].astype(ml_dtypes.bfloat16).view(
        np.uint16).tolist()
    a_log = np.asarray(pure["layers"][0]["linear_attn"]["A_log"])
    assert a_log.dtype == np.float32
    np.testing.assert_array_equal(a_log, tensors["model.layers.0.linear_attn.A_log"])


def test_a_tied_multimodal_checkpoint_loads_without_lm_head(tmp_path):
    """The small released models (tie_word_embeddings true, in text_config and at the top) store no lm_head.weight,
    next to vision and MTP tensors that are skipped."""
    def to_multimodal(cfg):
        text = dict(cfg, tie_word_embeddings=True)
        cfg.clear()
        cfg.update(model_type="qwen3_5", text_config=text, tie_word_embeddings=True, vision_config={"depth": 1})

    def rename(t):
        for k in list(t):
            t["model.language_model." + k[len("model."):] if k.startswith("model.") else k] = t.pop(k)
        t["model.visual.blocks.0.attn.qkv.weight"] = np.zeros((6, 2), np.float32)
        t["mtp.layers.0.self_attn.q_proj.weight"] = np.zeros((2, 2), np.float32)

    folder = _copy_with(tmp_path, edit_tensors=lambda t: (rename(t), t.pop("lm_head.weight")), edit_config=to_multimodal)
    cfg, _, params = load_hf_weights(folder)
    assert cfg.tie_word_embeddings and "lm_head" not in nnx.to_pure_dict(params)
    embed = load_file(FIXTURE / "model.safetensors")["model.embed_tokens.weight"]
    np.testing.assert_array_equal(np.asarray(nnx.to_pure_dict(params)["embed_tokens"]), embed)


def test_a_tied_checkpoint_storing_its_embeddings_as_lm_head_stays_tied(tmp_path, recwarn):
    """An lm_head.weight equal to the embeddings is the tied model: no warning, no lm_head param."""
    def copy_embed(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()

    folder = _copy_with(tmp_path, edit_tensors=copy_embed,
                        edit_config=lambda c: c.__setitem__("tie_word_embeddings", True))
    cfg, _, params = load_hf_weights(folder)
    assert cfg.tie_word_embeddings and "lm_head" not in nnx.to_pure_dict(params)
    assert not [w for w in recwarn if "tie_word_embeddings" in str(w.message)]


@pytest.mark.parametrize("top, text, tied", [(True, False, True), (False, True, True), (None, True, True),
                                             (True, None, True), (False, False, False), (None, None, False)])
def test_a_multimodal_config_is_tied_where_either_field_says_so(top, text, tied):
    """transformers' save_pretrained of a tied Qwen3_5ForConditionalGeneration writes tie_word_embeddings true at the
    top level and false in text_config (and stores no lm_head.weight); its text model alone reads text_config's."""
    mm = {"model_type": "qwen3_5", "text_config": _fixture_config(tie_word_embeddings=text)}
    if top is not None:
        mm["tie_word_embeddings"] = top
    assert ModelConfig.from_hf_config(mm).tie_word_embeddings is tied


def test_a_model_folder_given_from_the_home_directory_is_found(tmp_path, monkeypatch):
    from gdn_jax.model.weights import model_folder
    (tmp_path / "models" / "q").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert model_folder("~/models/q") == tmp_path / "models" / "q"
    assert model_folder("~/models/none") is None
