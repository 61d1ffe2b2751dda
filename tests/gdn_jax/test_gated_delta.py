"""Gated DeltaNet kernels against float64 numpy oracles (tiny shapes, CPU).

The oracles are plain numpy in float64; JAX runs in its default float32 (x64 stays off).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn_jax.model.gated_delta import (
    causal_conv1d,
    chunk_gated_delta_rule,
    decode_token,
    l2norm,
    new_state,
    recurrent_gated_delta_rule,
)
from tests.gdn_jax.helpers import PREFILL_OPTIONS

pytestmark = pytest.mark.model

H, DK, DV = 2, 16, 8  # dk != dv so a transposed state cannot pass
RTOL, ATOL = 1e-4, 1e-5

# shared jitted entry points (one compilation per shape / static configuration)
chunk_jit = jax.jit(
    chunk_gated_delta_rule,
    static_argnames=("chunk_size", "output_chunk_states", "impl", "chunks_per_step", "solve_method"),
    compiler_options=PREFILL_OPTIONS,
)
rec_jit = jax.jit(recurrent_gated_delta_rule, compiler_options=PREFILL_OPTIONS)
conv_jit = jax.jit(causal_conv1d, compiler_options=PREFILL_OPTIONS)


# ------------------------------------------------------------------------------------------
# inputs built the way the model builds them, and the oracles
# ------------------------------------------------------------------------------------------


def _softplus(x):
    return np.logaddexp(0.0, x)


def make_inputs(B, T, seed=0, a_range=(0.1, 1.0), with_state=False):
    """q, k l2-normalised (q scaled by dk**-0.5), g = -exp(A_log) softplus(a + dt_bias),
    beta = sigmoid(b); exp(A_log) ~ uniform(a_range) per head."""
    r = np.random.default_rng(seed)
    q = r.standard_normal((B, T, H, DK)).astype(np.float32)
    k = r.standard_normal((B, T, H, DK)).astype(np.float32)
    q = np.array(l2norm(jnp.asarray(q))) * DK**-0.5
    k = np.array(l2norm(jnp.asarray(k)))
    v = r.standard_normal((B, T, H, DV)).astype(np.float32)
    A = r.uniform(*a_range, size=H)
    dt_bias = r.standard_normal(H)
    a = r.standard_normal((B, T, H))
    g = (-A * _softplus(a + dt_bias)).astype(np.float32)
    beta = (1.0 / (1.0 + np.exp(-r.standard_normal((B, T, H))))).astype(np.float32)
    s0 = (0.5 * r.standard_normal((B, H, DK, DV))).astype(np.float32) if with_state else None
    return q, k, v, g, beta, s0


def oracle_rule(q, k, v, g, beta, s0=None, lengths=None):
    """Token-by-token float64 reference. Returns (o [B,T,H,dv], states after every token
    [B, T, H, dk, dv], final state [B, H, dk, dv]); rows stop updating at lengths[b]."""
    q, k, v, g, beta = (np.asarray(a, np.float64) for a in (q, k, v, g, beta))
    B, T = k.shape[:2]
    S = np.zeros((B, H, DK, DV)) if s0 is None else np.array(s0, np.float64)
    n = np.full(B, T) if lengths is None else np.asarray(lengths)
    o = np.zeros((B, T, H, DV))
    states = np.zeros((B, T, H, DK, DV))
    for t in range(T):
        live = (t < n)[:, None, None, None]
        Sn = S * np.exp(g[:, t])[..., None, None]
        pred = np.einsum("bhkv,bhk->bhv", Sn, k[:, t])
        delta = (v[:, t] - pred) * beta[:, t][..., None]
        Sn = Sn + k[:, t][..., :, None] * delta[..., None, :]
        o[:, t] = np.einsum("bhkv,bhk->bhv", Sn, q[:, t])
        S = np.where(live, Sn, S)
        states[:, t] = S
    return o, states, S


def oracle_conv(x, w, state, lengths=None):
    """Direct float64 causal depthwise conv + SiLU and the new conv state, row by row."""
    x, w, state = (np.asarray(a, np.float64) for a in (x, w, state))
    B, T, C = x.shape
    K = w.shape[1]
    y = np.zeros((B, T, C))
    new = np.zeros((B, K - 1, C))
    for b in range(B):
        hist = np.concatenate([state[b], x[b]], 0)  # [K-1+T, C]
        for t in range(T):
            acc = sum(w[:, j] * hist[t + j] for j in range(K))  # input at time t-(K-1)+j
            y[b, t] = acc / (1.0 + np.exp(-acc))
        n = T if lengths is None else int(lengths[b])
        new[b] = hist[n : n + K - 1]
    return y, new


def _close(actual, expected, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=rtol, atol=atol)


def _j(*arrays):
    return [None if a is None else jnp.asarray(a) for a in arrays]


# ------------------------------------------------------------------------------------------
# chunked vs oracle
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "T, lengths, with_state, impl",
    [
        (128, None, False, "fused"),  # chunk-aligned, cold
        (128, None, True, "fused"),  # chunk-aligned, warm
        (128, None, True, "parallel"),
        (100, [100, 77], False, "fused"),  # ragged (T not a multiple of 64), padded row
        (100, [100, 77], False, "parallel"),
        (100, [61, 100], True, "fused"),
        (40, None, True, "fused"),  # shorter than one chunk
        (40, [40, 13], False, "fused"),
        (40, [40, 13], False, "parallel"),
    ],
)
def test_chunked_matches_oracle_mild_decay(T, lengths, with_state, impl):
    q, k, v, g, beta, s0 = make_inputs(2, T, seed=T + 7 * with_state, with_state=with_state)
    o_ref, _, S_ref = oracle_rule(q, k, v, g, beta, s0, lengths)
    ln = None if lengths is None else jnp.asarray(lengths, jnp.int32)
    o, S = chunk_jit(*_j(q, k, v, g, beta, s0), lengths=ln, impl=impl)
    assert o.shape == (2, T, H, DV) and o.dtype == jnp.float32
    assert S.shape == (2, H, DK, DV) and S.dtype == jnp.float32
    n = [T, T] if lengths is None else lengths
    for b in range(2):
        _close(o[b, : n[b]], o_ref[b, : n[b]])
    _close(S, S_ref)


def test_strong_decay_finite_and_close():
    # exp(A_log) ~ uniform(0.01, 16) like transformers' init: per-token g down to ~ -50
    q, k, v, g, beta, s0 = make_inputs(2, 150, seed=3, a_range=(0.01, 16.0), with_state=True)
    g[:, 20:30] *= 8.0  # a stretch of very strong decay: exp(G_i - G_j) underflows to 0
    lengths = [150, 101]
    o_ref, _, S_ref = oracle_rule(q, k, v, g, beta, s0, lengths)
    for impl in ("fused", "parallel"):
        o, S = chunk_jit(*_j(q, k, v, g, beta, s0), lengths=jnp.asarray(lengths), impl=impl)
        assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(S)).all()
        _close(o[0], o_ref[0], rtol=0, atol=1e-3)
        _close(o[1, :101], o_ref[1, :101], rtol=0, atol=1e-3)
        _close(S, S_ref, rtol=0, atol=1e-3)


def test_a_full_reset_gate_equals_the_recurrence():
    """g = -inf (exp(g) = 0: the state is wiped) and a finite g too negative for float32 differences (-1e30): the
    chunked form's in-chunk cumulative decays would subtract -inf from -inf (NaN) or lose every later token's decay
    to cancellation; it must give what the token-by-token rule gives."""
    q, k, v, g, beta, s0 = make_inputs(2, 150, seed=5, with_state=True)
    g[0, 3], g[0, 70:72], g[1, 40] = -np.inf, -np.inf, -1e30  # early in a chunk, two in a row, a finite one
    g[1, 128] = -np.inf  # the first token of a chunk (of 64 and of 32 tokens)
    o_ref, _, S_ref = oracle_rule(q, k, v, g, beta, s0)
    o_rec, S_rec = rec_jit(*_j(q, k, v, g, beta, s0))
    _close(o_rec, o_ref)
    _close(S_rec, S_ref)
    for kw in (dict(), dict(impl="parallel"), dict(chunk_size=32), dict(solve_method="trsm")):
        o, S = chunk_jit(*_j(q, k, v, g, beta, s0), **kw)
        _close(o, o_ref)
        _close(S, S_ref)


def test_repeated_keys_ill_conditioned_chunk():
    """Repeated text gives identical keys: with beta ~ 1 the UT system's inverse is well behaved
    but power-series inverses blow up; the blocked inverse and trsm must both stay accurate."""
    q, k, v, g, beta, s0 = make_inputs(1, 128, seed=9, with_state=True)
    k[:, 10:110] = k[:, 10:11]  # 100 identical keys across a chunk boundary
    q[:, 10:110] = q[:, 10:11]
    beta[:, 10:110] = 0.999
    g[:, 10:110] = -1e-3
    o_ref, _, S_ref = oracle_rule(q, k, v, g, beta, s0)
    for kw in (dict(), dict(solve_method="trsm"), dict(impl="parallel")):
        o, S = chunk_jit(*_j(q, k, v, g, beta, s0), **kw)
        _close(o, o_ref, rtol=0, atol=1e-4)
        _close(S, S_ref, rtol=0, atol=1e-4)


def test_chunked_equals_recurrent():
    q, k, v, g, beta, s0 = make_inputs(2, 100, seed=11, with_state=True)
    lengths = jnp.asarray([100, 58])
    o_c, S_c = chunk_jit(*_j(q, k, v, g, beta, s0), lengths=lengths)
    o_r, S_r = rec_jit(*_j(q, k, v, g, beta, s0), lengths=lengths)
    _close(o_c[0], np.asarray(o_r[0], np.float64))
    _close(o_c[1, :58], np.asarray(o_r[1, :58], np.float64))
    _close(S_c, np.asarray(S_r, np.float64))
    # the recurrent form against the oracle as well
    o_ref, _, S_ref = oracle_rule(q, k, v, g, beta, s0, [100, 58])
    _close(o_r[0], o_ref[0])
    _close(S_r, S_ref)


def test_solve_methods_and_chunk_sizes_agree():
    """blocked inverse vs LAPACK/cuBLAS triangular solve, other chunk sizes, other grouping."""
    q, k, v, g, beta, s0 = make_inputs(1, 96, seed=5, a_range=(0.01, 16.0), with_state=True)
    o_ref, _, S_ref = oracle_rule(q, k, v, g, beta, s0)
    args = _j(q, k, v, g, beta, s0)
    for kw in (
        dict(solve_method="trsm"),
        dict(chunk_size=16, chunks_per_step=3),  # 6 chunks, 3 per scan step
        dict(chunk_size=16, impl="parallel"),
        dict(chunk_size=24),  # not a power of two: falls back to the triangular solve
    ):
        o, S = chunk_jit(*args, **kw)
        _close(o, o_ref, rtol=0, atol=1e-4)
        _close(S, S_ref, rtol=0, atol=1e-4)


@pytest.mark.parametrize("chunk_size", [16, 24])  # blocked inverse / triangular-solve fallback
def test_unknown_solve_method_is_rejected(chunk_size):
    q, k, v, g, beta, _ = make_inputs(1, 48, seed=6)
    with pytest.raises(ValueError, match="unknown solve method"):
        chunk_gated_delta_rule(*_j(q, k, v, g, beta), chunk_size=chunk_size, solve_method="blockd")


@pytest.mark.parametrize("chunk_size", [0, -64])
def test_a_chunk_size_below_one_is_rejected(chunk_size):
    q, k, v, g, beta, _ = make_inputs(1, 48, seed=6)
    with pytest.raises(ValueError, match=f"chunk_size must be a positive number of tokens, got {chunk_size}"):
        chunk_gated_delta_rule(*_j(q, k, v, g, beta), chunk_size=chunk_size)


# ------------------------------------------------------------------------------------------
# continuation, padding, chunk states
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("split", [37, 64])
def test_split_equals_one_pass(split):
    T = 150
    q, k, v, g, beta, s0 = make_inputs(2, T, seed=21, with_state=True)
    full = _j(q, k, v, g, beta)
    o_all, S_all = chunk_jit(*full, s0)
    first = [a[:, :split] for a in full]
    rest = [a[:, split:] for a in full]
    o1, S1 = chunk_jit(*first, s0)
    o2, S2 = chunk_jit(*rest, S1)
    _close(jnp.concatenate([o1, o2], 1), np.asarray(o_all, np.float64))
    _close(S2, np.asarray(S_all, np.float64))
    # decode-style continuation: the rest token by token with the recurrent form
    o3, S3 = rec_jit(*rest, S1)
    _close(o3, np.asarray(o2, np.float64))
    _close(S3, np.asarray(S_all, np.float64))


def test_padded_tokens_are_inert():
    T, n = 100, 70
    q, k, v, g, beta, s0 = make_inputs(2, T, seed=33, with_state=True)
    r = np.random.default_rng(1)
    # garbage in row 1's padding, including NaN and positive "log decays"
    for a in (q, k, v):
        a[1, n:] = r.standard_normal(a[1, n:].shape) * 1e3
    v[1, n + 3] = np.nan
    k[1, n + 5] = np.inf
    g[1, n:] = 50.0
    beta[1, n:] = 7.0
    lengths = jnp.asarray([T, n])
    args = _j(q, k, v, g, beta, s0)
    alone = [a[1:2, :n] for a in args[:5]] + [args[5][1:2]]
    for fn in (
        lambda *a, **kw: chunk_jit(*a, **kw),
        lambda *a, **kw: chunk_jit(*a, **kw, impl="parallel"),
        rec_jit,
    ):
        o, S = fn(*args, lengths=lengths)
        o1, S1 = fn(*alone)
        assert np.isfinite(np.asarray(S)).all()
        _close(o[1, :n], np.asarray(o1[0], np.float64))
        _close(S[1], np.asarray(S1[0], np.float64))
    # lengths == 0: the state passes through untouched (a padded batch row)
    o, S = chunk_jit(*args, lengths=jnp.asarray([0, n]))
    np.testing.assert_array_equal(np.asarray(S[0]), s0[0])


def test_decode_step_with_padded_row():
    q, k, v, g, beta, s0 = make_inputs(2, 1, seed=41, with_state=True)
    o_ref, _, S_ref = oracle_rule(q, k, v, g, beta, s0, [1, 0])
    o, S = rec_jit(*_j(q, k, v, g, beta, s0), lengths=jnp.asarray([1, 0]))
    _close(o[0], o_ref[0])
    _close(S, S_ref)
    np.testing.assert_array_equal(np.asarray(S[1]), s0[1])


def test_decode_token_parts_give_the_rule():
    """The decode step's parts (the engine computes the new state where it writes it): the oracle's output and state,
    garbage in a padded row (lengths 0) dropped and its state passed through."""
    q, k, v, g, beta, s0 = make_inputs(3, 1, seed=43, with_state=True)
    for a in (q, k, v):
        a[2] = np.nan
    g[2], beta[2] = 50.0, 7.0
    o_ref, _, S_ref = oracle_rule(q, k, v, g, beta, s0, [1, 1, 0])
    o, e, kf, delta = jax.jit(decode_token)(*_j(s0, q, k, v, g, beta), lengths=jnp.asarray([1, 1, 0]))
    S = new_state(jnp.asarray(s0), e, kf, delta)
    _close(o[:2], o_ref[:2])
    np.testing.assert_array_equal(np.asarray(o[2]), 0.0)
    _close(S[:2], S_ref[:2])
    np.testing.assert_array_equal(np.asarray(S[2]), s0[2])


@pytest.mark.parametrize("impl", ["fused", "parallel"])
def test_output_chunk_states(impl):
    T = 150  # chunks end at 64, 128, 192 (the last one padded)
    q, k, v, g, beta, s0 = make_inputs(2, T, seed=51, with_state=True)
    lengths = [150, 90]
    _, states, S_ref = oracle_rule(q, k, v, g, beta, s0, lengths)
    o, S, cs = chunk_jit(
        *_j(q, k, v, g, beta, s0), lengths=jnp.asarray(lengths), output_chunk_states=True, impl=impl
    )
    assert cs.shape == (2, 3, H, DK, DV) and cs.dtype == jnp.float32
    for c in range(3):
        t = min((c + 1) * 64, T) - 1
        _close(cs[:, c], states[:, t])  # row 1 stops at token 89: its later chunk states equal it
    _close(cs[:, -1], S_ref)
    _close(S, S_ref)


@pytest.mark.parametrize("impl, per_step", [("fused", 1), ("fused", 2), ("parallel", 1)])
def test_save_chunks_are_those_chunk_states(impl, per_step):
    """`save_chunks` (the checkpoints of a prefill step) gives the states of the rows and chunks asked for, the same
    ones as the stacked chunk states, in the order asked, a chunk asked twice included; the output and the final
    state do not change."""
    T, C = 150, 16  # 10 chunks, the last one padded
    q, k, v, g, beta, s0 = make_inputs(2, T, seed=53, with_state=True)
    args = _j(q, k, v, g, beta, s0)
    lengths = jnp.asarray([150, 90])
    kw = dict(lengths=lengths, chunk_size=C, impl=impl, chunks_per_step=per_step)
    o_ref, S_ref, cs = chunk_jit(*args, output_chunk_states=True, **kw)
    rows = jnp.asarray([1, 0, 0, 1, 0], jnp.int32)
    chunks = jnp.asarray([2, 0, 7, 8, 7], jnp.int32)
    save_jit = jax.jit(chunk_gated_delta_rule, static_argnames=("chunk_size", "impl", "chunks_per_step"),
                       compiler_options=PREFILL_OPTIONS)
    o, S, saved = save_jit(*args, save_chunks=(rows, chunks), **kw)
    assert saved.shape == (5, H, DK, DV)
    np.testing.assert_array_equal(np.asarray(saved), np.asarray(cs[rows, chunks]))
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_ref))
    np.testing.assert_array_equal(np.asarray(S), np.asarray(S_ref))
    _, states, _ = oracle_rule(q, k, v, g, beta, s0, [150, 90])
    _close(saved[0], states[1, 2 * C + C - 1])  # row 1 after its third chunk (token 47)
    _close(saved[3], states[1, 89])  # past its length: its last state
    with pytest.raises(ValueError, match="exclusive"):
        chunk_gated_delta_rule(*args, output_chunk_states=True, save_chunks=(rows, chunks), **kw)


def test_bf16_inputs_upcast():
    q, k, v, g, beta, s0 = make_inputs(1, 100, seed=61, with_state=True)
    bf = [jnp.asarray(a, jnp.bfloat16) for a in (q, k, v, g, beta)]
    o, S = chunk_jit(*bf, jnp.asarray(s0))
    assert o.dtype == jnp.bfloat16 and S.dtype == jnp.float32
    # the oracle on the bf16-rounded inputs: only the final bf16 output cast differs
    o_ref, _, S_ref = oracle_rule(*(np.asarray(a.astype(jnp.float32)) for a in bf), s0)
    _close(S, S_ref)
    _close(o.astype(jnp.float32), o_ref, rtol=1e-2, atol=1e-2)


def test_l2norm():
    x = np.random.default_rng(0).standard_normal((3, 5, 16)).astype(np.float32)
    ref = x / np.sqrt((x.astype(np.float64) ** 2).sum(-1, keepdims=True) + 1e-6)
    _close(l2norm(jnp.asarray(x)), ref, rtol=1e-5, atol=1e-6)
    assert l2norm(jnp.asarray(x, jnp.bfloat16)).dtype == jnp.float32  # computed in float32


# ------------------------------------------------------------------------------------------
# causal conv1d
# ------------------------------------------------------------------------------------------


def _conv_inputs(B, T, C=12, K=4, seed=0):
    r = np.random.default_rng(seed)
    x = r.standard_normal((B, T, C)).astype(np.float32)
    w = (0.5 * r.standard_normal((C, K))).astype(np.float32)
    st = r.standard_normal((B, K - 1, C)).astype(np.float32)
    return x, w, st


def test_conv_matches_oracle():
    x, w, st = _conv_inputs(3, 9, seed=1)
    y_ref, new_ref = oracle_conv(x, w, st)
    y, new = conv_jit(*_j(x, w, st))
    _close(y, y_ref)
    _close(new, new_ref, rtol=0, atol=0)
    # cold start (zero state) is HF's causal_conv1d_fn (left zero padding)
    y0, _ = conv_jit(*_j(x, w, np.zeros_like(st)))
    _close(y0, oracle_conv(x, w, np.zeros_like(st))[0])


def test_conv_ragged_lengths_and_padding():
    T = 9
    x, w, st = _conv_inputs(4, T, seed=2)
    lengths = [9, 5, 2, 0]  # 2 < K-1: the new state mixes old state and new inputs; 0: unchanged
    y_ref, new_ref = oracle_conv(x, w, st, lengths)
    xg = x.copy()
    for b, n in enumerate(lengths):
        xg[b, n:] = 1e4  # garbage in the padding must not reach real outputs or the state
    y, new = conv_jit(*_j(xg, w, st), lengths=jnp.asarray(lengths))
    for b, n in enumerate(lengths):
        _close(y[b, :n], y_ref[b, :n])
    _close(new, new_ref, rtol=0, atol=0)
    np.testing.assert_array_equal(np.asarray(new[3]), st[3])
    # the padded row alone (no padding) gives the same state
    _, new1 = conv_jit(*_j(x[1:2, :5], w, st[1:2]))
    np.testing.assert_array_equal(np.asarray(new[1]), np.asarray(new1[0]))


@pytest.mark.parametrize("split", [1, 2, 37, 64])  # shorter than K-1, inside / on a chunk boundary
def test_conv_split_equals_one_pass(split):
    x, w, st = _conv_inputs(2, 150, seed=3)
    y_all, s_all = conv_jit(*_j(x, w, st))
    y1, s1 = conv_jit(*_j(x[:, :split], w, st))
    y2, s2 = conv_jit(jnp.asarray(x[:, split:]), jnp.asarray(w), s1)
    _close(jnp.concatenate([y1, y2], 1), np.asarray(y_all, np.float64), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(s2), np.asarray(s_all))


def test_conv_then_rule_split_with_ragged_batch():
    """The layer-level pattern: conv + rule over a prefix, then over the rest from both states,
    in a batch whose second row is padded; equals one pass over the real tokens."""
    T, split = 90, 64
    n = [90, 75]
    q, k, v, g, beta, s0 = make_inputs(2, T, seed=71)
    x, w, st = _conv_inputs(2, T, C=DV * H, seed=72)
    y_all, cs_all = conv_jit(*_j(x, w, st), lengths=jnp.asarray(n))
    vv = y_all.reshape(2, T, H, DV)  # use the conv output as the values
    o_all, S_all = chunk_jit(*_j(q, k), vv, *_j(g, beta), lengths=jnp.asarray(n))
    # two steps: rows advance min(n, split) then the rest
    n1 = [min(m, split) for m in n]
    n2 = [m - a for m, a in zip(n, n1)]
    y1, cs1 = conv_jit(*_j(x[:, :split], w, st), lengths=jnp.asarray(n1))
    o1, S1 = chunk_jit(*_j(q[:, :split], k[:, :split]), y1.reshape(2, split, H, DV),
                       *_j(g[:, :split], beta[:, :split]), lengths=jnp.asarray(n1))
    y2, cs2 = conv_jit(jnp.asarray(x[:, split:]), jnp.asarray(w), cs1, lengths=jnp.asarray(n2))
    o2, S2 = chunk_jit(*_j(q[:, split:], k[:, split:]), y2.reshape(2, T - split, H, DV),
                       *_j(g[:, split:], beta[:, split:]), S1, lengths=jnp.asarray(n2))
    np.testing.assert_array_equal(np.asarray(cs2), np.asarray(cs_all))
    _close(S2, np.asarray(S_all, np.float64))
    o = jnp.concatenate([o1, o2], 1)
    for b in range(2):
        _close(o[b, : n[b]], np.asarray(o_all[b, : n[b]], np.float64))
