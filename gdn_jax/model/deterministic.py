"""The deterministic forward (`Forms.deterministic`): a row's values, bit for bit, whatever the rows beside it, however
its prompt was split into steps, and wherever its cached prefix ends.

Every computation is cut into pieces of fixed shapes, each of which sees one row's inputs only:
- Row-local work (norms, projections, the MLP or MoE block, the LM head, log-softmax) runs in tiles of `TILE` rows
  (`rowwise`): every product is a [TILE, n_in] by [n_in, n_out] one, whatever the batch.
- Attention runs per row, its queries in blocks of `TILE` tokens, over key chunks of `KV_KEYS` keys on a grid fixed
  to absolute positions; a chunk beyond a query's reach leaves its online softmax exactly as it was.
- The GDN layer (conv, gates, the delta rule, the output norm) runs token by token, so that a prefill, a decode step
  and a restored checkpoint apply the same operations in the same order.
Every loop's trip count is opaque to XLA (`_loop`): a loop of one turn stays a loop, so its body compiles, and fuses,
the same way in every step shape (XLA's CPU backend contracts a multiply and an add into one FMA inside a fusion,
so a body fused with its neighbours would round differently). And every array a loop indexes has one entry more
than the loop visits (`_spare`): an index into an axis of one entry is a constant, which makes what it feeds
loop-invariant, and XLA would hoist that part of the body out of the loop (and fuse it there) in some step shapes
only.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from gdn_jax.model.attention import key_chunk, online_softmax_init, write_kv
from gdn_jax.model.forms import DETERMINISTIC, Forms
from gdn_jax.model.gated_delta import l2norm, new_state, token_step
from gdn_jax.model.layers import split_parts
from gdn_jax.model.state import Batch, DeviceState, from_pool, layer_ids, read_slots, write_rows

TILE = 16      # rows of every product, norm and softmax; query tokens per attention block
KV_KEYS = 256  # keys per attention chunk (whole KV blocks), on a grid fixed to absolute positions
_F32 = jnp.float32


def _loop(n, body, carry):
    """`lax.fori_loop(0, n, body, carry)` with a trip count XLA cannot fold: a loop of one turn is not inlined."""
    return lax.fori_loop(0, lax.optimization_barrier(jnp.asarray(n, jnp.int32)), body, carry)


def _spare(a, axis: int = 0):
    """a with one zero entry more along `axis`, which no loop visits (module docstring)."""
    return jnp.pad(a, [(0, int(i == axis)) for i in range(a.ndim)])


def rowwise(fn, lead: tuple, *arrays):
    """fn applied to tiles of `TILE` rows: arrays [*lead, ...] (a shared leading shape), each flattened to rows and
    padded to whole tiles; fn(*tiles [TILE, ...]) -> a pytree of [TILE, ...] -> that pytree as [*lead, ...]."""
    R = math.prod(lead)
    n = -(-R // TILE)
    flat = [_spare(jnp.pad(a.reshape(R, *a.shape[len(lead):]), [(0, n * TILE - R)] + [(0, 0)] * (a.ndim - len(lead))))
            for a in arrays]
    shapes = jax.eval_shape(fn, *(jax.ShapeDtypeStruct((TILE,) + f.shape[1:], f.dtype) for f in flat))
    out = jax.tree.map(lambda s: jnp.zeros((n * TILE,) + s.shape[1:], s.dtype), shapes)

    def body(i, out):  # fn between materialised values: it fuses the same way whatever the number of tiles
        ys = lax.optimization_barrier(fn(*lax.optimization_barrier(
            tuple(lax.dynamic_slice_in_dim(f, i * TILE, TILE) for f in flat))))
        return jax.tree.map(lambda o, y: lax.dynamic_update_slice_in_dim(o, y, i * TILE, 0), out, ys)

    return jax.tree.map(lambda o: o[:R].reshape(*lead, *o.shape[1:]), _loop(n, body, out))


def gdn_mixer(gdn, mixed, z, b, a, conv_in, ssm_in, lengths, saves=None):
    """The GDN layer from its input projection's parts (mixed [B, T, C], z [B, T, Hv * dv], b, a [B, T, Hv]) to the
    gated norm's output [B, T, Hv * dv], token by token: each row's tokens in order, each token's causal conv, gates,
    delta rule step and gated norm. conv_in [B, K-1, C] and ssm_in [B, Hv, dk, dv] are the rows' entering states;
    `saves` = (rows, offsets) [S] each: also the states after those tokens of those rows (any offset). Returns
    (o, conv_out, ssm_out, saved (conv [S, K-1, C], ssm [S, Hv, dk, dv]) or None)."""
    cfg = gdn.cfg
    B, T, C = mixed.shape
    nk, nv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    dtype = mixed.dtype
    w = gdn.conv1d[...].astype(_F32)  # [C, K]
    A, dt_bias = -jnp.exp(gdn.A_log[...]), gdn.dt_bias[...]
    sizes = [cfg.linear_key_dim, cfg.linear_key_dim, cfg.linear_value_dim]

    inputs = tuple(_spare(_spare(x), 1) for x in (mixed, z, b, a))  # a spare row and token

    def row(r, carry):
        out, conv_out, ssm_out, bufs = carry
        m_r, z_r, b_r, a_r = (lax.dynamic_index_in_dim(x, r, keepdims=False) for x in inputs)

        def token(t, carry):
            win, S, o_r, bufs = carry
            # the token's inputs, materialised: the arithmetic below then fuses the same way whatever T is
            m_t, z_t, b_t, a_t = lax.optimization_barrier(tuple(x[t] for x in (m_r, z_r, b_r, a_r)))
            xx = jnp.concatenate([win.astype(_F32), m_t[None].astype(_F32)])  # [K, C]
            acc = xx[0] * w[:, 0]
            for i in range(1, w.shape[1]):
                acc = acc + xx[i] * w[:, i]
            q, k, v = split_parts((acc * jax.nn.sigmoid(acc)).astype(dtype), sizes, cfg.layout_shards)
            q = jnp.repeat(l2norm(q.reshape(nk, dk)) * dk**-0.5, nv // nk, axis=0)
            k = jnp.repeat(l2norm(k.reshape(nk, dk)), nv // nk, axis=0)
            beta = jax.nn.sigmoid(b_t.astype(_F32))
            g = A * jax.nn.softplus(a_t.astype(_F32) + dt_bias)
            o, e, delta = token_step(S[None], q[None], k[None], v.reshape(1, nv, dv).astype(_F32), g[None],
                                     beta[None])
            S = new_state(S[None], e, k[None], delta)[0]
            o = gdn.norm(o[0].astype(dtype), z_t.reshape(nv, dv))
            o, S, win = lax.optimization_barrier((o, S, xx[1:].astype(win.dtype)))
            o_r = lax.dynamic_update_index_in_dim(o_r, o.reshape(-1), t, 0)
            if bufs is not None:  # the states after this token, where a save asks for them
                hit = (saves[0] == r) & (saves[1] == t + 1)

                def write(bufs):
                    i = jnp.argmax(hit)
                    return (lax.dynamic_update_index_in_dim(bufs[0], win, i, 0),
                            lax.dynamic_update_index_in_dim(bufs[1], S, i, 0))

                bufs = lax.cond(jnp.any(hit), write, lambda bufs: bufs, bufs)
            return win, S, o_r, bufs

        init = (lax.dynamic_index_in_dim(conv_spare, r, keepdims=False),
                lax.dynamic_index_in_dim(ssm_spare, r, keepdims=False), jnp.zeros((T, nv * dv), dtype), bufs)
        win, S, o_r, bufs = _loop(jnp.clip(lengths[r], 0, T), token, init)
        return (lax.dynamic_update_index_in_dim(out, o_r, r, 0), lax.dynamic_update_index_in_dim(conv_out, win, r, 0),
                lax.dynamic_update_index_in_dim(ssm_out, S, r, 0), bufs)

    bufs = None
    if saves is not None:
        S_ = saves[0].shape[0]
        bufs = (jnp.zeros((S_,) + conv_in.shape[1:], conv_in.dtype), jnp.zeros((S_, nv, dk, dv), _F32))
    ssm_in = ssm_in.astype(_F32)
    conv_spare, ssm_spare = _spare(conv_in), _spare(ssm_in)
    out = jnp.zeros((B, T, nv * dv), dtype)
    out, conv_out, ssm_out, bufs = _loop(B, row, (out, conv_in, ssm_in, bufs))
    return out, conv_out, ssm_out, bufs


def attend(cfg, q, k_cache, v_cache, layer, positions, block_tables):
    """Attention of queries q [B, T, H, hd] at `positions` [B, T] over the cached keys (causal) -> [B, T, H * hd] in
    q's dtype: per row, per block of `TILE` query tokens, over chunks of `KV_KEYS` keys from key 0, as many as the
    block's last query reaches (the chunks beyond a query's own reach leave it as it was: `key_chunk`)."""
    B, T, H, hd = q.shape
    kvh = cfg.num_key_value_heads
    g = H // kvh
    cb = max(1, KV_KEYS // k_cache.shape[3])  # blocks per chunk
    keys = cb * k_cache.shape[3]
    nb = -(-T // TILE)
    q = jnp.pad(q, ((0, 0), (0, nb * TILE - T), (0, 0), (0, 0)))
    pos = positions[:, :1] + jnp.arange(nb * TILE)[None, :]  # the padding queries continue the row's positions
    qh = q.reshape(B, nb, TILE, kvh, g, hd).transpose(0, 1, 3, 4, 2, 5).reshape(B, nb, kvh, g * TILE, hd)
    qpos = jnp.tile(pos.reshape(B, nb, 1, TILE), (1, 1, g, 1)).reshape(B, nb, g * TILE)
    tables = jnp.pad(block_tables, ((0, 0), (0, -block_tables.shape[1] % cb)))
    chunks = tables.shape[1] // cb
    tables, qh, qpos = _spare(jnp.pad(tables, ((0, 0), (0, cb)))), _spare(_spare(qh), 1), _spare(_spare(qpos), 1)

    def block(r, i):
        qb, pb = qh[r, i], qpos[r, i]
        n = jnp.clip(jnp.max(pb) // keys + 1, 1, chunks)
        step = partial(key_chunk, qb, pb, tables[r], k_cache, v_cache, layer, cb, DETERMINISTIC)
        _, total, acc = _loop(n, step, online_softmax_init(qb))
        return acc / total[..., None]

    def rows(r, out):
        return _loop(nb, lambda i, out: out.at[r, i].set(block(r, i)), out)

    out = _loop(B, rows, jnp.zeros((B, nb, kvh, g * TILE, hd), _F32))
    out = out.astype(q.dtype).reshape(B, nb, kvh, g, TILE, hd).transpose(0, 1, 4, 2, 3, 5)
    return out.reshape(B, nb * TILE, H * hd)[:, :T]


def forward(model, batch: Batch, state: DeviceState, all_logits: bool, forms: Forms):
    """`Qwen35Model.__call__` in the deterministic forms: (logits [B, V] or [B, T, V] float32, new state)."""
    cfg = model.cfg
    B, T = batch.tokens.shape
    lead = (B, T)
    x = model.embed_tokens[...][batch.tokens]
    warm, ids = batch.has_initial_state, batch.linear_state_ids
    src = ids if batch.initial_state_ids is None else batch.initial_state_ids
    valid = jnp.arange(T)[None, :] < batch.lengths[:, None]

    def residual(layer, x, h):
        return rowwise(lambda x, h, v: layer.residual(x, h, forms, v), lead, x, h, valid)

    def linear(layer, j, carry):
        x, st = carry
        gdn = layer.linear_attn
        mixed, z, b, a = rowwise(lambda x: gdn.in_proj(layer.input_layernorm(x), forms), lead, x)
        conv_in = jnp.where(warm[:, None, None], from_pool(read_slots(st.conv, src, j), x.dtype), 0)
        ssm_in = jnp.where(warm[:, None, None, None], read_slots(st.ssm, src, j), 0.0)
        saves = None if batch.save_slots is None else (batch.save_rows, batch.save_offsets)
        o, conv_out, ssm_out, saved = gdn_mixer(gdn, mixed, z, b, a, conv_in, ssm_in, batch.lengths, saves)
        slots = ids
        if saved is not None:
            slots = jnp.concatenate([ids, batch.save_slots])
            conv_out, ssm_out = jnp.concatenate([conv_out, saved[0]]), jnp.concatenate([ssm_out, saved[1]])
        h = rowwise(lambda o: gdn.out_proj(o, forms), lead, o)
        st = dataclasses.replace(st, conv=write_rows(st.conv, (layer_ids(j, slots), slots), conv_out),
                                 ssm=write_rows(st.ssm, (layer_ids(j, slots), slots), ssm_out))
        return residual(layer, x, h), st

    def full(layer, j, carry):
        x, st = carry
        attn = layer.self_attn

        def project(x, p):  # [TILE, D], [TILE] -> q, gate, k, v of those tokens
            return [y[:, 0] for y in attn.project(layer.input_layernorm(x)[:, None], p[:, None], forms)]

        q, k, v, gate = rowwise(project, lead, x, batch.positions)
        kc, vc = write_kv(st.k, st.v, k, v, batch.slot_mapping, j)
        out = attend(cfg, q, kc, vc, j, batch.positions, batch.block_tables)
        h = rowwise(lambda o, g: attn.gated_output(o, g, forms), lead, out, gate)
        return residual(layer, x, h), dataclasses.replace(st, k=kc, v=vc)

    x, state = model.scan_layers((x, state), linear, full)
    if not all_logits:  # the hidden state of each row's last real token
        last = jnp.maximum(batch.lengths - 1, 0)
        x = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
        lead = (B,)
    return rowwise(lambda x: model.logits(x, forms), lead, x), state

