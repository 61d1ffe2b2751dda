"""Gated DeltaNet numerical kernels: l2norm, causal depthwise conv1d, gated delta rule.

Semantics (per value head, state ``S`` of shape ``[dk, dv]``, float32)::

    S <- exp(g_t) * S
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T
    o_t = S^T q_t

Two forms of the rule, with the same inputs and outputs:

* :func:`chunk_gated_delta_rule`: the chunked WY / UT form used for prefill. In a chunk of ``C``
  tokens with in-chunk cumulative log-decay ``G`` (``G_i = g_0 + ... + g_i``), let
  ``A_ij = beta_i <k_i, k_j> exp(G_i - G_j)`` for ``i > j`` (zero elsewhere) and ``T = I + A``
  (unit lower triangular). With ``U = T^-1 (beta * v)``, ``W = T^-1 (beta * exp(G) * k)`` and ``S``
  the state entering the chunk::

      V_new  = U - W S                                  (the per-token deltas)
      O      = P V_new + (exp(G) * q) S,   P_ij = <q_i, k_j> exp(G_i - G_j) for i >= j, else 0
      S_next = exp(G_last) S + (exp(G_last - G) * k)^T V_new

  ``T^-1`` is formed by blocked recursive inversion (forward substitution on 8x8 diagonal blocks,
  then doubling: ``[[X11, 0], [-X22 A21 X11, X22]]``), i.e. only small batched matmuls. On a CPU
  it is faster than ``lax.linalg.triangular_solve`` (a LAPACK ``strsm`` call per matrix), alone and
  inside the whole rule (docs/benchmarks.md); it has forward-substitution accuracy (no power series,
  whose terms blow up for repeated keys).
  ``solve_method="trsm"`` selects the library triangular solve instead.

  Two schedules of the same maths (``impl``):
  - ``"fused"`` (the default; the model's with the CPU forms, whose prefill steps run the compiled token-by-token
    kernel instead where the forms have it, ``cpu_kernels.gdn_prefill``): one ``lax.scan`` step handles
    ``chunks_per_step`` chunks (1 by default: two per step ran slower) and does everything for them (intra-chunk
    matrices, the solve, the state recurrence, the output), so every intermediate stays in cache. On a CPU this is
    faster than materialising the intra-chunk tensors for the whole sequence (docs/benchmarks.md).
  - ``"parallel"`` (the model's without the CPU forms: accelerators): all intra-chunk work as large batched ops
    over every chunk at once, then a ``lax.scan`` over chunks carrying only the state (2 small matmuls per
    step), then the output as one batched matmul.
* :func:`recurrent_gated_delta_rule`: token by token under ``lax.scan``; :func:`decode_token` is one token of it
  (the engine's decode step), which leaves the new state (:func:`new_state`) to the caller to compute where it
  writes it. Each token reads the state
  entering it twice: one product with ``[k, q]``, then the update, ``o = exp(g) S^T q + (k . q) delta`` (the
  same as ``S_new^T q``), so the new state is written and never read again.

Numerics: gates and state are float32 whatever the input dtype (inputs are upcast); every matmul
uses ``precision=HIGHEST``; pairwise decays are ``exp`` of the *masked* difference ``G_i - G_j`` (the
upper triangle is set to ``-inf`` before ``exp``; never factored as ``exp(G_i) * exp(-G_j)``).
All other exponents used are ``G <= 0`` and ``G_last - G <= 0`` (no overflow). The chunked form
first raises every ``g`` to at least ``G_FLOOR`` (-128): ``exp`` of it, or of any in-chunk sum holding
it, is already 0 in float32, so the rule is unchanged, while ``g = -inf`` (a full reset) no longer
gives ``-inf - (-inf) = NaN`` in ``G_i - G_j``, nor a huge finite ``g`` (-1e30) differences that
cancel to 0 (a decay of 1) for the chunk's later tokens.

Padding: with ``lengths``, tokens at ``t >= lengths[b]`` are made inert (``g = 0, beta = 0,
k = 0``; ``q`` and ``v`` are zeroed too, so garbage there cannot make NaN), so the final state is
the state after the last real token. Their outputs are zeros. The chunked form also pads ``T`` up
to a multiple of the chunk size internally with inert tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "l2norm",
    "causal_conv1d",
    "chunk_gated_delta_rule",
    "decode_token",
    "default_chunk_size",
    "new_state",
    "recurrent_gated_delta_rule",
    "token_step",
]

_HI = lax.Precision.HIGHEST
_F32 = jnp.float32
# the least log-decay per token the chunked form uses: exp(-128) underflows to 0 in float32 (below its least
# subnormal, ~1.4e-45), as exp(-inf) does, and the in-chunk sums of a few such terms keep their small differences
G_FLOOR = -128.0
# The chunk size the model runs the chunked rule with (`default_chunk_size`). On a CPU a chunk's small products and
# its blocked inversion are library calls and loops of a few microseconds each, one chunk after the other on one
# core: 32-token chunks run the rule and compile faster than 64, and 16 no faster at the larger models' shapes
# (docs/benchmarks.md). Accelerators run the "parallel" schedule, where 64 is the usual size.
CPU_CHUNK_SIZE, ACCELERATOR_CHUNK_SIZE = 32, 64


def default_chunk_size(cpu: bool) -> int:
    """The chunked rule's chunk size: `CPU_CHUNK_SIZE` with the CPU forms (`Forms.cpu`), else
    `ACCELERATOR_CHUNK_SIZE`. The engine runs gcd(this, chunk_stride), so that every checkpoint boundary is a chunk
    end."""
    return CPU_CHUNK_SIZE if cpu else ACCELERATOR_CHUNK_SIZE


def _mm(spec, a, b):
    return jnp.einsum(spec, a, b, precision=_HI, preferred_element_type=_F32)


def l2norm(x, eps: float = 1e-6):
    """``x * rsqrt(sum(x^2, -1) + eps)`` computed in float32 (returns float32)."""
    x = x.astype(_F32)
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


# --------------------------------------------------------------------------------------------
# causal depthwise conv1d
# --------------------------------------------------------------------------------------------


def causal_conv1d(x, weight, conv_state, lengths=None):
    """Depthwise causal conv (no bias) followed by SiLU.

    x: [B, T, C] pre-conv inputs; weight: [C, K] (``weight[c, j]`` multiplies the input at time
    ``t - (K-1) + j``: the HF layout, ``conv1d.weight[:, 0, :]``); conv_state: [B, K-1, C], the last
    K-1 pre-conv inputs before ``x[:, 0]`` (zeros for a cold start); lengths: [B] int, the number of
    real tokens per row (None = T); tokens at ``t >= lengths[b]`` are padding.

    Returns ``(y, new_conv_state)``: y [B, T, C] (dtype of x) = silu(conv), computed in float32;
    new_conv_state [B, K-1, C] (dtype of conv_state) = the last K-1 pre-conv inputs up to and
    including token ``lengths[b] - 1`` of ``concat([conv_state, x])`` (unchanged when
    ``lengths[b] == 0``). Outputs at padded positions are meaningless.
    """
    B, T, C = x.shape
    K = weight.shape[-1]
    w = weight.astype(_F32)
    xx = jnp.concatenate([conv_state.astype(_F32), x.astype(_F32)], axis=1)  # [B, T+K-1, C]
    acc = xx[:, 0:T, :] * w[:, 0]
    for j in range(1, K):
        acc = acc + xx[:, j : j + T, :] * w[:, j]
    y = (acc * jax.nn.sigmoid(acc)).astype(x.dtype)
    if K == 1:
        return y, conv_state
    if lengths is None:
        new_state = xx[:, T:, :]
    else:
        n = jnp.clip(jnp.asarray(lengths, jnp.int32), 0, T)
        # rows n .. n+K-2 of xx are the K-1 inputs ending with token n-1
        idx = n[:, None] + jnp.arange(K - 1, dtype=jnp.int32)[None, :]  # [B, K-1]
        new_state = jnp.take_along_axis(xx, idx[:, :, None], axis=1)
    return y, new_state.astype(conv_state.dtype)


# --------------------------------------------------------------------------------------------
# gated delta rule
# --------------------------------------------------------------------------------------------


def _valid_mask(B, T, lengths):
    """[B, T] bool, True for real tokens; None when every token is real."""
    if lengths is None:
        return None
    return jnp.arange(T, dtype=jnp.int32)[None, :] < jnp.asarray(lengths, jnp.int32)[:, None]


def _inert(valid, *arrays):
    """Upcast to float32 and zero the padded tokens (``where``, so NaN/inf garbage is dropped).
    valid: [B, T] (or any shape matching the arrays' leading dims) or None."""
    out = []
    for a in arrays:
        a = a.astype(_F32)
        if valid is not None:
            a = jnp.where(valid.reshape(valid.shape + (1,) * (a.ndim - valid.ndim)), a, 0.0)
        out.append(a)
    return out


def _initial_state(initial_state, B, H, dk, dv):
    if initial_state is None:
        return jnp.zeros((B, H, dk, dv), _F32)
    return jnp.asarray(initial_state).astype(_F32)


def _unit_lower_inverse(A, method: str = "blocked", base: int = 8):
    """``(I + A)^-1`` for strictly lower triangular ``A`` [..., C, C] (batched)."""
    if method not in ("blocked", "trsm"):
        raise ValueError(f"unknown solve method {method!r}")
    C = A.shape[-1]
    nb = C // base if base and C % base == 0 else 0
    if method == "trsm" or nb == 0 or (nb & (nb - 1)) != 0:
        eye = jnp.broadcast_to(jnp.eye(C, dtype=A.dtype), A.shape)
        return lax.linalg.triangular_solve(
            A + jnp.eye(C, dtype=A.dtype), eye, left_side=True, lower=True, unit_diagonal=True
        )
    lead = A.shape[:-2]
    # 1) inverses of the nb diagonal base x base blocks, row by row:  X_i = e_i - A_i,<i X_<i
    Ad = jnp.stack([A[..., i * base : (i + 1) * base, i * base : (i + 1) * base] for i in range(nb)], -3)
    eye = jnp.eye(base, dtype=A.dtype)
    rows = [jnp.broadcast_to(eye[0], Ad.shape[:-2] + (base,))]
    for i in range(1, base):
        prev = jnp.stack(rows, -2)  # [..., nb, i, base]
        rows.append(eye[i] - _mm("...j,...jn->...n", Ad[..., i, :i], prev))
    X = jnp.stack(rows, -2)  # [..., nb, base, base]
    # 2) doubling: inv([[T11, 0], [A21, T22]]) = [[X11, 0], [-X22 A21 X11, X22]]
    b = base
    while b < C:
        n = X.shape[-3] // 2
        X = X.reshape(lead + (n, 2, b, b))
        X11, X22 = X[..., 0, :, :], X[..., 1, :, :]
        A21 = jnp.stack(
            [A[..., (2 * p + 1) * b : (2 * p + 2) * b, 2 * p * b : (2 * p + 1) * b] for p in range(n)], -3
        )
        X21 = -_mm("...ij,...jk->...ik", X22, _mm("...ij,...jk->...ik", A21, X11))
        top = jnp.concatenate([X11, jnp.zeros_like(X11)], -1)
        bot = jnp.concatenate([X21, X22], -1)
        X = jnp.concatenate([top, bot], -2)
        b *= 2
    return X[..., 0, :, :]


def _intra_chunk(q, k, v, G, beta, solve_method):
    """Per-chunk quantities that do not depend on the state, batched over leading dims.

    q, k: [..., C, dk]; v: [..., C, dv]; G (in-chunk cumulative log decay), beta: [..., C].
    Returns U [..., C, dv], W [..., C, dk], P [..., C, C], qd = exp(G) q [..., C, dk],
    kd = exp(G_last - G) k [..., C, dk], cd = exp(G_last) [..., 1, 1].
    """
    C = G.shape[-1]
    ii = jnp.arange(C)
    incl = ii[:, None] >= ii[None, :]
    strict = ii[:, None] > ii[None, :]
    # pairwise decay exp(G_i - G_j): mask the upper triangle to -inf BEFORE exp
    decay = jnp.exp(jnp.where(incl, G[..., :, None] - G[..., None, :], -jnp.inf))
    A = jnp.where(strict, _mm("...cd,...sd->...cs", k, k) * decay * beta[..., :, None], 0.0)
    P = _mm("...cd,...sd->...cs", q, k) * decay
    Ti = _unit_lower_inverse(A, solve_method)
    eG = jnp.exp(G)[..., None]
    U = _mm("...ij,...jn->...in", Ti, v * beta[..., None])
    W = _mm("...ij,...jn->...in", Ti, k * (beta[..., None] * eG))
    G_last = G[..., -1:]
    kd = k * jnp.exp(G_last - G)[..., None]
    cd = jnp.exp(G_last)[..., None]
    return U, W, P, q * eG, kd, cd


def chunk_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    initial_state=None,
    lengths=None,
    chunk_size: int = 64,
    output_chunk_states: bool = False,
    *,
    save_chunks: tuple | None = None,
    impl: str = "fused",
    chunks_per_step: int = 1,
    solve_method: str = "blocked",
    saves_in_place: bool = True,
):
    """Chunked (WY / UT) gated delta rule.

    q, k: [B, T, H, dk] (already expanded to value heads; q l2-normalised and scaled by dk**-0.5,
    k l2-normalised); v: [B, T, H, dv]; g: [B, T, H] log-decay (<= 0); beta: [B, T, H];
    initial_state: [B, H, dk, dv] float32 or None (zeros); lengths: [B] int or None (tokens at
    ``t >= lengths[b]`` are inert). T need not be a multiple of chunk_size.

    Returns ``(o, final_state)`` -- o [B, T, H, dv] (dtype of v), final_state [B, H, dk, dv]
    float32 -- and, if ``output_chunk_states``, also the state after every chunk,
    [B, num_chunks, H, dk, dv] (chunk c covers tokens ``[c*chunk_size, (c+1)*chunk_size)``).
    ``save_chunks`` = (rows, chunks), [S] ints each: instead of every chunk's state, only the states of those rows
    after those chunks, [S, H, dk, dv], as the third output (the checkpoints a prefill step saves). The fused
    schedule keeps them in a buffer it carries, each written in place at its chunk: stacking all N states instead
    (zero-filled, then written chunk by chunk) made a long row's rule markedly slower (docs/design.md, "Checkpoints
    from the prefill scan").

    Keyword-only tuning knobs (same maths): ``impl`` "fused" | "parallel"; ``chunks_per_step`` (fused
    schedule); ``solve_method`` "blocked" | "trsm"; ``saves_in_place`` (fused schedule: each save written in place,
    one at a time, the CPU's form; False: one pass over the save buffer per chunk, an accelerator's, where a loop
    costs a device round trip a turn).
    """
    out_dtype = v.dtype
    B, T, H, dk = k.shape
    dv = v.shape[-1]
    Cs = int(chunk_size)
    if Cs < 1:
        raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size}")
    s0 = _initial_state(initial_state, B, H, dk, dv)
    valid = _valid_mask(B, T, lengths)
    g, beta = _inert(valid, g, beta)  # gates are small: mask them here
    g = jnp.maximum(g, G_FLOOR)  # a reset (g = -inf) is a decay of exactly 0 here too, not NaN (module docstring)
    N = max(1, -(-T // Cs))
    if impl == "fused":
        grp = max(1, int(chunks_per_step))
        if N % grp:
            grp = 1
    elif impl == "parallel":
        grp = N
    else:
        raise ValueError(f"unknown impl {impl!r}")
    if save_chunks is not None and output_chunk_states:
        raise ValueError("output_chunk_states and save_chunks are exclusive")
    if impl == "parallel":
        q, k, v = _inert(valid, q, k, v)
        valid = None
        if save_chunks is not None:  # every chunk's state, then the ones asked for
            output_chunk_states = True
    # else: q, k, v are upcast and masked inside the scan step, in cache (a bf16 or ragged batch
    # then costs no extra pass over the whole sequence)
    Tp = N * Cs
    if Tp != T:  # pad with inert tokens (zeros; the mask, if any, is padded with False)
        pad = Tp - T
        q, k, v = (jnp.pad(a, ((0, 0), (0, pad), (0, 0), (0, 0))) for a in (q, k, v))
        g, beta = (jnp.pad(a, ((0, 0), (0, pad), (0, 0))) for a in (g, beta))
        if valid is not None:
            valid = jnp.pad(valid, ((0, 0), (0, pad)))

    nsteps = N // grp

    # gates: [nsteps, B, H, grp, C] (small)
    def c3(a):
        return a.reshape(B, nsteps, grp, Cs, H).transpose(1, 0, 4, 2, 3)

    G = jnp.cumsum(c3(g), axis=-1)  # in-chunk cumulative log decay (<= 0)
    bc = c3(beta)

    if impl == "parallel":
        # [B, T, H, d] -> [B, H, N, C, d]
        qc, kc, vc = (a.reshape(B, N, Cs, H, a.shape[-1]).transpose(0, 3, 1, 2, 4) for a in (q, k, v))
        U, W, P, qd, kd, cd = _intra_chunk(qc, kc, vc, G[0], bc[0], solve_method)
        kdT = jnp.swapaxes(kd, -1, -2)  # one batched transpose so the scan's matmuls are plain
        # move the chunk axis first for the scan: [N, B, H, ...]
        U, W, P, qd, kdT, cd = (jnp.moveaxis(a, 2, 0) for a in (U, W, P, qd, kdT, cd))

        def step(S, x):
            u, w, kt, c = x
            vn = u - _mm("bhck,bhkv->bhcv", w, S)
            S_next = S * c + _mm("bhkc,bhcv->bhkv", kt, vn)
            return S_next, (vn, S, S_next if output_chunk_states else None)

        S_final, (VN, S_prev, states) = lax.scan(step, s0, (U, W, kdT, cd))
        o = _mm("nbhcs,nbhsv->nbhcv", P, VN) + _mm("nbhck,nbhkv->nbhcv", qd, S_prev)
        o = o.transpose(1, 0, 3, 2, 4).reshape(B, Tp, H, dv)  # [N,B,H,C,dv] -> [B,T,H,dv]
        chunk_states = jnp.moveaxis(states, 0, 1) if output_chunk_states else None
    else:

        def save(buf, S, hit):  # the states of the saves whose chunk this is
            if not saves_in_place:  # one pass over the buffer (a loop costs a device round trip a turn)
                return jnp.where(hit[:, None, None, None], S[save_chunks[0]], buf)

            def one(carry):  # on CPU one save at a time, in place (a chunk with none: no pass at all)
                buf, hit = carry
                i = jnp.argmax(hit)
                return lax.dynamic_update_index_in_dim(buf, S[save_chunks[0][i]], i, 0), hit.at[i].set(False)

            return lax.while_loop(lambda carry: jnp.any(carry[1]), one, (buf, hit))[0]

        def step(carry, x):
            S, buf = carry
            q_, k_, v_, G_, b_, m_, i = x  # [B, grp, C, H, d], [B, H, grp, C], [B, grp, C] | None, step index
            # upcast, mask, and to [B, H, grp, C, d] here, in cache (cheaper than passes over
            # the whole sequence in memory)
            q_, k_, v_ = (a.transpose(0, 3, 1, 2, 4) for a in _inert(m_, q_, k_, v_))
            U, W, P, qd, kd, cd = _intra_chunk(q_, k_, v_, G_, b_, solve_method)
            kdT = jnp.swapaxes(kd, -1, -2)  # the state update's product in the plain form (the library's)
            outs, sts = [], []
            for j in range(grp):
                vn = U[:, :, j] - _mm("bhck,bhkv->bhcv", W[:, :, j], S)
                outs.append(_mm("bhcs,bhsv->bhcv", P[:, :, j], vn) + _mm("bhck,bhkv->bhcv", qd[:, :, j], S))
                S = S * cd[:, :, j] + _mm("bhkc,bhcv->bhkv", kdT[:, :, j], vn)
                sts.append(S)
                if buf is not None:
                    buf = save(buf, S, save_chunks[1] == i * grp + j)
            o_ = jnp.stack(outs, 1).transpose(0, 1, 3, 2, 4)  # [B, grp, C, H, dv]
            return (S, buf), (o_, jnp.stack(sts, 1) if output_chunk_states else None)

        # [B, T, H, d] -> [nsteps, B, grp, C, H, d] (a pure reshape when B == 1)
        qc, kc, vc = (a.reshape(B, nsteps, grp, Cs, H, a.shape[-1]).swapaxes(0, 1) for a in (q, k, v))
        mc = None if valid is None else valid.reshape(B, nsteps, grp, Cs).swapaxes(0, 1)
        buf = None if save_chunks is None else jnp.zeros((save_chunks[0].shape[0], H, dk, dv), _F32)
        (S_final, saved), (o, states) = lax.scan(step, (s0, buf), (qc, kc, vc, G, bc, mc, jnp.arange(nsteps)))
        o = jnp.moveaxis(o, 0, 1).reshape(B, Tp, H, dv)  # [nsteps,B,grp,C,H,dv] -> [B,T,H,dv]
        chunk_states = None
        if output_chunk_states:  # [nsteps, B, grp, H, dk, dv] -> [B, N, H, dk, dv]
            chunk_states = jnp.moveaxis(states, 0, 1).reshape(B, N, H, dk, dv)

    o = o[:, :T].astype(out_dtype)
    if save_chunks is not None:
        if impl == "parallel":
            saved = chunk_states[save_chunks[0], save_chunks[1]]
        return o, S_final, saved
    if output_chunk_states:
        return o, S_final, chunk_states
    return o, S_final


def token_step(S, q_t, k_t, v_t, g_t, b_t):
    """One token of the rule on the states entering it, S [B, H, dk, dv] float32, and float32 inputs q_t, k_t
    [B, H, dk], v_t [B, H, dv], g_t, b_t [B, H] -> (o [B, H, dv], e [B, H, 1], delta [B, H, dv]), of which the new
    state is `new_state(S, e, k_t, delta)`. S^T k and S^T q come from one product (module docstring): the prediction
    is e * S^T k, the output e * S^T q + (k . q) * delta, so the new state is only written, never read."""
    e = jnp.exp(g_t)[..., None]
    kq = _mm("bhkv,bhnk->bhnv", S, jnp.stack([k_t, q_t], -2))
    delta = (v_t - e * kq[:, :, 0]) * b_t[..., None]
    return e * kq[:, :, 1] + jnp.sum(k_t * q_t, -1, keepdims=True) * delta, e, delta


def new_state(S, e, k_t, delta):
    """The state after a token (`token_step`): e S + k delta^T, on any leading axes ([..., dk, dv])."""
    return S * e[..., None] + k_t[..., :, None] * delta[..., None, :]


def decode_token(S, q, k, v, g, beta, lengths=None):
    """One token (T = 1) of every row on the states entering it, S [B, H, dk, dv] float32; q, k [B, 1, H, dk], v
    [B, 1, H, dv], g, beta [B, 1, H] -> (o [B, 1, H, dv] in v's dtype, e, k, delta), the new states being
    `new_state(S, e, k, delta)` (k float32 [B, H, dk]): for the caller to compute where it writes them. A row with
    `lengths` 0 is inert: its new state is S."""
    out_dtype = v.dtype
    q, k, v, g, beta = (a[:, 0] for a in _inert(_valid_mask(k.shape[0], 1, lengths), q, k, v, g, beta))
    o, e, delta = token_step(S, q, k, v, g, beta)
    return o[:, None].astype(out_dtype), e, k, delta


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None, lengths=None):
    """Token-by-token gated delta rule (``lax.scan`` over T); same inputs and outputs as
    :func:`chunk_gated_delta_rule` without chunk states."""
    out_dtype = v.dtype
    B, T, H, dk = k.shape
    s0 = _initial_state(initial_state, B, H, dk, v.shape[-1])
    q, k, v, g, beta = _inert(_valid_mask(B, T, lengths), q, k, v, g, beta)

    def step(S, x):
        o, e, delta = token_step(S, *x)
        return new_state(S, e, x[1], delta), o

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
    S_final, o = lax.scan(step, s0, xs)
    return jnp.moveaxis(o, 0, 1).astype(out_dtype), S_final
