"""The MTP block (`model.mtp`): its config field, its tensors read only to speculate, its forward's composition,
and its training on a frozen model (Qwen3-Next's next-next-token loss)."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn_jax.config import ModelConfig, get_preset
from gdn_jax.model.qwen35 import init_model
from gdn_jax.model.weights import load_hf_weights, load_model, save_hf_weights

pytestmark = pytest.mark.startup

CFG = dataclasses.replace(get_preset("tiny-random"), mtp_num_hidden_layers=1)


def _flat(params):
    return {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(params)}


def test_the_mtp_block_is_saved_and_read_back_only_when_asked_for(tmp_path):
    """A checkpoint with the block: read with `mtp=True` it comes back whole; read without, its tensors are skipped
    and the config says none (the prefix cache's fingerprint is the same either way). A missing or misshaped tensor
    of the block is refused by name; a config declaring none cannot draft."""
    _, params = init_model(CFG)
    save_hf_weights(tmp_path, CFG, params)
    assert json.loads((tmp_path / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    cfg, _, loaded = load_hf_weights(tmp_path, mtp=True)
    want, got = _flat(params), _flat(loaded)
    assert cfg.mtp_num_hidden_layers == 1 and want.keys() == got.keys() and any(k[0] == "mtp" for k in got)
    assert all(np.array_equal(want[k], got[k]) for k in want)
    plain, _, without = load_hf_weights(tmp_path)
    assert plain.mtp_num_hidden_layers == 0 and not any(k[0] == "mtp" for k in _flat(without))
    assert plain.fingerprint() == cfg.fingerprint()

    from safetensors.numpy import load_file, save_file
    tensors = load_file(str(tmp_path / "model.safetensors"))
    fc = tensors.pop("mtp.fc.weight")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensor.*mtp.fc.weight"):
        load_hf_weights(tmp_path, mtp=True)
    save_file({**tensors, "mtp.fc.weight": fc[:, :64]}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'mtp.fc.weight' has shape \(64, 64\), expected \(64, 128\)"):
        load_hf_weights(tmp_path, mtp=True)
    load_hf_weights(tmp_path)  # (skipped: the model loads without it)
    folder = tmp_path / "none"
    save_hf_weights(folder, get_preset("tiny-random"), init_model(get_preset("tiny-random"))[1])
    with pytest.raises(ValueError, match="declares no MTP layers"):
        load_hf_weights(folder, mtp=True)
    assert load_model("tiny-random", mtp=True)[0].mtp_num_hidden_layers == 1


@pytest.mark.parametrize("field", ["mtp_num_hidden_layers", "num_nextn_predict_layers"])
def test_the_config_reads_the_mtp_layers_by_either_name(field):
    hf = get_preset("tiny-random").to_hf_config()
    assert ModelConfig.from_hf_config({**hf, field: 2}).mtp_num_hidden_layers == 2
    with pytest.raises(ValueError, match="mtp_num_hidden_layers"):
        ModelConfig.from_hf_config({**hf, field: -1})


def test_the_block_reads_the_embedding_then_the_hidden_state_then_its_layers_norm_and_the_shared_head():
    """With fc = [0 | I] and its layer's output projections zero (the layer adds nothing), the block's logits are
    the LM head of mtp.norm(pre_fc_norm_hidden(hidden)), whatever the next tokens; with fc = [I | 0], of
    mtp.norm(pre_fc_norm_embedding(embed(next))), whatever the hidden state. Causal: a later next token changes
    no earlier position."""
    from gdn_jax.train import mtp_dense_forward

    graphdef, params = init_model(CFG)
    model = nnx.merge(graphdef, params)
    D = CFG.hidden_size
    layer = model.mtp.layers[0]
    layer.self_attn.o_proj.kernel[...] = jnp.zeros_like(layer.self_attn.o_proj.kernel[...])
    layer.mlp.down_proj.kernel[...] = jnp.zeros_like(layer.mlp.down_proj.kernel[...])
    hidden = jax.random.normal(jax.random.PRNGKey(0), (2, 6, D))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 6), 0, CFG.vocab_size)
    eye, zero = jnp.eye(D), jnp.zeros((D, D))
    model.mtp.fc.kernel[...] = jnp.concatenate([zero, eye], axis=1)  # [out, in]: in = [embedding | hidden]
    want = model.head(model.mtp.norm(model.mtp.pre_fc_norm_hidden(hidden)))
    np.testing.assert_allclose(mtp_dense_forward(model, hidden, tokens), want, rtol=1e-5, atol=1e-5)
    model.mtp.fc.kernel[...] = jnp.concatenate([eye, zero], axis=1)
    want = model.head(model.mtp.norm(model.mtp.pre_fc_norm_embedding(model.embed_tokens[...][tokens])))
    np.testing.assert_allclose(mtp_dense_forward(model, hidden * 3, tokens), want, rtol=1e-5, atol=1e-5)
    graphdef, params = init_model(CFG)
    model = nnx.merge(graphdef, params)
    a = mtp_dense_forward(model, hidden, tokens)
    b = mtp_dense_forward(model, hidden, tokens.at[:, 4].set((tokens[:, 4] + 1) % CFG.vocab_size))
    np.testing.assert_array_equal(a[:, :4], b[:, :4])
    assert not np.allclose(a[:, 4:], b[:, 4:])


def test_training_the_block_lowers_its_next_next_loss_and_leaves_the_model_alone():
    from gdn_jax.train import MtpForward, TrainConfig, make_mtp_train_step, make_optimizer, split_mtp

    _, params = init_model(CFG)
    mtp, rest = split_mtp(params)
    fwd = MtpForward(CFG)
    tx = make_optimizer(TrainConfig(steps=30, lr=3e-3, warmup=0))[0]
    step, state = make_mtp_train_step(fwd, tx), tx.init(mtp)
    rng = np.random.default_rng(0)
    base = rng.integers(4, 40, (4, 20))  # a repeated pattern: the token after next is learnable
    tokens = jnp.asarray(np.concatenate([base, base], axis=1))
    first = float(fwd.loss(mtp, rest, tokens))
    before = _flat(rest)
    for _ in range(30):
        mtp, state, loss = step(mtp, state, rest, tokens)
    assert float(loss) < 0.7 * first
    after = _flat(rest)
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_the_block_on_the_paged_pools_equals_its_dense_forward_across_prefill_chunks(chunks=(19, 21)):
    """`mtp_forward` after each prefill chunk of the model (its hidden states, and the tokens after them: the next
    chunk's first, or any token after the last) writes the block's keys and values in the pools' layer after the
    model's own; every position's draft logits equal `mtp_dense_forward` over the whole sequence."""
    from gdn_jax.model.mtp import mtp_forward
    from gdn_jax.model.state import init_state
    from gdn_jax.train import dense_hidden, mtp_dense_forward
    from tests.gdn_jax.helpers import BLOCK_SIZE, random_ids, single_row_batch

    graphdef, params = init_model(CFG)
    model = nnx.merge(graphdef, params)
    tokens = random_ids(np.random.default_rng(4), 41)  # 40 positions, and the token after the last
    state = init_state(CFG, 5, BLOCK_SIZE, 2)
    assert state.k.shape[1] == len(CFG.full_layer_ids) + 1
    got, start = [], 0
    for n in chunks:
        batch = single_row_batch(tokens[start:start + n], start, 4)
        _, state, hidden = model(batch, state, all_logits=True, hidden=True)
        logits, _, state = mtp_forward(model, hidden, jnp.asarray(tokens[start + 1:start + n + 1])[None], batch, state)
        got.append(np.asarray(logits[0]))
        start += n
    seq = jnp.asarray(tokens)[None]
    want = mtp_dense_forward(model, model.norm(dense_hidden(model, seq[:, :40])), seq[:, 1:])
    np.testing.assert_allclose(np.concatenate(got), np.asarray(want[0]), atol=2e-4, rtol=0)


def test_drafting_chains_the_blocks_greedy_tokens_through_its_own_outputs():
    """`mtp_draft` after a prompt: its k drafts are the dense block's greedy tokens when each later position is fed
    the block's own output at the one before and the draft before it (what a draft of several tokens means)."""
    from gdn_jax.model.mtp import mtp_draft, mtp_forward
    from gdn_jax.model.state import init_state
    from gdn_jax.train import dense_attention, dense_hidden, mtp_dense_forward, training_forms
    from tests.gdn_jax.helpers import BLOCK_SIZE, random_ids, single_row_batch

    graphdef, params = init_model(CFG)
    model = nnx.merge(graphdef, params)
    prompt = random_ids(np.random.default_rng(5), 30)
    state = init_state(CFG, 5, BLOCK_SIZE, 2)
    batch = single_row_batch(prompt, 0, 4)
    logits, state, hidden = model(batch, state, all_logits=True, hidden=True)
    sampled = int(jnp.argmax(logits[0, -1]))
    _, _, state = mtp_forward(model, hidden[:, :-1], jnp.asarray(prompt[1:])[None],  # the prompt's own positions
                              single_row_batch(prompt[:29], 0, 4), state)
    one = single_row_batch([sampled], 29, 4)
    drafts, _ = mtp_draft(model, hidden[:, -1], jnp.asarray([sampled]), one, state, 3)

    seq, forms = jnp.asarray(prompt + [sampled])[None], training_forms()
    hs = model.norm(dense_hidden(model, seq[:, :30]))  # the model's outputs at positions 0..29
    nexts, want = seq[:, 1:], []
    for _ in range(3):
        out_logits = mtp_dense_forward(model, hs, nexts)
        want.append(int(jnp.argmax(out_logits[0, -1])))
        x = model.mtp.inputs(model.embed_tokens[...][nexts], hs)  # the block's output at the last position ...
        for layer in model.mtp.layers:
            x = layer.residual(x, dense_attention(layer.self_attn, layer.input_layernorm(x), forms), forms)
        hs = jnp.concatenate([hs, model.mtp.norm(x)[:, -1:]], axis=1)  # ... stands in for the next hidden state
        nexts = jnp.concatenate([nexts, jnp.asarray([[want[-1]]])], axis=1)
    assert np.asarray(drafts[0]).tolist() == want
