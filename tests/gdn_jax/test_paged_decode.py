"""The GPU's paged decode attention (`backends.gpu.paged_attention`), run in Pallas' interpreter on the CPU: the
attention XLA's form computes, for any length, query group and pool dtype, and a model's decode and verify steps
with it give the logits they give without it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn_jax.backends.cpu import tuning
from gdn_jax.backends.gpu import paged_attention
from gdn_jax.config import get_preset
from gdn_jax.model.attention import Attention
from gdn_jax.model.forms import GENERIC, Forms
from gdn_jax.model.qwen35 import forward, init_model
from gdn_jax.model.state import init_state, to_pool
from tests.gdn_jax.helpers import BLOCK_SIZE, random_ids, single_row_batch

pytestmark = pytest.mark.model

PAGED = Forms(paged_decode="interpret")
# the interpreter everywhere; on a GPU (scripts/bench/gpu_check.sh runs this module there) the Triton kernel too
MODES = ["interpret"] + ["on"] * (jax.default_backend() == "gpu")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (8, 2)])
def test_the_kernel_attends_as_xla_does(dtype, heads, kv_heads, mode):
    """Rows of 1 key, a whole block, a block and one, and a long context, over shuffled blocks of one layer of
    three: the kernel's output is XLA's (its loop over key chunks), in float32 to its rounding."""
    cfg = dataclasses.replace(get_preset("tiny-random"), num_attention_heads=heads, num_key_value_heads=kv_heads,
                              head_dim=32)
    rng = np.random.default_rng(heads)
    L, NP, NB, hd = 3, 64, 12, cfg.head_dim
    store = jnp.zeros((), jnp.uint16 if dtype == jnp.bfloat16 else jnp.float32)
    k, v = (to_pool(jnp.asarray(rng.standard_normal((kv_heads, L, NP, BLOCK_SIZE, hd)), dtype), store)
            for _ in range(2))
    keys = np.array([1, BLOCK_SIZE, BLOCK_SIZE + 1, 150, 7])
    tables = jnp.asarray(rng.permutation(NP)[:5 * NB].reshape(5, NB), jnp.int32)
    q = jnp.asarray(rng.standard_normal((5, 1, heads, hd)), dtype)
    positions = jnp.asarray(keys - 1, jnp.int32)[:, None]
    attn = Attention(cfg, dtype, nnx.Rngs(0), 0.05)
    want = attn.attend_heads(q, k, v, 1, positions, tables, jnp.asarray(keys), GENERIC)
    paged = Forms(paged_decode=mode)
    got = attn.attend_heads(q, k, v, 1, positions, tables, jnp.asarray(keys), paged)
    assert got.shape == want.shape == (5, 1, heads * hd) and got.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=0)
    # a row sees its own keys only: a key past row 0's end (its second, in its first block) changes no row
    k2 = k.at[:, 1, tables[0, 0], 1].set(to_pool(jnp.full((hd,), 9.0, dtype), store))
    again = attn.attend_heads(q, k2, v, 1, positions, tables, jnp.asarray(keys), paged)
    np.testing.assert_array_equal(np.asarray(again, np.float32), np.asarray(got, np.float32))


def test_decode_and_verify_steps_give_the_same_logits_with_the_kernel():
    """tiny-random: a prompt, then a one-token decode step and a verify-like step of three positions (by position),
    with XLA's attention and with the kernel: the same logits and the same pools."""
    cfg = get_preset("tiny-random")
    graphdef, params = init_model(cfg)
    rng = np.random.default_rng(1)
    ids = random_ids(rng, 40)
    step = jax.jit(forward, static_argnums=(0, 4, 7, 8), static_argnames=("forms", "by_position"))
    results = {}
    for name, forms in (("xla", GENERIC), ("kernel", PAGED)):
        state = init_state(cfg, 8, BLOCK_SIZE, 4)
        _, state = step(graphdef, params, single_row_batch(ids[:36], 0, 7), state, False, forms=forms)
        one, state = step(graphdef, params, single_row_batch(ids[36:37], 36, 7), state, False, forms=forms)
        three, state = step(graphdef, params, single_row_batch(ids[37:40], 37, 7), state, True, forms=forms,
                            by_position=True)
        results[name] = (one, three, state)
    for a, b in zip(jax.tree.leaves(results["xla"]), jax.tree.leaves(results["kernel"]), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=2e-5, rtol=0)


def test_the_forms_and_the_environment_turn_it_on_off_the_cpu_only(monkeypatch):
    with pytest.raises(ValueError, match="paged_decode must be one of"):
        Forms(paged_decode="yes")
    with pytest.raises(ValueError, match="paged_decode needs cpu=False"):
        Forms(cpu=True, paged_decode="on")
    with pytest.raises(ValueError, match="deterministic"):
        Forms(deterministic=True, paged_decode="interpret")
    k = jnp.zeros((2, 1, 4, 16, 32), jnp.uint16)
    assert paged_attention.applies(k, 4, PAGED) and not paged_attention.applies(k, 4, GENERIC)
    assert not paged_attention.applies(jnp.zeros((2, 1, 4, 12, 32)), 4, PAGED)  # a block size of 12
    assert not paged_attention.applies(k, 3, PAGED)  # heads not a multiple of the KV heads
    monkeypatch.setenv("GDN_JAX_PAGED_DECODE", "1")
    if jax.default_backend() == "cpu":
        assert tuning.resolve_forms(jnp.float32).paged_decode == "off"  # the CPU: its own kernel
    monkeypatch.setattr(tuning.jax, "default_backend", lambda: "gpu")
    assert tuning.resolve_forms(jnp.bfloat16).paged_decode == "on"
    monkeypatch.setenv("GDN_JAX_PAGED_DECODE", "0")
    assert tuning.resolve_forms(jnp.bfloat16).paged_decode == "off"
