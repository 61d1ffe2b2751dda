"""The forms the forward takes off the CPU (XLA's generic `Forms()`, an accelerator's), traced here on the CPU: the
precision and dtypes of its matrix products, which XLA's GPU backend reads and its CPU backend ignores."""

import collections
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn_jax.backends.cpu import tuning
from gdn_jax.config import get_preset
from gdn_jax.model.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule
from gdn_jax.model.attention import KEYS_LEFT_QUERIES, attention_scores
from gdn_jax.model.forms import Forms
from gdn_jax.model.qwen35 import advance_in_pool, forward, init_model
from gdn_jax.model.state import init_state
from gdn_jax.train import dense_forward
from tests.gdn_jax.helpers import single_row_batch

pytestmark = pytest.mark.model


def _dots(jaxpr, out):
    """(operand dtypes, precision) of every dot_general in `jaxpr` and the jaxprs inside it (loops, switches)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            out.append((tuple(str(v.aval.dtype) for v in eqn.invars), eqn.params["precision"]))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    _dots(sub, out)
    return out


ACCELERATOR = Forms()  # XLA's generic forms: what an accelerator's engine (and training there) traces in


def _forward_dots(dtype, T: int, dense: bool = False):
    """The products of the engine's forward of one T-token row (or of the training path's dense forward), in an
    accelerator's forms."""
    cfg = get_preset("tiny-random")
    graphdef, params = init_model(cfg, dtype=dtype)
    if dense:
        jaxpr = jax.make_jaxpr(lambda p: dense_forward(nnx.merge(graphdef, p), jnp.zeros((1, T), jnp.int32),
                                                       forms=ACCELERATOR))(params)
    else:
        batch = single_row_batch(np.arange(4, 4 + T), 0, 4)
        state = init_state(cfg, 5, 16, 2, dtype)
        jaxpr = jax.make_jaxpr(lambda p, s, b: forward(graphdef, p, b, s, forms=ACCELERATOR))(params, state, batch)
    return collections.Counter(_dots(jaxpr.jaxpr, []))


@pytest.mark.parametrize("T,dense", [(1, False), (40, False), (40, True)])
def test_float32_products_are_float32_on_an_accelerator(T, dense):
    """XLA's GPU backend multiplies float32 operands at the default precision in TensorFloat-32 (10-bit mantissas)
    on Ampere and later GPUs (an H100, an H200): a float32 engine would compute every projection, attention product
    and the LM head about 1e-3 off, and drift from the float32 references the tests hold it to. Every float32
    product says HIGHEST (float32 on a GPU; the CPU ignores it), in the training path's forward too."""
    dots = _forward_dots(jnp.float32, T, dense)
    default = {k: n for k, n in dots.items() if k[1] in (None, (jax.lax.Precision.DEFAULT,) * 2)}
    assert dots and not default, default


@pytest.mark.parametrize("T", [1, 40])
def test_bfloat16_products_stay_bfloat16_on_an_accelerator(T):
    """The bfloat16 model's projections and attention multiply bfloat16 operands (float32 accumulation) off the
    CPU: nothing converts them to float32 first. Only the GDN rule's own products are float32 (its state is)."""
    dots = _forward_dots(jnp.bfloat16, T)
    bf16 = sum(n for (dtypes, _), n in dots.items() if dtypes == ("bfloat16", "bfloat16"))
    other = {k: n for k, n in dots.items() if k[0] != ("bfloat16", "bfloat16")}
    assert bf16 and all(prec == (jax.lax.Precision.HIGHEST,) * 2 for _, prec in other), other


def _decode_update_and_saves(forms: Forms):
    """The decode step's in-pool GDN update (`advance_in_pool`) and the fused scan's checkpoint states
    (`save_chunks`), each against the plain forms computed beside it: the rows' new states in their live slots and
    nothing else written, the outputs, and the saved states equal to the stacked chunk states."""
    rng = np.random.default_rng(0)
    L, NS, H, dk, dv = 2, 6, 2, 4, 8
    pool = jnp.asarray(rng.standard_normal((L, NS, H, dk, dv)), jnp.float32)
    src, live = jnp.asarray([2, 5, 1], jnp.int32), jnp.asarray([3, 4, 1], jnp.int32)  # row 0 restores from slot 2
    warm, lengths = jnp.asarray([True, True, False]), jnp.asarray([1, 1, 0], jnp.int32)  # row 2: cold, padding
    q, k = (jnp.asarray(rng.standard_normal((3, 1, H, dk)) * 0.3, jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((3, 1, H, dv)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0.1, 1, (3, 1, H)), jnp.float32)
    beta = jnp.asarray(rng.uniform(size=(3, 1, H)), jnp.float32)
    o, new = jax.jit(partial(advance_in_pool, layer=1, forms=forms))(pool, src, live, warm, lengths, q, k, v, g, beta)
    s0 = jnp.where(warm[:, None, None, None], pool[1, src], 0.0)
    o_ref, S_ref = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0, lengths=lengths)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(new[1, live]), np.asarray(S_ref), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(new[1, live[2]]), 0.0)  # the cold padding row: zeros, passed through
    others = np.ones(NS, bool)
    others[np.asarray(live)] = False
    np.testing.assert_array_equal(np.asarray(new[1, others]), np.asarray(pool[1, others]))
    np.testing.assert_array_equal(np.asarray(new[0]), np.asarray(pool[0]))

    T, C = 40, 8
    qs, ks = (jnp.asarray(rng.standard_normal((2, T, H, dk)) * 0.3, jnp.float32) for _ in range(2))
    vs = jnp.asarray(rng.standard_normal((2, T, H, dv)), jnp.float32)
    gs = -jnp.asarray(rng.uniform(0.1, 1, (2, T, H)), jnp.float32)
    bs = jnp.asarray(rng.uniform(size=(2, T, H)), jnp.float32)
    rows, chunks = jnp.asarray([1, 0, 1], jnp.int32), jnp.asarray([1, 4, 1], jnp.int32)
    kw = dict(lengths=jnp.asarray([40, 25]), chunk_size=C, impl="fused", saves_in_place=forms.cpu)
    _, _, states = chunk_gated_delta_rule(qs, ks, vs, gs, bs, output_chunk_states=True, **kw)
    _, _, saved = jax.jit(lambda *a: chunk_gated_delta_rule(*a, save_chunks=(rows, chunks), **kw))(qs, ks, vs, gs, bs)
    np.testing.assert_array_equal(np.asarray(saved), np.asarray(states[rows, chunks]))


def test_decode_update_and_fused_saves_on_the_cpu():
    _decode_update_and_saves(tuning.product_forms(jnp.float32))  # (the kernels where they load, as the engine's)


def test_decode_update_and_fused_saves_on_an_accelerator():
    """Off the CPU the decode step writes its rows' states with one scatter (not a loop of row writes), and the
    fused scan writes a chunk's saves with one select over its buffer (not a loop of in-place writes): the same
    values."""
    _decode_update_and_saves(ACCELERATOR)


def _barriers(jaxpr) -> int:
    return sum(e.primitive.name == "optimization_barrier" for e in jaxpr.eqns)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("n", [4, KEYS_LEFT_QUERIES, KEYS_LEFT_QUERIES + 8])
def test_attention_scores_with_the_keys_on_the_left_are_the_products(dtype, n):
    """On the CPU a few queries per KV head (a decode step's) multiply with the keys on the left, then transpose the
    result; more queries multiply as q @ k.T. Either way the scores are the float32 products of the operands."""
    rng = np.random.default_rng(n)
    qh = jnp.asarray(rng.standard_normal((3, n, 64)), dtype)
    keys = jnp.asarray(rng.standard_normal((3, 96, 64)), dtype)
    want = np.einsum("kqd,ksd->kqs", np.asarray(qh, np.float64), np.asarray(keys, np.float64))
    scores = partial(attention_scores, forms=Forms(cpu=True))
    got = jax.jit(scores)(qh, keys)
    assert got.dtype == jnp.float32 and got.shape == (3, n, 96)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)
    assert _barriers(jax.make_jaxpr(scores)(qh, keys).jaxpr) == (n <= KEYS_LEFT_QUERIES)


def test_attention_scores_keep_the_plain_form_on_an_accelerator():
    """Off the CPU the scores are q @ k.T whatever the queries: the turned form is for XLA's CPU library."""
    qh, keys = jnp.ones((2, 4, 8), jnp.bfloat16), jnp.ones((2, 16, 8), jnp.bfloat16)
    assert _barriers(jax.make_jaxpr(partial(attention_scores, forms=ACCELERATOR))(qh, keys).jaxpr) == 0
