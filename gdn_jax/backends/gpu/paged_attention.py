"""A one-token step's attention on a GPU: a Pallas kernel (Triton backend) that reads each row's own KV blocks, in
place in the paged pools, with no loop left to XLA.

XLA's form (`Attention.attend_heads`) gathers a row's keys chunk by chunk in a while loop whose trip count only the
device knows, one per attention layer, and XLA's GPU runtime copies such a loop's condition to the host and waits
for it on every iteration. Here one program per (row, KV head) walks the row's blocks in a loop inside the kernel,
with an online softmax over them; its queries are the group of query heads that share the KV head, padded to
`MIN_ROWS` rows for the products. On the CPU the same kernel runs in Pallas' interpret mode (the tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gdn_jax.model.forms import Forms

MIN_ROWS = 16  # the smallest side of a product in the Triton backend: the query group is padded to it
NUM_WARPS = 4


def _power_of_two(n: int) -> bool:
    return n >= MIN_ROWS and n & (n - 1) == 0


def applies(k_cache, heads: int, forms: Forms) -> bool:
    """Whether `paged_decode` runs a one-token step's attention over this cache ([kv_heads, layers, blocks,
    block_size, D]) for `heads` query heads: with `Forms.paged_decode` on, a block size and D that are powers of two
    of at least `MIN_ROWS` (the Triton backend's tensor shapes), and whole groups of query heads."""
    if forms.paged_decode == "off" or k_cache is None or k_cache.ndim != 5:
        return False
    kvh, bs, hd = k_cache.shape[0], k_cache.shape[3], k_cache.shape[4]
    return _power_of_two(bs) and _power_of_two(hd) and heads % kvh == 0


def _kernel(layer_ref, keys_ref, q_ref, table_ref, k_ref, v_ref, o_ref, *, block_size: int):
    """One (row, KV head): queries q_ref [G, D] over the row's first keys_ref[0] keys, block by block of its table."""
    q = q_ref[...]
    layer, n = layer_ref[0], keys_ref[0]
    G, hd = q.shape
    dtype = q.dtype
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    dims = (((1,), (1,)), ((), ()))  # q [G, D] . k [bs, D] over D

    def block(i, carry):
        top, total, acc = carry
        page = table_ref[i]
        k, v = k_ref[layer, page], v_ref[layer, page]  # [bs, D] each
        if k.dtype == jnp.uint16:  # a 16-bit pool holds its values' bit patterns (`state.pool_dtype`)
            k, v = jax.lax.bitcast_convert_type(k, dtype), jax.lax.bitcast_convert_type(v, dtype)
        s = jax.lax.dot_general(q, k.astype(dtype), dims, precision=precision,
                                preferred_element_type=jnp.float32) * hd**-0.5
        s = jnp.where((i * block_size + jnp.arange(block_size))[None, :] < n, s, -jnp.inf)
        new_top = jnp.maximum(top, jnp.max(s, axis=1))  # finite: key 0 is in every query's reach
        p = jnp.exp(s - new_top[:, None])
        scale = jnp.exp(top - new_top)
        pv = jax.lax.dot_general(p.astype(dtype), v.astype(dtype), (((1,), (0,)), ((), ())), precision=precision,
                                 preferred_element_type=jnp.float32)
        return new_top, total * scale + jnp.sum(p, axis=1), acc * scale[:, None] + pv

    init = (jnp.full((G,), -jnp.inf, jnp.float32), jnp.zeros((G,), jnp.float32), jnp.zeros((G, hd), jnp.float32))
    _, total, acc = jax.lax.fori_loop(0, (n + block_size - 1) // block_size, block, init)
    o_ref[...] = acc / total[:, None]


@functools.partial(jax.jit, static_argnames=("interpret",))
def paged_decode(k_cache, v_cache, layer, q, block_tables, keys, interpret: bool):
    """q [B, H, D] (normed, rotated; the activation dtype) against each row's first `keys` [B] positions, its blocks
    `block_tables` [B, width] of layer `layer` of the paged caches -> [B, H, D] float32. Only where `applies` said so.
    `interpret`: in Pallas' interpreter (any backend; `Forms.paged_decode == "interpret"`), else the Triton kernel,
    which only a GPU runs (or a lowering for one)."""
    from jax.experimental import pallas as pl  # (here: an engine that never runs the kernel does not import Pallas)
    from jax.experimental.pallas import triton as plgpu

    B, H, hd = q.shape
    kvh, L, NP, bs, _ = k_cache.shape
    g = H // kvh
    G = max(MIN_ROWS, 1 << (g - 1).bit_length())
    width = max(1, 1 << (block_tables.shape[1] - 1).bit_length())  # (a power of two: the table's block)
    qh = jnp.pad(q.reshape(B, kvh, g, hd), ((0, 0), (0, 0), (0, G - g), (0, 0)))
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, width - block_tables.shape[1])))
    pool = pl.BlockSpec((None, L, NP, bs, hd), lambda b, h: (h, 0, 0, 0, 0))
    out = pl.pallas_call(
        functools.partial(_kernel, block_size=bs),
        grid=(B, kvh),
        in_specs=[pl.BlockSpec((1,), lambda b, h: (0,)),                       # layer
                  pl.BlockSpec((1,), lambda b, h: (b,)),                       # keys
                  pl.BlockSpec((None, None, G, hd), lambda b, h: (b, h, 0, 0)),  # queries
                  pl.BlockSpec((None, width), lambda b, h: (b, 0)),            # block table
                  pool, pool],
        out_specs=pl.BlockSpec((None, None, G, hd), lambda b, h: (b, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((B, kvh, G, hd), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=2),
        interpret=interpret,
        name="gdn_jax_paged_decode",
    )(jnp.asarray(layer, jnp.int32).reshape(1), keys.astype(jnp.int32), qh, tables, k_cache, v_cache)
    return out[:, :, :g].reshape(B, H, hd)
