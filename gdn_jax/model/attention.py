"""Gated full attention over the paged KV cache, with partial NeoX RoPE."""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdn_jax.backends.cpu import kernels as cpu_kernels
from gdn_jax.backends.gpu import paged_attention
from gdn_jax.config import ModelConfig
from gdn_jax.model.state import Batch, from_pool, layer_ids, write_rows
from gdn_jax.model.dense import float32_precision
from gdn_jax.model.forms import GENERIC, Forms
from gdn_jax.model.layers import RMSNorm, _fused, _linear


KV_CHUNK_KEYS = 256


def kv_chunk_keys(tokens: int, forms: Forms) -> int:
    """Keys one iteration of the attention loop reads per row, in a step of `tokens` tokens per row: KV_CHUNK_KEYS, or
    for a prefill step `forms.prefill_kv_chunk_keys` where set (rounded down to whole KV blocks, at least one).
    Larger chunks mean larger query tiles (`query_tiles`) and fewer iterations: XLA's GPU runtime (outside command
    buffers) runs every iteration of a loop whose trip count is known only on the device (the key chunks: as many as
    the rows hold) by copying its condition to the host and waiting for it, so a long prefill at 256 keys runs
    hundreds of such iterations per attention layer, at 2048 a few, at the price of computing the masked part of
    each tile's last chunks. The same attention either way, up to the online softmax's rounding
    (tests/gdn_jax/test_model.py); not the default anywhere until measured on a GPU."""
    if tokens > 1 and forms.prefill_kv_chunk_keys is not None:
        return forms.prefill_kv_chunk_keys
    return KV_CHUNK_KEYS


# With the CPU forms, a query tile of at most this many queries per KV head (g * Tq) has its scores multiplied with
# the keys on the left (`attention_scores`).
KEYS_LEFT_QUERIES = 16


def attention_scores(qh, keys, forms: Forms):
    """qh [kvh, n, hd] @ keys [kvh, S, hd] -> scores [kvh, n, S], accumulated in float32.

    With the CPU forms a few queries (n <= `KEYS_LEFT_QUERIES`: a decode step's, a short chunk's) multiply as
    keys @ qh.T, the keys on the left, and the small [kvh, S, n] result is transposed: XLA's CPU library streams the
    keys as the left operand of a batched product faster than it packs them as a transposed right one. The gain
    shrinks as n grows, and turns into a loss at a few heads of 32 queries. The values are the same products summed
    in float32 over hd. The optimisation barrier keeps XLA from folding the transpose back into the product.
    docs/design.md, "Decode attention at long context"; figures in docs/benchmarks.md."""
    kw = dict(preferred_element_type=jnp.float32, precision=float32_precision(qh.dtype))
    if forms.cpu and qh.shape[-2] <= KEYS_LEFT_QUERIES:
        return jax.lax.optimization_barrier(jnp.einsum("ksd,kqd->ksq", keys, qh, **kw)).transpose(0, 2, 1)
    return jnp.einsum("kqd,ksd->kqs", qh, keys, **kw)


def query_tiles(T: int, keys_per_chunk: int) -> int:
    """How many tiles of queries the attention of a T-token chunk runs one after the other: the most tiles of at least
    `keys_per_chunk` queries that divide T (1 for a decode step). A tile reads only the key chunks up to its own last
    query, so a long prefill skips most of the upper (masked) triangle of its scores: at 2048 tokens and 256 keys per
    chunk, 36 of the 64 (tile, chunk) pairs."""
    n = max(1, T // keys_per_chunk)
    while T % n:
        n -= 1
    return n


# Working set of one iteration of the loops over a batch's rows that run on CPU (`rows_per_iteration`).
CPU_ROWS_BYTES = {"attention": 4 << 20, "gdn_decode": 2 << 20}


def rows_per_iteration(rows: int, bytes_per_row: int, kind: str, forms: Forms) -> int:
    """How many of `rows` rows one iteration of a loop over them handles: with the CPU forms the largest power of two
    dividing `rows` whose working set fits CPU_ROWS_BYTES[kind] (at least 1), else all of them. On CPU a few rows at
    a time keep their gathered state in cache and the step's temporaries small: tens of MB of temporaries are
    mapped fresh by glibc, and zero-filled by the kernel, on every step."""
    if not forms.cpu:
        return rows
    return math.gcd(rows, 1 << max(0, (CPU_ROWS_BYTES[kind] // bytes_per_row).bit_length() - 1))



def rope(x, positions, rotary_dim: int, theta: float):
    """Partial NeoX RoPE on the first `rotary_dim` dims. x: [B, T, H, hd]; positions: [B, T]."""
    inv_freq = 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float32) / rotary_dim))
    freqs = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, r/2]
    cos = jnp.concatenate([jnp.cos(freqs)] * 2, -1)[:, :, None, :].astype(x.dtype)
    sin = jnp.concatenate([jnp.sin(freqs)] * 2, -1)[:, :, None, :].astype(x.dtype)
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    x1, x2 = jnp.split(x_rot, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return jnp.concatenate([x_rot * cos + rotated * sin, x_pass], axis=-1)


def write_kv(k_cache, v_cache, k, v, slot_mapping, layer):
    """The caches with keys and values k, v [B, T, kvh, hd] written at their flat KV slots `slot_mapping` [B, T] of
    layer `layer`."""
    bs = k_cache.shape[3]
    flat = slot_mapping.reshape(-1)
    at = (layer_ids(layer, flat), flat // bs, flat % bs)  # (layer, block, offset) per token
    return (write_rows(k_cache, at, k.reshape(flat.shape[0], *k.shape[2:]), axis=1),
            write_rows(v_cache, at, v.reshape(flat.shape[0], *v.shape[2:]), axis=1))


def online_softmax_init(qh):
    """The online softmax's carry before the first key chunk, for queries qh [kvh, n, hd]: (running max, sum of
    exponentials, output), float32."""
    return (jnp.full(qh.shape[:2], -jnp.inf, jnp.float32), jnp.zeros(qh.shape[:2], jnp.float32),
            jnp.zeros(qh.shape, jnp.float32))


def key_chunk(qh, qpos, table, k_cache, v_cache, layer, cb: int, forms: Forms, c, carry):
    """One turn of the online softmax: queries qh [kvh, n, hd] at positions qpos [n] over the keys of chunk c of a
    row's block table `table` (cb blocks, keys [c * cb * bs, (c + 1) * cb * bs)), causal. carry: (running max
    [kvh, n], sum of exponentials [kvh, n], output [kvh, n, hd]). A chunk no query sees leaves the carry exactly as it
    was (its scores are all -inf: a scale of exp(0) = 1 and zero terms), which the deterministic forward relies on."""
    kvh, _, hd = qh.shape
    bs, dtype = k_cache.shape[3], qh.dtype
    top, total, acc = carry
    blocks = jax.lax.dynamic_slice_in_dim(table, c * cb, cb)
    keys = from_pool(k_cache[:, layer, blocks], dtype).reshape(kvh, cb * bs, hd)
    values = from_pool(v_cache[:, layer, blocks], dtype).reshape(kvh, cb * bs, hd)
    scores = attention_scores(qh, keys, forms) * hd**-0.5
    causal = c * cb * bs + jnp.arange(cb * bs)[None, :] <= qpos[:, None]  # [n, cb * bs]
    scores = jnp.where(causal[None], scores, -jnp.inf)
    new_top = jnp.maximum(top, jnp.max(scores, axis=-1))  # finite: key 0 is in every query's reach
    p = jnp.exp(scores - new_top[..., None])
    scale = jnp.exp(top - new_top)
    pv = jnp.einsum("kqs,ksd->kqd", p.astype(dtype), values, preferred_element_type=jnp.float32,
                    precision=float32_precision(dtype))
    return new_top, total * scale + jnp.sum(p, axis=-1), acc * scale[..., None] + pv


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs, std):
        self.cfg = cfg
        H, hd = cfg.num_attention_heads, cfg.head_dim
        self.qkv_proj = _fused(rngs, cfg, "self_attn", "qkv_proj", dtype, std)  # [q (per head query | gate) | k | v]
        self.o_proj = _linear(rngs, H * hd, cfg.hidden_size, dtype, std)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype)

    def project(self, x, positions, forms: Forms = GENERIC):
        """x: [B, T, D], positions: [B, T] -> q [B, T, H, hd], k and v [B, T, kvh, hd] (normed, rotated), and the
        output gate [B, T, H * hd]: the projections of `__call__`, for the dense training path (gdn_jax/train.py)."""
        cfg = self.cfg
        B, T, _ = x.shape
        H, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qg, k, v = self.qkv_proj(x, forms)
        qg = qg.reshape(B, T, H, 2 * hd)
        q, gate = self.q_norm(qg[..., :hd]), qg[..., hd:].reshape(B, T, H * hd)
        k = self.k_norm(k.reshape(B, T, kvh, hd))
        v = v.reshape(B, T, kvh, hd)
        q = rope(q, positions, cfg.rotary_dim, cfg.rope_theta)
        k = rope(k, positions, cfg.rotary_dim, cfg.rope_theta)
        return q, k, v, gate

    def __call__(self, x, k_cache, v_cache, batch: Batch, layer, forms: Forms = GENERIC):
        """x: [B, T, D]; caches: [kvh, layers, NB, bs, hd] paged, of which this layer's is [:, layer]
        -> (out, k_cache, v_cache): `project_write`, then `attend` over each row's keys up to its last token."""
        q, gate, k_cache, v_cache = self.project_write(x, k_cache, v_cache, batch, layer, forms)
        out = self.attend(q, gate, k_cache, v_cache, layer, batch.positions, batch.block_tables,
                          batch.start_pos + batch.lengths, forms)
        return out, k_cache, v_cache

    def project_write(self, x, k_cache, v_cache, batch: Batch, layer, forms: Forms):
        """x: [B, T, D] -> (q [B, T, H, hd] normed and rotated, output gate [B, T, H * hd], caches with the chunk's
        keys and values written)."""
        cfg = self.cfg
        B, T, _ = x.shape
        H, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qg, k, v = self.qkv_proj(x, forms)
        qg = qg.reshape(B, T, H, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(B, T, H * hd)
        q = self.q_norm(q)
        k = self.k_norm(k.reshape(B, T, kvh, hd))
        v = v.reshape(B, T, kvh, hd)
        q = rope(q, batch.positions, cfg.rotary_dim, cfg.rope_theta)
        k = rope(k, batch.positions, cfg.rotary_dim, cfg.rope_theta)
        return (q, gate, *write_kv(k_cache, v_cache, k, v, batch.slot_mapping, layer))

    def attend(self, q, gate, k_cache, v_cache, layer, positions, block_tables, extent, forms: Forms,
               by_position: bool = False):
        """The attention output [B, T, D] of queries q [B, T, H, hd] at `positions` [B, T] over the cached keys
        (causal: a query sees the keys at its position and before), through the output gate and projection
        (`attend_heads`, then `gated_output`)."""
        out = self.attend_heads(q, k_cache, v_cache, layer, positions, block_tables, extent, forms, by_position)
        return self.gated_output(out, gate, forms)

    def attend_heads(self, q, k_cache, v_cache, layer, positions, block_tables, extent, forms: Forms,
                     by_position: bool = False):
        """The heads' attention outputs [B, T, H * hd] (q's dtype) of queries q [B, T, H, hd] at `positions` [B, T]
        over the cached keys, causal. `extent` [B]: the keys a row's queries reach at most (start + length), which
        bounds the chunks read.

        Each row attends to its keys in chunks of `kv_chunk_keys(T, forms)` (an online softmax), as many chunks as the
        longest row of the batch needs: the block tables' width (padding blocks) costs nothing. A long chunk's
        queries go in tiles (`query_tiles`), each over the key chunks up to its last query only. The caches are
        head-major so that a row's gathered keys, [kvh, S, hd], have the matmuls' batch axis (kv head) in front: the
        products read them as they are gathered, with no transposed copy. One query per row runs the compiled CPU
        kernel instead (`cpu_kernels.attention_decode`: the keys and values read in place, no gathered copy) where
        the forms have the kernels, and on a GPU the paged kernel with `Forms.paged_decode` (`paged_attention`: no
        loop whose trip count only the device knows). `by_position` (a verify step's few positions): each query as a row of its own,
        over the keys up to its position, as a one-token step attends."""
        cfg = self.cfg
        B, T = q.shape[:2]
        H, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        dtype = q.dtype
        if by_position and T > 1:  # (padding positions: their keys up to the row's last, at least one)
            keys = jnp.maximum(jnp.minimum(positions + 1, extent[:, None]), 1).reshape(B * T, 1)
            out = self.attend_heads(q.reshape(B * T, 1, H, hd), k_cache, v_cache, layer, keys - 1,
                                    jnp.repeat(block_tables, T, axis=0), keys[:, 0], forms)
            return out.reshape(B, T, H * hd)
        if T == 1 and cpu_kernels.attention_applies(k_cache, H, forms):  # one query per row: the compiled kernel
            out = cpu_kernels.attention_decode(k_cache, v_cache, layer, q[:, 0], block_tables, positions[:, 0] + 1)
            return out.astype(dtype).reshape(B, T, H * hd)
        if T == 1 and paged_attention.applies(k_cache, H, forms):  # one query per row on a GPU: the paged kernel
            out = paged_attention.paged_decode(k_cache, v_cache, layer, q[:, 0], block_tables, positions[:, 0] + 1,
                                               interpret=forms.paged_decode == "interpret")
            return out.astype(dtype).reshape(B, T, H * hd)
        bs = k_cache.shape[3]
        g = H // kvh  # per (row, kv head) one matmul over its g * Tq queries
        NB = block_tables.shape[1]
        cb = max(1, min(NB, kv_chunk_keys(T, forms) // bs))  # blocks per chunk
        keys_per_chunk = cb * bs
        nq = query_tiles(T, keys_per_chunk)
        Tq = T // nq
        # [B, T, kvh, g, hd] -> [nq, B, kvh, g * Tq, hd]: a tile's queries of one kv head in one matrix
        qh = q.reshape(B, nq, Tq, kvh, g, hd).transpose(1, 0, 3, 4, 2, 5).reshape(nq, B, kvh, g * Tq, hd)
        qpos = jnp.tile(positions.reshape(B, nq, Tq).transpose(1, 0, 2), (1, 1, g))  # [nq, B, g * Tq]
        tables = jnp.pad(block_tables, ((0, 0), (0, -NB % cb)))  # whole chunks (padding block 0)
        chunks = jnp.clip(-(-jnp.max(extent) // keys_per_chunk), 1, tables.shape[1] // cb)
        # the chunks query tile i reaches: its last query is at most at max(first position) + (i + 1) * Tq - 1
        reach = -(-(jnp.max(positions[:, 0]) + Tq * jnp.arange(1, nq + 1)) // keys_per_chunk)
        tile_chunks = jnp.clip(reach, 1, chunks)  # [nq]

        def attend(qh, table, qpos, n):  # one row: [kvh, gTq, hd], [NB], [gTq], n chunks -> [kvh, gTq, hd] float32
            step = partial(key_chunk, qh, qpos, table, k_cache, v_cache, layer, cb, forms)
            _, total, acc = jax.lax.fori_loop(0, n, step, online_softmax_init(qh))
            return acc / total[..., None]

        per_row = 2 * kvh * cb * bs * hd * jnp.dtype(dtype).itemsize  # the keys + values of one chunk
        rows = rows_per_iteration(B, per_row, "attention", forms)

        def tile(a):  # one query tile of every row; its chunk count is the same for all rows (a loop, not a mask)
            qt, pt, n = a
            if rows == B and not forms.cpu:  # every row at once: no loop of one turn around them
                return jax.vmap(lambda *r: attend(*r, n))(qt, tables, pt)
            return jax.lax.map(lambda r: attend(*r, n), (qt, tables, pt), batch_size=rows)

        if nq == 1:  # a decode step, a short chunk: no loop over tiles
            out = tile((qh[0], qpos[0], tile_chunks[0]))[None]
        else:
            out = jax.lax.map(tile, (qh, qpos, tile_chunks))  # [nq, B, kvh, g * Tq, hd]
        return out.astype(dtype).reshape(nq, B, kvh, g, Tq, hd).transpose(1, 0, 4, 2, 3, 5).reshape(B, T, H * hd)

    def gated_output(self, out, gate, forms: Forms = GENERIC):
        """The heads' outputs [B, T, H * hd] through the output gate and the output projection."""
        return self.o_proj(out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(out.dtype), forms)
