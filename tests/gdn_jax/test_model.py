"""Model-level invariants the engine relies on: batching with padding, cold starts, the tiny preset, the layer loop,
attention in chunks of keys."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn_jax.backends.cpu import tuning
from gdn_jax.model import attention
from gdn_jax.config import FULL, LINEAR, get_preset, hybrid_layer_types
from gdn_jax.model.state import Batch, init_state
from gdn_jax.model.qwen35 import forward, init_model, layer_groups
from gdn_jax.train import dense_forward
from tests.gdn_jax.helpers import BLOCK_SIZE, PREFILL_OPTIONS, single_row_batch

pytestmark = pytest.mark.model

NB = 8


@pytest.fixture(scope="module")
def tiny():
    cfg = get_preset("tiny-random")
    graphdef, params = init_model(cfg)
    return cfg, graphdef, params


@pytest.fixture(scope="module")
def step():
    return jax.jit(forward, static_argnums=(0, 4), compiler_options=PREFILL_OPTIONS)


def test_tiny_preset_is_hybrid_and_deterministic(tiny):
    cfg, _, params = tiny
    assert cfg.vocab_size >= 512
    assert cfg.layer_types.count(LINEAR) >= 3 and cfg.layer_types.count(FULL) >= 1
    _, again = init_model(cfg)
    for a, b in zip(jax.tree.leaves(nnx.to_pure_dict(params)), jax.tree.leaves(nnx.to_pure_dict(again))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_padded_batch_rows_equal_single_rows(tiny, step):
    cfg, graphdef, params = tiny
    rng = np.random.default_rng(0)
    a, b = rng.integers(2, 512, 70), rng.integers(2, 512, 45)
    T = 80
    tokens = np.zeros((3, T), np.int32)
    tokens[0, :70], tokens[1, :45] = a, b
    tokens[1, 45:] = rng.integers(2, 512, T - 45)  # garbage in the padding
    lengths = np.array([70, 45, 0], np.int32)
    slot_map = np.zeros((3, T), np.int32)  # padding tokens -> block 0
    slot_map[0, :70] = BLOCK_SIZE * 1 + np.arange(70)      # row 0: blocks 1..5
    slot_map[1, :45] = BLOCK_SIZE * 6 + np.arange(45)      # row 1: blocks 6..8
    tables = np.zeros((3, 5), np.int32)
    tables[0] = [1, 2, 3, 4, 5]
    tables[1, :3] = [6, 7, 8]
    batch = Batch(tokens=jnp.asarray(tokens), start_pos=jnp.zeros(3, jnp.int32), lengths=jnp.asarray(lengths),
                  block_tables=jnp.asarray(tables), slot_mapping=jnp.asarray(slot_map),
                  linear_state_ids=jnp.asarray([2, 3, 0], jnp.int32), has_initial_state=jnp.zeros(3, bool))
    state = init_state(cfg, 9, BLOCK_SIZE, 4)
    logits, out = step(graphdef, params, batch, state, False)
    for row, (toks, slot) in enumerate([(a, 2), (b, 3)]):
        ref_logits, ref_state = step(graphdef, params, single_row_batch(toks, 0, NB, slot=slot),
                                     init_state(cfg, NB + 1, BLOCK_SIZE, 4), False)
        np.testing.assert_allclose(np.asarray(logits[row]), np.asarray(ref_logits[0]), atol=2e-5)
        for j in range(len(cfg.linear_layer_ids)):
            np.testing.assert_allclose(np.asarray(out.ssm[j][slot]), np.asarray(ref_state.ssm[j][slot]), atol=1e-5)
            np.testing.assert_allclose(np.asarray(out.conv[j][slot]), np.asarray(ref_state.conv[j][slot]), atol=1e-5)


def test_cold_start_ignores_garbage_in_the_slot(tiny, step):
    cfg, graphdef, params = tiny
    toks = np.random.default_rng(1).integers(2, 512, 40)
    clean = init_state(cfg, NB + 1, BLOCK_SIZE, 4)
    garbage = jax.tree.map(lambda x: x + 7.0, clean)
    l_clean, _ = step(graphdef, params, single_row_batch(toks, 0, NB, warm=False), clean, False)
    l_garbage, _ = step(graphdef, params, single_row_batch(toks, 0, NB, warm=False), garbage, False)
    np.testing.assert_array_equal(np.asarray(l_clean), np.asarray(l_garbage))
    # and a warm start from that garbage really changes the result (the flag is what protects us)
    l_warm, _ = step(graphdef, params, single_row_batch(toks, 0, NB, warm=True), garbage, False)
    assert np.abs(np.asarray(l_warm) - np.asarray(l_clean)).max() > 1e-2


def test_split_prefill_equals_one_pass(tiny, step):
    cfg, graphdef, params = tiny
    toks = np.random.default_rng(2).integers(2, 512, 100)
    full, _ = step(graphdef, params, single_row_batch(toks, 0, NB), init_state(cfg, NB + 1, BLOCK_SIZE, 4), True)
    for split in (37, 64):
        st = init_state(cfg, NB + 1, BLOCK_SIZE, 4)
        l1, st = step(graphdef, params, single_row_batch(toks[:split], 0, NB), st, True)
        l2, _ = step(graphdef, params, single_row_batch(toks[split:], split, NB), st, True)
        np.testing.assert_allclose(np.concatenate([l1[0], l2[0]]), np.asarray(full[0]), atol=1e-4)


def test_layer_groups_split_the_layer_list_into_repeats_of_runs():
    L, F = LINEAR, FULL
    assert layer_groups(hybrid_layer_types(32)) == (((L, 3), (F, 1)), 8)   # Qwen3.5-9B: 8 x (3 GDN + 1 full)
    assert layer_groups((L, L, F, L, L, F)) == (((L, 2), (F, 1)), 2)
    assert layer_groups((L, F, L, L)) == (((L, 1), (F, 1), (L, 2)), 1)       # no repeat: one group of runs
    assert layer_groups((F, F, F)) == (((F, 1),), 3)
    assert layer_groups((L,)) == (((L, 1),), 1)


@pytest.mark.parametrize("layer_types", [
    hybrid_layer_types(8),            # 2 repeats of (3 GDN, 1 full): loops with a traced layer index
    (LINEAR, LINEAR, FULL) * 2,
    (LINEAR, FULL, LINEAR, LINEAR),   # no repeating group: runs of 1, 1 and 2 layers
    (FULL, FULL, FULL),
], ids=lambda t: "".join("G" if x == LINEAR else "A" for x in t))
def test_layer_loop_computes_what_the_layers_one_by_one_compute(layer_types):
    """The engine's forward (layers under loops, pools and matrices picked by the layer index) against the training
    forward, which calls the layers one after another on their own parameters (and attends densely)."""
    cfg = dataclasses.replace(get_preset("tiny-random"), layer_types=layer_types)
    graphdef, params = init_model(cfg)
    tokens = np.random.default_rng(3).integers(4, 500, 100)
    logits, _ = jax.jit(forward, static_argnums=(0, 4), compiler_options=PREFILL_OPTIONS)(
        graphdef, params, single_row_batch(tokens, 0, NB), init_state(cfg, NB + 1, BLOCK_SIZE, 4), True)
    dense = jax.jit(dense_forward, compiler_options=PREFILL_OPTIONS)(nnx.merge(graphdef, params), tokens[None])
    np.testing.assert_allclose(np.asarray(logits), np.asarray(dense), atol=2e-5, rtol=0)


def test_step_traces_one_layer_of_each_kind_whatever_the_depth():
    """The lowered step of a 16-layer model holds as many exponentials (gates, softmax, decay) as an 8-layer one: one
    GDN and one attention layer body (only the switch branches that pick the layers' matrices grow with depth). (A
    4-layer model's single group runs without a loop, its last layer known when traced: its step holds no whole-chunk
    attention for that layer, only its last tokens' tail.)"""
    def lowered(n_layers):
        cfg = dataclasses.replace(get_preset("tiny-random"), layer_types=hybrid_layer_types(n_layers))
        graphdef, params = init_model(cfg)
        return jax.jit(forward, static_argnums=(0, 4)).lower(
            graphdef, params, single_row_batch(np.arange(4, 20), 0, NB), init_state(cfg, NB + 1, BLOCK_SIZE, 4),
            False).as_text()

    small, deep = lowered(8), lowered(16)  # unrolled layers would hold twice as many
    assert small.count("stablehlo.exponential") == deep.count("stablehlo.exponential") > 0


@pytest.mark.parametrize("env, unrolled", [("1", {1, 16}), ("decode", {1}), ("0", set()), ("", set())])
def test_layers_unroll_as_the_environment_says(monkeypatch, tiny, env, unrolled):
    """GDN_JAX_UNROLL_LAYERS: "1" unrolls every step's layers, "decode" only a one-token step's, "0" or unset none
    (read once into the engine's forms, `tuning.resolve_forms`). An unrolled step has no layer loop and no switch
    over the layers' matrices (`case` in its StableHLO), the logits of a loop's."""
    cfg, graphdef, params = tiny
    toks = np.random.default_rng(6).integers(4, 500, 17)
    monkeypatch.setenv(tuning.UNROLL_ENV, env)
    forms = tuning.resolve_forms(jnp.float32)
    step = jax.jit(lambda p, b, s: forward(graphdef, p, b, s, forms=forms), compiler_options=PREFILL_OPTIONS)
    looped = jax.jit(lambda p, b, s: forward(graphdef, p, b, s, forms=dataclasses.replace(forms, unroll="0")),
                     compiler_options=PREFILL_OPTIONS)
    state = init_state(cfg, 3, BLOCK_SIZE, 4)
    for T, start in ((16, 0), (1, 16)):  # a prefill chunk, then the decode step after it
        batch = single_row_batch(toks[start:start + T], start, 2)
        assert forms.unrolled(T) == (T in unrolled)
        assert ("stablehlo.case" in step.lower(params, batch, state).as_text()) == (T not in unrolled)
        want = looped(params, batch, state)[0]  # the layer loop's logits, from the same state
        logits, state = step(params, batch, state)
        np.testing.assert_allclose(logits, want, atol=1e-5, rtol=0)


def test_layers_unroll_only_for_a_known_setting(monkeypatch):
    monkeypatch.setenv(tuning.UNROLL_ENV, "yes")
    with pytest.raises(ValueError, match="GDN_JAX_UNROLL_LAYERS must be one of 0, 1, decode"):
        tuning.resolve_forms(jnp.float32)


def test_prefill_key_chunks_from_the_environment_change_the_loops_not_the_attention(monkeypatch, tiny):
    """GDN_JAX_PREFILL_KV_CHUNK_KEYS sets a prefill step's keys per iteration (here one block: 64 tokens then run in 4
    query tiles, each over its own chunks), not a decode step's: the logits and pools of a prefill after a 150-token
    prefix and of the decode step after it are those of the default chunks, and the prefill's program differs."""
    cfg, graphdef, params = tiny
    toks = np.random.default_rng(5).integers(4, 500, 215)
    results, programs = [], []
    for keys in (None, str(BLOCK_SIZE)):
        if keys:
            monkeypatch.setenv(tuning.PREFILL_KV_CHUNK_ENV, keys)
        forms = tuning.resolve_forms(jnp.float32)  # (read once, at engine start)
        assert attention.kv_chunk_keys(64, forms) == (BLOCK_SIZE if keys else attention.KV_CHUNK_KEYS)
        assert attention.kv_chunk_keys(1, forms) == attention.KV_CHUNK_KEYS  # a decode step keeps its chunks
        step = jax.jit(lambda p, b, s: forward(graphdef, p, b, s, True, forms=forms), compiler_options=PREFILL_OPTIONS)
        _, state = step(params, single_row_batch(toks[:150], 0, 14), init_state(cfg, 15, BLOCK_SIZE, 4))
        chunk = single_row_batch(toks[150:214], 150, 14)
        programs.append(step.lower(params, chunk, state).as_text())
        logits, state = step(params, chunk, state)
        results.append(jax.device_get((logits, state, step(params, single_row_batch(toks[214:], 214, 14), state))))
    (l1, s1, d1), (l2, s2, d2) = results
    np.testing.assert_allclose(l1, l2, atol=1e-5, rtol=0)
    for a, b in zip(jax.tree.leaves((s1, d1)), jax.tree.leaves((s2, d2))):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    assert programs[0] != programs[1]


@pytest.mark.parametrize("value", ["0", "-256", "2k", "1.5"])
def test_prefill_key_chunks_from_the_environment_must_be_a_positive_count(monkeypatch, value):
    monkeypatch.setenv(tuning.PREFILL_KV_CHUNK_ENV, value)
    with pytest.raises(ValueError, match="GDN_JAX_PREFILL_KV_CHUNK_KEYS must be a positive whole number"):
        tuning.resolve_forms(jnp.float32)


@pytest.mark.parametrize("T", [1, 40, 64])
def test_attention_in_chunks_equals_attention_in_one_chunk(monkeypatch, tiny, T):
    """Keys a block at a time (an online softmax over up to 14 chunks) give the logits and pools of one chunk of 256
    keys, for a prefill chunk and a decode step after a 150-token prefix. With a block per chunk the 40- and 64-token
    chunks run their queries in 2 and 4 tiles, each over the key chunks up to its own last query."""
    cfg, graphdef, params = tiny
    toks = np.random.default_rng(4).integers(4, 500, 150 + T)
    results = []
    for keys in (256, BLOCK_SIZE):
        monkeypatch.setattr(attention, "KV_CHUNK_KEYS", keys)
        # a fresh trace under this chunk size
        step = jax.jit(lambda p, b, s: forward(graphdef, p, b, s, True), compiler_options=PREFILL_OPTIONS)
        _, state = step(params, single_row_batch(toks[:150], 0, 14), init_state(cfg, 15, BLOCK_SIZE, 4))
        results.append(jax.device_get(step(params, single_row_batch(toks[150:], 150, 14), state)))
    (l1, s1), (l2, s2) = results
    np.testing.assert_allclose(l1, l2, atol=1e-5, rtol=0)
    for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
