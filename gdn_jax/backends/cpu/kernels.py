"""Compiled kernels for XLA's CPU backend: for one-token steps the GDN decode update (`gdn_decode`, source
csrc/gdn_decode.cc), decode attention (`attention_decode`, csrc/attention_decode.cc) and few-row bfloat16 products
(`rows_product`, csrc/rows_product.cc; used where `tuning.rows_kernel_rows` measured it faster); for prefill steps the
GDN rule over the step's tokens (`gdn_prefill`, csrc/gdn_prefill.cc).

XLA compiles a one-token step's GDN update (`qwen35.advance_in_pool`) to a gathered copy of each row's state, a
product, and an in-place write that runs on one thread, several times slower than this kernel
(`scripts/bench/bench_kernel_ceiling.py`; docs/benchmarks.md). The kernel reads each state
once for its products with k and q and writes the new one once, sharing the (row, head) pairs among XLA's CPU
threads (an XLA FFI custom call, the pool aliased to its result: updated in place, as before). XLA's form of decode
attention copies each chunk of a row's paged keys and values into a contiguous block before its two products; the
attention kernel reads every key and value row once where it lies, for all the query heads of its KV head, with an
online softmax in float32. XLA's bfloat16 products of 2-16 rows stream the weights at about half the speed of one
row on a CPU without matrix units; the product kernel reads each weight row once for all the rows, with the CPU's
bfloat16 dot-product instruction where it has one. XLA's form of a prefill step's rule is the chunked one
(`gated_delta.chunk_gated_delta_rule`), a chain of small products and loops one chunk after the other; the prefill
kernel runs the rule token by token with each (row, head) state in the core's cache, one pass over it per token for
the update and the next token's products, the (row, head) pairs shared among the threads (docs/design.md, "The GDN
rule of prefill steps as a compiled CPU kernel").

They are built, one library, on first use by the system's C++ compiler (`c++`, `g++` or `clang++`, or `$CXX`)
against the FFI headers jaxlib ships, `-O3 -march=native`, into `kernels/` beside JAX's persistent compilation cache
(else a per-user folder under the system's temporary folder), one file per set of sources, jaxlib version, compiler
and CPU (`library.host_cpu`; each source compiled in a process of its own, side by side, then linked), written
under a temporary name and renamed, so that processes building at once do not collide; later processes load it
(`library.available`). `KERNELS_ENV`: "0" never uses them, "1" requires them (an error names what failed), unset uses
them when they build, and otherwise runs XLA's forms after one RuntimeWarning that says why. Whether a step uses them
is its `Forms.kernels`, resolved once at engine start (`tuning.resolve_forms`), never while tracing. Either way the
values agree to float32 rounding (in bfloat16, attention's to the rounding of XLA's probabilities to bfloat16;
tests/gdn_jax/test_cpu_kernels.py); the executable store keeps the two apart (the forms are part of its key).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gdn_jax.backends.cpu.library import ATTENTION_TARGET, MAX_DIM, MAX_GROUP, PREFILL_TARGET, ROWS_TARGET, TARGET
from gdn_jax.model.forms import Forms
from gdn_jax.model.gated_delta import _inert, _valid_mask


def applies(pool, forms: Forms) -> bool:
    """Whether `gdn_decode` updates this pool: a float32 [layers, slots, H, D, D] pool (D <= MAX_DIM), with the
    kernels in the forms."""
    return (forms.kernels and pool.dtype == jnp.float32 and pool.ndim == 5
            and pool.shape[-1] == pool.shape[-2] <= MAX_DIM)


def gdn_decode(pool, src, live, warm, lengths, q, k, v, g, beta, layer):
    """`qwen35.advance_in_pool` by the kernel: (o [B, 1, H, dv] in v's dtype, the pool updated in place). Padding
    rows (`lengths` 0) are made inert first, as `gated_delta.decode_token` does: their new state is their old one."""
    B = q.shape[0]
    out_dtype = v.dtype
    q, k, v, g, beta = (a[:, 0] for a in _inert(_valid_mask(B, 1, lengths), q, k, v, g, beta))
    call = jax.ffi.ffi_call(TARGET, (jax.ShapeDtypeStruct(pool.shape, pool.dtype),
                                     jax.ShapeDtypeStruct(v.shape, jnp.float32)), input_output_aliases={0: 0})
    pool, o = call(pool, jnp.asarray(layer, jnp.int32).reshape(1), src.astype(jnp.int32), live.astype(jnp.int32),
                   warm.astype(jnp.bool_), q, k, v, g, beta)  # (`_inert` made q, k, v, g, beta float32)
    return o[:, None].astype(out_dtype), pool


def prefill_applies(k, v, forms: Forms) -> bool:
    """Whether `gdn_prefill` runs the rule for keys k [B, T, Hk, dk] and values v [B, T, H, dv]: dk = dv <= MAX_DIM,
    Hk dividing H, with the kernels in the forms."""
    return (forms.kernels and k.ndim == v.ndim == 4 and k.shape[:2] == v.shape[:2]
            and k.shape[-1] == v.shape[-1] <= MAX_DIM and v.shape[2] % k.shape[2] == 0)


def gdn_prefill(q, k, v, g, beta, initial_state, lengths, saves=None):
    """The gated delta rule over a prefill step's tokens by the kernel, token by token: q, k [B, T, Hk, D] (normed;
    value head h reads key head h // (H / Hk), as `jnp.repeat` would expand them), v [B, T, H, D], g, beta
    [B, T, H]; initial_state [B, H, D, D]; lengths [B] (None: every token is real) -> (o [B, T, H, D] in v's dtype,
    the final states float32 [B, H, D, D]), and with `saves` = (rows, counts) [S] each, also the states of those
    rows after that many of their tokens, [S, H, D, D]. The same inputs and outputs as
    `gated_delta.chunk_gated_delta_rule` (with its chunk-end saves given as token counts). Only where
    `prefill_applies` said so: that registers the kernel with XLA."""
    B, T, H, D = v.shape
    out_dtype = v.dtype
    lengths = jnp.full((B,), T, jnp.int32) if lengths is None else jnp.asarray(lengths).astype(jnp.int32)
    rows, counts = (jnp.zeros((0,), jnp.int32),) * 2 if saves is None else (a.astype(jnp.int32) for a in saves)
    f32 = jax.ShapeDtypeStruct
    call = jax.ffi.ffi_call(PREFILL_TARGET, (f32(v.shape, jnp.float32), f32((B, H, D, D), jnp.float32),
                                             f32((rows.shape[0], H, D, D), jnp.float32)))
    o, state, saved = call(*(a.astype(jnp.float32) for a in (q, k, v, g, beta, initial_state)), lengths, rows, counts)
    o = o.astype(out_dtype)
    return (o, state) if saves is None else (o, state, saved)


def attention_applies(k_cache, heads: int, forms: Forms) -> bool:
    """Whether `attention_decode` runs a one-token step's attention over this paged cache ([kv_heads, layers, blocks,
    block_size, D], uint16 bfloat16 bits or float32) for `heads` query heads: within the kernel's limits (D at most
    MAX_DIM, at most MAX_GROUP query heads per KV head), with the kernels in the forms."""
    if not forms.kernels or k_cache.ndim != 5 or k_cache.dtype not in (jnp.uint16, jnp.float32):
        return False
    kvh, hd = k_cache.shape[0], k_cache.shape[4]
    return hd <= MAX_DIM and heads % kvh == 0 and heads // kvh <= MAX_GROUP


def attention_decode(k_cache, v_cache, layer, q, block_tables, keys):
    """A one-token step's attention by the kernel: q [B, H, D] (normed, rotated) against each row's first `keys` [B]
    positions, its blocks `block_tables` [B, width] of this layer's paged caches -> [B, H, D] float32. Only where
    `attention_applies` said so: that registers the kernel with XLA."""
    call = jax.ffi.ffi_call(ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(k_cache, v_cache, jnp.asarray(layer, jnp.int32).reshape(1), q.astype(jnp.float32),
                block_tables.astype(jnp.int32), keys.astype(jnp.int32))


def rows_product(x, kernel):
    """x [m, n_in] @ kernel[n_out, n_in].T -> [m, n_out] float32, x and kernel both bfloat16 or both float32, by the
    few-row product kernel (float32 products and sums; a row's result depends only on whether its batch has 2-8 rows
    or 9-16, the kernel's two forms, not on the other rows). Only with `Forms.kernels`, which `library.available()`
    (it registers the kernel with XLA) decided."""
    return jax.ffi.ffi_call(ROWS_TARGET, jax.ShapeDtypeStruct((x.shape[0], kernel.shape[0]), jnp.float32))(x, kernel)
