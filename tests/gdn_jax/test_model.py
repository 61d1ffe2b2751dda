"""Model-level invariants the engine relies on: batching with padding, cold starts, the tiny preset."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn_jax.config import FULL, LINEAR, get_preset
from gdn_jax.model import Batch, forward, init_model, init_state
from tests.gdn_jax.helpers import BLOCK_SIZE, single_row_batch

NB = 8


@pytest.fixture(scope="module")
def tiny():
    cfg = get_preset("tiny-random")
    graphdef, params = init_model(cfg)
    return cfg, graphdef, params


@pytest.fixture(scope="module")
def step():
    return jax.jit(forward, static_argnums=(0, 4))


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
                  linear_ids=jnp.asarray([2, 3, 0], jnp.int32), has_initial_state=jnp.zeros(3, bool))
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
