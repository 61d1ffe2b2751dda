"""Qwen3.5 hybrid model (Gated DeltaNet + gated full attention) as Flax NNX modules.

The modules hold parameters only. The recurrent and KV state lives outside them in `DeviceState`, so a jitted
step can take it as a donated argument: `forward(graphdef, params, batch, state) -> (logits, state)`.

Donation holds (XLA updates the pools in place and never copies one) as long as, within a step, every read of a
pool's old contents is ordered before its write by data dependence. So a KV pool is written first and read after
(attention reads the updated pool), and a GDN pool is read by one gather whose result feeds the write (see
`read_slots`); scatters promise in-bounds indices (the host validates them), since an out-of-bounds check reads
the pool too. `tests/gdn_jax/test_donation.py` checks every compiled step shape.

Batch layout: `B` rows (sequences), `T` tokens per row (a prefill chunk, or 1 for decode), rows right-padded.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdn_jax import cpu_kernels
from gdn_jax.config import FULL, LINEAR, ModelConfig
from gdn_jax.gated_delta import (causal_conv1d, chunk_gated_delta_rule, decode_token, default_chunk_size, l2norm,
                                 new_state, recurrent_gated_delta_rule)


@partial(jax.tree_util.register_dataclass, data_fields=[
    "tokens", "start_pos", "lengths", "block_tables", "slot_mapping", "linear_state_ids", "has_initial_state",
    "initial_state_ids", "save_rows", "save_offsets", "save_slots",
], meta_fields=[])
@dataclasses.dataclass
class Batch:
    tokens: jax.Array             # [B, T] int32
    start_pos: jax.Array          # [B] int32, absolute position of tokens[:, 0]
    lengths: jax.Array            # [B] int32, real tokens per row (0 for a padding row)
    block_tables: jax.Array       # [B, NB] int32 KV block ids (0 = padding block)
    slot_mapping: jax.Array       # [B, T] int32 flat KV slot per token (padding tokens -> block 0)
    linear_state_ids: jax.Array   # [B] int32 live linear-state slot per row (0 = padding slot)
    has_initial_state: jax.Array  # [B] bool, False: the GDN state starts from zeros whatever the slot holds
    # [B] int32 slot each row's initial GDN state is read from: a restore's source, or the live slot itself
    # (None: linear_state_ids). The new state is always written to linear_state_ids, so a restore is a copy,
    # never a move.
    initial_state_ids: jax.Array | None = None
    # Checkpoints the step writes (checkpoint_mode "scan"), [S] int32 each: the GDN state of row save_rows[s] after
    # save_offsets[s] of its tokens (a multiple of the chunked rule's chunk size) goes to slot save_slots[s], in every
    # GDN layer. Padding entries write slot 0. None: no saves in this step shape.
    save_rows: jax.Array | None = None
    save_offsets: jax.Array | None = None
    save_slots: jax.Array | None = None

    @property
    def positions(self) -> jax.Array:
        """[B, T] int32: the absolute position of every token of the step."""
        return self.start_pos[:, None] + jnp.arange(self.tokens.shape[1])[None, :]


@partial(jax.tree_util.register_dataclass, data_fields=["k", "v", "conv", "ssm"], meta_fields=[])
@dataclasses.dataclass
class DeviceState:
    """The pools, one array per kind with every layer of that kind stacked (None for a kind the model lacks), so
    that the layer loop (`Qwen35Model.scan_layers`) indexes its layer's pool by the loop counter. Full-attention
    layer j's KV pool is k[:, j] (head-major, the layer axis second: a row's gathered prefix is [kv_heads, S, hd],
    see Attention); GDN layer j's pools are conv[j] and ssm[j]."""
    k: jax.Array | None      # [kv_heads, full layers, num_blocks, block_size, head_dim] (see pool_dtype)
    v: jax.Array | None
    conv: jax.Array | None   # [GDN layers, num_slots, kernel - 1, conv_dim] (activation dtype, see pool_dtype)
    ssm: jax.Array | None    # [GDN layers, num_slots, Hv, dk, dv] float32


def pool_dtype(dtype):
    """The dtype the KV and conv pools of a given activation dtype are stored in: itself, except that a 16-bit
    float (bfloat16) is stored as its bit patterns in uint16. XLA's CPU backend has no 16-bit float scatter or
    dynamic-update-slice kernel: it turns a write of a few rows into a bfloat16 pool into a conversion of the whole
    pool to float32 and back, or a pass over all of it, on every step. Integer writes touch only the rows written.
    The bits are exact: `to_pool` / `from_pool` are bitcasts."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.uint16) if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2 else dtype


def to_pool(x, pool):
    """Values in the activation dtype -> the pool's storage dtype (a bitcast for 16-bit floats)."""
    return jax.lax.bitcast_convert_type(x, pool.dtype) if pool.dtype == jnp.uint16 else x.astype(pool.dtype)


def from_pool(x, dtype):
    """Rows read from a pool -> the activation dtype."""
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype == jnp.uint16 else x.astype(dtype)


def init_state(cfg: ModelConfig, num_blocks: int, block_size: int, num_slots: int, dtype=jnp.float32) -> DeviceState:
    n_full, n_lin = len(cfg.full_layer_ids), len(cfg.linear_layer_ids)
    kv_shape = (cfg.num_key_value_heads, n_full, num_blocks, block_size, cfg.head_dim)  # head-major: see Attention
    conv_shape = (n_lin, num_slots, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim)
    ssm_shape = (n_lin, num_slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    store = pool_dtype(dtype)
    return DeviceState(
        k=jnp.zeros(kv_shape, store) if n_full else None,
        v=jnp.zeros(kv_shape, store) if n_full else None,
        conv=jnp.zeros(conv_shape, store) if n_lin else None,
        ssm=jnp.zeros(ssm_shape, jnp.float32) if n_lin else None,
    )


def read_slots(pool, ids, layer):
    """pool [layers, num_slots, ...] -> pool[layer, ids] [B, ...], gathered with one extra (padding) index.

    XLA turns a one-index gather into a dynamic slice and fuses that copy into every consumer: then the GDN
    output reads the pool after the slot's write was issued, and XLA copies the whole pool to keep the old
    contents. A gather of two or more indices is computed once, so only it reads the pool, before the write."""
    return pool[layer, jnp.concatenate([ids, jnp.zeros((1,), ids.dtype)])][:-1]


def layer_ids(layer, ids):
    """The layer index broadcast to the shape of `ids`: the leading index array of a write into a stacked pool."""
    return jnp.full(ids.shape, layer, ids.dtype)


def write_rows(pool, ids: tuple, rows, axis: int = 0):
    """pool.at[(:,) * axis + ids].set(rows) for index arrays `ids` ([N] each, over pool axes axis, axis + 1, ...)
    that the host has validated; rows: [N, *the pool's other dims]. In a form XLA updates in place: one row is a
    dynamic_update_slice (a one-index scatter becomes a bounds-checked select that reads the pool, and XLA copies
    it), more rows a scatter promising in-bounds indices. The pool is indexed in its own shape: a reshaped view
    would be a second value of the same buffer."""
    rows, n = to_pool(rows, pool), len(ids)
    if ids[0].shape[0] == 1:
        start = (0,) * axis + tuple(i[0] for i in ids) + (0,) * (pool.ndim - axis - n)
        return jax.lax.dynamic_update_slice(pool, rows.reshape(pool.shape[:axis] + (1,) * n + pool.shape[axis + n:]),
                                            start)
    return pool.at[(slice(None),) * axis + ids].set(jnp.moveaxis(rows, 0, axis), mode="promise_in_bounds")


# Keys one iteration of the attention loop reads per row (`Attention`): the loop runs over the keys the batch's rows
# hold, whatever the width of the block tables, so a wide table costs nothing and one width serves every step.
KV_CHUNK_KEYS = 256
# Keys per iteration of a prefill step's attention loop (more than one token per row) when the environment sets it
# (`kv_chunk_keys`); unset, KV_CHUNK_KEYS. For comparisons on an accelerator: see `kv_chunk_keys`.
PREFILL_KV_CHUNK_ENV = "GDN_JAX_PREFILL_KV_CHUNK_KEYS"


def kv_chunk_keys(tokens: int) -> int:
    """Keys one iteration of the attention loop reads per row, in a step of `tokens` tokens per row: KV_CHUNK_KEYS, or
    for a prefill step the positive integer `PREFILL_KV_CHUNK_ENV` names (rounded down to whole KV blocks, at least
    one). Larger chunks mean larger query tiles (`query_tiles`) and fewer iterations: XLA's GPU runtime (outside
    command buffers) runs every iteration of a loop whose trip count is known only on the device (the key chunks: as
    many as the rows hold) by copying its condition to the host and waiting for it, and an 8704-token prefill runs
    595 such iterations per attention layer at 256 keys (34 tiles), 14 at 2048 (4 tiles of 2176 queries), at the
    price of computing the masked part of each tile's last chunks. The same attention either way, up to the online
    softmax's rounding (tests/gdn_jax/test_model.py); not the default anywhere until measured on a GPU."""
    if tokens > 1:
        env = os.environ.get(PREFILL_KV_CHUNK_ENV, "").strip()
        if env:
            if not env.isdigit() or int(env) < 1:
                raise ValueError(f"{PREFILL_KV_CHUNK_ENV} must be a positive number of keys, got {env!r}")
            return int(env)
    return KV_CHUNK_KEYS


# On CPU, a query tile of at most this many queries per KV head (g * Tq) has its scores multiplied with the keys on
# the left (`attention_scores`).
KEYS_LEFT_QUERIES = 16


def attention_scores(qh, keys):
    """qh [kvh, n, hd] @ keys [kvh, S, hd] -> scores [kvh, n, S], accumulated in float32.

    On XLA's CPU backend a few queries (n <= `KEYS_LEFT_QUERIES`: a decode step's, a short chunk's) multiply as
    keys @ qh.T, the keys on the left, and the small [kvh, S, n] result is transposed: the library streams the keys
    as the left operand of a batched product faster than it packs them as a transposed right one (16 rows' 32 KV
    heads of 4 queries, 256 keys: bfloat16 280 -> 151 us, float32 544 -> 198 us; one row's 2 heads: the same). The
    gain shrinks as n grows: at 32 queries bfloat16 ties at 32 heads and is 2x slower at 2. The values are the same
    products summed in float32 over hd. The optimisation barrier keeps XLA from folding the transpose back into the
    product. docs/design.md, "Decode attention at long context"."""
    kw = dict(preferred_element_type=jnp.float32, precision=float32_precision(qh.dtype))
    if jax.default_backend() == "cpu" and qh.shape[-2] <= KEYS_LEFT_QUERIES:
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


def rows_per_iteration(rows: int, bytes_per_row: int, kind: str) -> int:
    """How many of `rows` rows one iteration of a loop over them handles: on CPU the largest power of two dividing
    `rows` whose working set fits CPU_ROWS_BYTES[kind] (at least 1), elsewhere all of them. On CPU a few rows at a
    time keep their gathered state in cache and the step's temporaries small: tens of MB of temporaries are
    mapped fresh by glibc, and zero-filled by the kernel, on every step."""
    if jax.default_backend() != "cpu":
        return rows
    return math.gcd(rows, 1 << max(0, (CPU_ROWS_BYTES[kind] // bytes_per_row).bit_length() - 1))


class LayerKernel:
    """A projection matrix of the layer the layer loop is at (`Qwen35Model.scan_layers`): every layer's own matrix
    (separate buffers, never stacked) and the loop's layer index. `dense` multiplies by the layer's matrix inside a
    `lax.switch` over the layers, whose branches read their matrix where it lies.

    Slicing a stacked [layers, n_in, n_out] array instead copies the layer's matrix on XLA's CPU backend (its
    matmuls read whole buffers), on every step, and a bfloat16 stack is converted to float32 whole (see
    docs/design.md, "Layer loop")."""

    def __init__(self, kernels: tuple, layer):
        self.kernels, self.layer = kernels, layer

    def __getitem__(self, index):  # how an nnx.Variable reads its value: `kernel[...]`
        if index is not Ellipsis:
            raise TypeError("a LayerKernel is read whole (kernel[...])")
        return self

    @property
    def dtype(self):
        return self.kernels[0].dtype

    def select(self, fn, *args):
        """fn(the layer's matrix, *args), through a switch over the layers unless the layer is known when tracing.
        `fn` is traced once per layer (a branch each): keep it a call of a jitted function, whose trace is cached."""
        if isinstance(self.layer, int):
            return fn(self.kernels[self.layer], *args)
        return jax.lax.switch(self.layer, [partial(fn, k) for k in self.kernels], *args)


@jax.jit
def _identity(a):  # a branch of the switch that picks a layer's small parameters (one trace for every branch)
    return a


# On CPU, products of this many rows (first, last) put the weight on the left (`_product`), per activation dtype.
WEIGHT_LHS_ROWS = {jnp.dtype(jnp.float32): (2, 64), jnp.dtype(jnp.bfloat16): (16, 64)}
# On CPU, products of a 16-bit float weight with at least this many rows are multiplied in float32 (`_product`,
# `dense_all`), when the weight's float32 copy (a temporary of the step) takes at most UPCAST_MAX_BYTES and the
# float32 routine is the faster one on this machine (`upcast_is_faster`).
UPCAST_ROWS = 256
UPCAST_MAX_BYTES = 1 << 30
UPCAST_ENV = "GDN_JAX_BF16_UPCAST"  # "1": always, "0": never, unset: measured (`upcast_is_faster`)


def _best_seconds(fn, *args, repeats: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


@functools.cache
def upcast_is_faster(timer=_best_seconds) -> bool:
    """Whether this CPU multiplies a many-row bfloat16 product faster with both operands converted to float32 (the
    conversion included) than with XLA's bfloat16 routine (float32 accumulation). Which one wins depends on the
    machine: on the 2-core AVX-512 Xeons without AMX the converted product (1024 x 6144 weight: 231 against 149
    GFLOP/s at 2048 rows), on a 2-core AMD EPYC with AVX-512 BF16 the bfloat16 routine, by about 2x (the bfloat16
    2048-token forward of hybrid-1024 in 1.8 s against 3.1-3.6 s). So it is measured once per machine
    (`executables.remembered`: kept beside JAX's persistent cache, else measured once per process; a `timer` other
    than the default keeps nothing), on a prefill-sized product (1024 rows of a 1024 x 2048 weight, best of 5 each,
    ~0.4 s with compiling), unless `UPCAST_ENV` says "1" or "0". The values agree either way to float32 rounding (exact
    products, float32 sums in another order)."""
    env = os.environ.get(UPCAST_ENV)
    if env not in (None, "", "0", "1"):
        raise ValueError(f"{UPCAST_ENV} must be 0 or 1 (unset: measured), got {env!r}")
    if env:
        return env == "1"

    def measure():
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.standard_normal((1024, 1024)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((2048, 1024)), jnp.bfloat16)
        native = jax.jit(lambda x, w: jnp.einsum("md,vd->mv", x, w, preferred_element_type=jnp.float32))
        converted = jax.jit(lambda x, w: jnp.einsum("md,vd->mv", x.astype(jnp.float32), w.astype(jnp.float32)))
        return timer(converted, x, w) < timer(native, x, w)

    from gdn_jax import executables  # (it imports this module)
    return executables.measured_choice("bf16_upcast", measure, lambda faster: isinstance(faster, bool),
                                       keep=timer is _best_seconds)


# XLA's CPU backend fuses a matrix-vector product into a loop over the matrix only while the vector, in float32, is
# under 16 KiB: one-row products of this many columns or more take another form (`_one_row`).
FUSED_MATVEC_COLUMNS = 4096


def _one_row(x, kernel):
    """x [n_in] @ kernel[n_out, n_in].T -> [n_out] float32 on XLA's CPU backend: what `_product` does with one row.

    Written with the transpose, the product compiles to XLA's own loop over the weight's rows (a dot inside a loop
    fusion, split over the cores) that converts a bfloat16 weight in registers and streams it once. A bfloat16
    weight is read there as two streams, its rows in the order 0, n/2, 1, n/2 + 1, ... (a transpose that the loop
    folds into its indexing; the small result is put back in order), which the hardware prefetchers keep further
    ahead of: 17.6 -> 20 GB/s on the development machine (float32 streams faster as it is). Putting the result back
    after the switch over the layers instead (one op per call, not per layer) was slower: XLA fused the reordering
    into the consumers.
    XLA fuses that loop only while n_in < `FUSED_MATVEC_COLUMNS`. A wider product (a model 4096 wide) would compile
    to a float32 transposed copy of the whole weight, then the product: 0.3-0.6 GB/s in bfloat16, 1.2 in float32.
    There a float32 weight goes to the library as it lies (31 GB/s); a bfloat16 one is multiplied as two rows
    (`dense_all` adds a zero row, outside the switch), which the library multiplies in bfloat16 without converting
    the weight first (17 GB/s; one row would go to a matrix-vector routine that converts it: 1.8). docs/design.md,
    "One-row products"."""
    n, k = kernel.shape
    x = x.reshape(1, k)
    if k >= FUSED_MATVEC_COLUMNS:
        return jnp.einsum("md,vd->mv", x, kernel, preferred_element_type=jnp.float32)[0]
    if kernel.dtype == jnp.float32 or n % 2:
        return jnp.dot(x, kernel.T, preferred_element_type=jnp.float32)[0]
    y = jnp.dot(x, kernel.reshape(2, n // 2, k).transpose(1, 0, 2).reshape(n, k).T, preferred_element_type=jnp.float32)
    return y.reshape(n // 2, 2).T.reshape(n)


def float32_precision(dtype):
    """The precision of a product of `dtype` operands: HIGHEST for float32, which XLA's GPU backend otherwise
    multiplies in TensorFloat-32 (10-bit mantissas) on Ampere and later GPUs; the CPU ignores it. The default (None)
    for 16-bit operands."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _product(x, kernel):
    """x [..., n_in] @ kernel[n_out, n_in].T -> [..., n_out], accumulated and returned in float32.

    On XLA's CPU backend the form of the product decides its speed at few rows (decode: one row per sequence):
    - One row: `_one_row`, mostly XLA's own loop over the weight's rows, which streams it once. The contraction
      written without the transpose goes to the library's matrix-vector routine, which first converts a whole
      bfloat16 weight to float32 in memory (measured on a 6144 x 1024 matrix on the development machine: 0.42
      against 1.37 ms in bfloat16; float32 0.52 against 0.60 ms).
    - 2 to `rows_kernel_rows()` bfloat16 rows, on a CPU where it is measured faster: the compiled few-row kernel
      (`cpu_kernels.rows_product`, in place of the library's W @ x.T below; each weight row read once for all rows).
    - 2-64 rows (bfloat16: 16-64): W @ x.T, the weight on the left (float32 with 2-64 rows: 1.4-4x less CPU time
      than x @ W.T; bfloat16 from 16 rows on: 15-35% less; with 2-4 rows no gain, so not used there). Bfloat16
      from 2 rows on, and one row as two, on a CPU where that is faster (`few_rows_weight_left`, measured). The
      optimisation barrier keeps XLA from folding the transpose of the small [n_out, rows] result back into the dot
      (which would turn it into x @ W.T again).
    - `UPCAST_ROWS` rows or more (prefill) of a bfloat16 weight (`dense_all`, which picks the layer's weight out of
      the layer switch first), on a CPU where that is faster (`upcast_is_faster`, measured): both operands
      converted to float32, then the library's float32 product. On the development machine's AVX-512 Xeon its
      bfloat16 routine (float32 accumulation) is the slower of the two: 149 against 231 GFLOP/s at 2048 rows of a
      1024 x 6144 weight, conversion included (256 rows: 152 against 172); on an AMD EPYC with AVX-512 BF16 it is
      about twice as fast as the converted product. Same values: the products of bfloat16 numbers are exact in float32,
      and both accumulate in float32. Below ~200 rows converting the weight on every call costs more than it
      saves. The float32 copy is a temporary of the step (Qwen3.5-9B's largest projection: 400 MB); a weight whose
      copy would pass `UPCAST_MAX_BYTES` (the 9B's 248k-token LM head: 4 GB, multiplied at many rows mainly for
      prompt logprobs) is multiplied as it is.
    Many rows (prefill) amortise the library's packing of the weight either way. Elsewhere (GPU) the product is left
    alone, at `float32_precision`."""
    lead = x.shape[:-1]
    if jax.default_backend() == "cpu" and math.prod(lead) == 1:
        return _one_row(x.reshape(x.shape[-1]), kernel).reshape(*lead, -1)
    if _weight_left(x):
        x = x.reshape(-1, x.shape[-1])
        return _as_rows(_weight_left_product(x, kernel), x, kernel).reshape(*lead, kernel.shape[0])
    return jnp.einsum("...d,vd->...v", x, kernel, preferred_element_type=jnp.float32,
                      precision=float32_precision(jnp.result_type(x, kernel)))


def _weight_left(x) -> bool:
    """Whether `_product` multiplies x as W @ x.T (on CPU, WEIGHT_LHS_ROWS rows of the activation's dtype; bfloat16
    from 2 rows on where `few_rows_weight_left`, or where the few-row kernel takes them: `rows_kernel_rows`)."""
    if jax.default_backend() != "cpu":
        return False
    lo, hi = WEIGHT_LHS_ROWS.get(jnp.dtype(x.dtype), (0, -1))
    rows = math.prod(x.shape[:-1])
    if jnp.dtype(x.dtype) == jnp.bfloat16 and (few_rows_weight_left() or 2 <= rows <= rows_kernel_rows()):
        lo = 2
    return lo <= rows <= hi


FEW_ROWS_ENV = "GDN_JAX_BF16_FEW_ROWS_WEIGHT_LEFT"  # "1": always, "0": never, unset: measured (`few_rows_weight_left`)
FEW_ROWS_ROUNDS, FEW_ROWS_MARGIN = 15, 0.05


@functools.cache
def few_rows_weight_left(timer=None) -> bool:
    """Whether this CPU multiplies bfloat16 products of 1-15 rows (decode steps) faster in XLA's library with the
    weight on the left, W @ x.T, one row padded to two with a zero row, than in the forms below.

    On the machines this was developed on, a one-row product ran fastest as XLA's own loop over the weight
    (`_one_row`) and 2-15 rows as x @ W.T. On a Xeon with AMX the library's bfloat16 routine with the weight on the
    left streams the weight far faster at any few rows: 32 matrices of 4096 x 1024 (268 MB, from memory), one row
    18.7 GB/s as the loop (512-bit vectors, its faster width there) against 26.4 GB/s as two rows, weight left;
    2, 4 and 8 rows 15.0, 24.3 and 18.9 GB/s as x @ W.T against 28.7, 38.7 and 32.9 (12 matrices, 100 MB). So it
    is measured once per machine (`executables.measured_choice`: kept beside JAX's persistent cache, else once per
    process), unless `FEW_ROWS_ENV` says "1" or "0": a one-row product over 8 bfloat16 matrices of 4096 x 1024, as
    the loop (at 256 and at 512 bits, the faster of the two each round) and as two rows with the weight on the left,
    in turn `FEW_ROWS_ROUNDS` times; the library form is chosen when the median of the rounds' time ratios is
    `FEW_ROWS_MARGIN` below 1 (a tie keeps the loop). `timer(fn, *args) -> seconds` replaces the clock (tests; then
    nothing is kept). Either way the values agree to float32 summation order (exact products of bfloat16 numbers,
    float32 sums)."""
    env = os.environ.get(FEW_ROWS_ENV)
    if env not in (None, "", "0", "1"):
        raise ValueError(f"{FEW_ROWS_ENV} must be 0 or 1 (unset: measured), got {env!r}")
    if env:
        return env == "1"
    if jax.default_backend() != "cpu":
        return False

    def measure():
        # the decode steps' XLA options (it imports this module)
        from gdn_jax.worker import DECODE_VECTOR_BITS, LLVM_IR_CPU_COMPILER_OPTIONS, vector_width_options

        rng = np.random.default_rng(0)
        weights = tuple(jnp.asarray(rng.standard_normal((4096, 1024)) * 0.02, jnp.bfloat16) for _ in range(8))
        x = jnp.asarray(rng.standard_normal((1, 1024)), jnp.bfloat16)
        loops = [jax.jit(lambda x, ws: [_one_row(x[0], w) for w in ws], compiler_options=vector_width_options(bits))
                 for bits in DECODE_VECTOR_BITS]
        library = jax.jit(lambda x, ws: [_library_weight_left(jnp.concatenate([x, jnp.zeros_like(x)]), w)
                                         for w in ws], compiler_options=LLVM_IR_CPU_COMPILER_OPTIONS)
        for fn in (*loops, library):  # compiled and run once, untimed
            jax.block_until_ready(fn(x, weights))
        clock = timer or seconds_of
        ratios = []
        for _ in range(FEW_ROWS_ROUNDS):
            loop = min(clock(fn, x, weights) for fn in loops)
            ratios.append(clock(library, x, weights) / loop)
        return float(np.median(ratios)) <= 1 - FEW_ROWS_MARGIN

    from gdn_jax import executables  # (it imports this module)
    return executables.measured_choice("bf16_few_rows_weight_left", measure, lambda v: isinstance(v, bool),
                                       keep=timer is None)


def seconds_of(fn, *args) -> float:
    """Wall seconds of one call of `fn`, its outputs ready."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def _weight_left_product(x, kernel):
    """x [m, n_in] by kernel [n_out, n_in], float32: [m, n_out] by the compiled few-row kernel where it takes these
    rows (`_rows_kernel`), else [n_out, m] by XLA's library with the weight on the left (`_library_weight_left`),
    whose result the caller transposes after the layer switch (one transpose per call site): `_as_rows`."""
    if _rows_kernel(x, kernel):
        return cpu_kernels.rows_product(x, kernel)
    return _library_weight_left(x, kernel)


def _as_rows(y, x, kernel):
    """A `_weight_left_product(x, kernel)` result as [m, n_out]: the library's transposed, the kernel's as it is (it
    writes the rows' outputs in place; XLA's transposing convert after a 16-row product took 1.2-1.3 ms per step
    more than a plain one, docs/benchmarks.md)."""
    return y if _rows_kernel(x, kernel) else y.T


def _library_weight_left(x, kernel):
    """kernel [n_out, n_in] @ x[m, n_in].T -> [n_out, m] float32 by XLA. The optimisation barrier keeps XLA from
    folding the transpose that follows (`_product`) back into the dot."""
    return jax.lax.optimization_barrier(jnp.einsum("vd,md->vm", kernel, x, preferred_element_type=jnp.float32))


def _rows_kernel(x, kernel) -> bool:
    """Whether the compiled kernel multiplies this product (`cpu_kernels.rows_product`): bfloat16 x [m, n_in] and
    kernel [n_out, n_in] on the CPU backend, 2 <= m <= `rows_kernel_rows()`."""
    return (jax.default_backend() == "cpu" and x.ndim == 2 and kernel.ndim == 2 and x.dtype == jnp.bfloat16
            and kernel.dtype == jnp.bfloat16 and 2 <= x.shape[0] <= rows_kernel_rows() and cpu_kernels.available())


ROWS_KERNEL_ENV = "GDN_JAX_BF16_ROWS_KERNEL"  # "1": 2-16 rows, "0": never, unset: measured (`rows_kernel_rows`)
ROWS_KERNEL_COUNTS = (4, 8, 16)  # the row counts measured: 2-4 rows take the kernel if it wins at 4, 5-8 at 8, ...


@functools.cache
def rows_kernel_rows(timer=None) -> int:
    """The most rows of a bfloat16 product (from 2 on) that the compiled few-row kernel multiplies
    (`cpu_kernels.rows_product`) instead of XLA's library with the weight on the left: 0 (none) or one of
    `ROWS_KERNEL_COUNTS`.

    On a 2-core AMD EPYC (Zen 4, AVX-512 BF16, no matrix units) XLA multiplies 2-16 bfloat16 rows at 13-14 GB/s of
    weight where one row streams 30, so a decode step of 2 rows took twice as long as one of 1 row; the kernel reads
    each weight row once for all the rows: on a 201 MB weight, 4 rows 6.6-7.3 against 14.1-15.9 ms, 16 rows
    10.9-13.4 against 14.2-16.5 (min; docs/benchmarks.md). A Xeon with AMX multiplies them in its matrix units. So
    it is measured once per machine (`executables.measured_choice`), unless `ROWS_KERNEL_ENV` says "1" (16) or "0"
    (0), where the kernels are available (`cpu_kernels.available`; else 0): for each of `ROWS_KERNEL_COUNTS`, in
    turn `FEW_ROWS_ROUNDS` times over 8 bfloat16 matrices of 4096 x 1024, the kernel against the library's form,
    each product's rows feeding the next's (`_chained`, as a decode step's products follow one another); the count
    is taken while the median of the rounds' time ratios is `FEW_ROWS_MARGIN` below 1. `timer(fn, *args) ->
    seconds` replaces the clock (tests; then nothing is kept). The values agree to float32 summation order. A
    one-row product that `_as_two_rows` pads to two rows goes to the kernel too where it takes 2 rows.

    Products that do not depend on one another run side by side on XLA's threads, each kernel call then sharing
    its blocks with threads the other holds: measured so on the EPYC, 16 rows came out near the margin (kernel
    4.1-5.3 ms against 5.1-5.8 ms for the 8 products, ratio 0.78-0.96) and the stored choice was 8, where a 16-row
    decode step ran 23.5-24.6 ms on the library and 20.4-21.0 ms on the kernel; in turn the ratio is 0.76-0.87
    (docs/benchmarks.md)."""
    env = os.environ.get(ROWS_KERNEL_ENV)
    if env not in (None, "", "0", "1"):
        raise ValueError(f"{ROWS_KERNEL_ENV} must be 0 or 1 (unset: measured), got {env!r}")
    if jax.default_backend() != "cpu" or not cpu_kernels.available():
        return 0
    if env:
        return ROWS_KERNEL_COUNTS[-1] if env == "1" else 0

    def measure():
        rng = np.random.default_rng(0)
        weights = tuple(jnp.asarray(rng.standard_normal((4096, 1024)) * 0.02, jnp.bfloat16) for _ in range(8))
        kernel = _chained(cpu_kernels.rows_product)
        library = _chained(lambda x, w: _library_weight_left(x, w).T)  # transposed after, as in a step
        clock = timer or seconds_of
        most = 0
        for rows in ROWS_KERNEL_COUNTS:
            x = jnp.asarray(rng.standard_normal((rows, 1024)), jnp.bfloat16)
            for fn in (kernel, library):  # compiled and run once, untimed
                jax.block_until_ready(fn(x, weights))
            ratios = [clock(kernel, x, weights) / clock(library, x, weights) for _ in range(FEW_ROWS_ROUNDS)]
            if float(np.median(ratios)) > 1 - FEW_ROWS_MARGIN:
                break
            most = rows
        return most

    from gdn_jax import executables  # (it imports this module)
    return executables.measured_choice("bf16_rows_kernel_chained", measure, lambda v: v in (0, *ROWS_KERNEL_COUNTS),
                                       keep=timer is None)


def _chained(product):
    """jitted (x [m, n_in], weights [n_out, n_in] with n_out >= n_in) -> x after each weight in turn:
    x += product(x, w)[:, :n_in] / 1024 (product: -> [m, n_out]), so that every product waits for the one before
    (`rows_kernel_rows`)."""
    def run(x, weights):
        for w in weights:
            x = x + (product(x, w)[:, :x.shape[1]] / 1024).astype(x.dtype)
        return x
    return jax.jit(run)


@jax.jit
def _products(x, kernels: tuple) -> tuple:
    """_product(x, k) for each kernel. Jitted so that the switch branches of `LayerKernel` (one per layer, same
    shapes) reuse one trace."""
    return tuple(_product(x, k) for k in kernels)


@jax.jit
def _weight_left_products(x, kernels: tuple) -> tuple:
    """_weight_left_product(x, k) for each kernel, jitted for the same reason as `_products`."""
    return tuple(_weight_left_product(x, k) for k in kernels)


def dense(x, kernel):
    """x [..., n_in] @ kernel.T, kernel [n_out, n_in] (the HF layout) -> [..., n_out] float32, accumulated in
    float32 (see `_product` for the forms it takes on CPU). `kernel` may be a `LayerKernel`: the matrix of the
    layer the loop is at."""
    return dense_all(x, (kernel,))[0]


def _as_two_rows(x, kernel) -> bool:
    """Whether a one-row product is multiplied as two rows, the row and a zero row (see `_one_row`): on CPU, a
    weight narrower than float32 and an input too wide for XLA's fused loop, or a bfloat16 weight on a CPU that
    multiplies few rows faster in the library (`few_rows_weight_left`)."""
    return (jax.default_backend() == "cpu" and math.prod(x.shape[:-1]) == 1 and kernel.dtype != jnp.float32
            and (x.shape[-1] >= FUSED_MATVEC_COLUMNS or (kernel.dtype == jnp.bfloat16 and few_rows_weight_left())))


def _upcast(x, kernel) -> bool:
    """Whether a product is multiplied in float32 (see `_product`): on CPU, `UPCAST_ROWS` rows or more of a weight
    narrower than float32 whose float32 copy takes at most `UPCAST_MAX_BYTES`, where that is the faster routine
    (`upcast_is_faster`)."""
    w = kernel.kernels[0] if isinstance(kernel, LayerKernel) else kernel
    return (jax.default_backend() == "cpu" and math.prod(x.shape[:-1]) >= UPCAST_ROWS and w.dtype != jnp.float32
            and 4 * w.size <= UPCAST_MAX_BYTES and upcast_is_faster())


def _together(kernels) -> LayerKernel:
    """`LayerKernel`s of one layer loop as one, whose matrix per layer is the tuple of theirs: one switch picks all."""
    return LayerKernel(tuple(zip(*(k.kernels for k in kernels))), kernels[0].layer)


def dense_all(x, kernels) -> list:
    """[dense(x, k) for k in kernels]; `LayerKernel`s (of one layer loop) are picked by one switch for all of them."""
    if _upcast(x, kernels[0]):
        # The switch only copies the layer's matrices out (a copy, no generated code), so that the step compiles one
        # conversion per call site and not one per layer and call site (~1 s more per 9B prefill shape).
        if isinstance(kernels[0], LayerKernel):
            kernels = _together(kernels).select(_identity)
        xf = x.astype(jnp.float32)
        return [jnp.einsum("...d,vd->...v", xf, k.astype(jnp.float32)) for k in kernels]
    if _as_two_rows(x, kernels[0]):  # padded outside the switch: one pad and one slice per call, not per layer
        lead, x = x.shape[:-1], x.reshape(1, x.shape[-1])
        return [y[0].reshape(*lead, -1) for y in dense_all(jnp.concatenate([x, jnp.zeros_like(x)]), kernels)]
    if not isinstance(kernels[0], LayerKernel):
        return list(_products(x, tuple(kernels)))
    if _weight_left(x):
        # the transposes of the results follow the switch: one per call site, not one per layer and call site in
        # its branches (each a kernel of the step for XLA to generate: 128 of Qwen3.5-9B's 16-row decode step)
        lead, x = x.shape[:-1], x.reshape(-1, x.shape[-1])
        ys = _together(kernels).select(lambda ks, x: _weight_left_products(x, ks), x)
        return [_as_rows(y, x, k.kernels[0]).reshape(*lead, -1) for y, k in zip(ys, kernels)]
    return list(_together(kernels).select(lambda ks, x: _products(x, ks), x))


class Linear(nnx.Module):
    """Bias-free projection with its matrix in the HF layout, kernel [n_out, n_in], accumulating in float32 (the
    fast bfloat16 path on CPU and GPU) and returning the activation dtype. `parts` names the HF projections a fused
    matrix stacks along its rows, with their sizes (see `fused_parts`)."""

    def __init__(self, n_in: int, n_out: int, dtype, std: float, rngs: nnx.Rngs, parts: tuple = ()):
        self.kernel = nnx.Param(nnx.initializers.normal(std)(rngs.params(), (n_out, n_in), dtype))
        self.dtype, self.parts = dtype, parts

    def __call__(self, x):
        y = dense(x.astype(self.dtype), self.kernel[...]).astype(self.dtype)
        if not self.parts:
            return y
        return jnp.split(y, list(itertools.accumulate(n for _, n in self.parts[:-1])), axis=-1)


def _linear(rngs, n_in, n_out, dtype, std, parts: tuple = ()):
    return Linear(n_in, n_out, dtype, std, rngs, parts)


def fused_parts(cfg: ModelConfig) -> dict[str, dict[str, tuple[tuple[str, int], ...]]]:
    """The fused projections: per submodule of a layer, fused matrix -> ((HF projection name, output rows), ...) in
    the order its rows stack them. Projections of one input are one matrix, so a step runs one product per input
    (a decode step reads the weights in fewer, larger passes); the loader (`weights.load_hf_weights`) stacks the HF
    tensors, the writer splits them back."""
    H, kvh, hd, nv = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.linear_num_value_heads
    return {
        "linear_attn": {"in_proj": (("in_proj_qkv", cfg.conv_dim), ("in_proj_z", cfg.linear_value_dim),
                                    ("in_proj_b", nv), ("in_proj_a", nv))},
        "self_attn": {"qkv_proj": (("q_proj", 2 * H * hd), ("k_proj", kvh * hd), ("v_proj", kvh * hd))},
        "mlp": {"gate_up_proj": (("gate_proj", cfg.intermediate_size), ("up_proj", cfg.intermediate_size))},
    }


def _fused(rngs, cfg, module: str, name: str, dtype, std):
    parts = fused_parts(cfg)[module][name]
    return _linear(rngs, cfg.hidden_size, sum(n for _, n in parts), dtype, std, parts)


def rms_norm(x, eps):
    xf = x.astype(jnp.float32)
    return xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """Zero-centred RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), in float32."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        return (rms_norm(x, self.eps) * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """GDN output norm (not zero-centred): w * rmsnorm(o) * silu(z), per value head."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, o, z):
        h = self.weight[...] * rms_norm(o, self.eps).astype(o.dtype)
        return (h.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(o.dtype)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs, std):
        self.gate_up_proj = _fused(rngs, cfg, "mlp", "gate_up_proj", dtype, std)  # [gate | up]
        self.down_proj = _linear(rngs, cfg.intermediate_size, cfg.hidden_size, dtype, std)

    def __call__(self, x):
        gate, up = self.gate_up_proj(x)
        return self.down_proj(silu_mul(gate, up))


def silu_mul(gate, up):
    """silu(gate) * up in the dtype of `gate`, each of the two results rounded once to that dtype, as transformers
    computes them (in float32 inside each kernel).

    For a 16-bit dtype the silu runs in float32 and `lax.reduce_precision` rounds it, and the product, to the dtype:
    XLA removes no reduce_precision, while it may keep float32 values where a program converts to bfloat16 and back
    inside one fusion (`xla_allow_excess_precision`), so that a result would depend on how XLA fuses the step, and so
    on the batch. `jax.nn.silu` on a bfloat16 input is instead five operations each rounded to bfloat16: 16
    conversions in the fused kernel, which made the MLP's silu the forward's costliest elementwise fusion
    (docs/design.md, "The MLP's silu in bfloat16")."""
    if gate.dtype == jnp.float32:
        return jax.nn.silu(gate) * up
    info = jnp.finfo(gate.dtype)

    def rounded(a):
        return jax.lax.reduce_precision(a, exponent_bits=info.nexp, mantissa_bits=info.nmant)

    s = rounded(jax.nn.silu(gate.astype(jnp.float32)))
    return rounded(s * up.astype(jnp.float32)).astype(gate.dtype)


class GatedDeltaNet(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs, std):
        self.cfg = cfg
        nv, K = cfg.linear_num_value_heads, cfg.linear_conv_kernel_dim
        self.in_proj = _fused(rngs, cfg, "linear_attn", "in_proj", dtype, std)  # [qkv | z | b | a]
        self.conv1d = nnx.Param(jax.random.normal(rngs.params(), (cfg.conv_dim, K), dtype) * 0.3)  # [C, K]
        self.dt_bias = nnx.Param(jnp.ones((nv,), jnp.float32))
        # Mild decay by default (exp(A_log) in [0.01, 0.3]) so the state carries information over many tokens.
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (nv,), jnp.float32, 0.01, 0.3)))
        self.norm = GatedRMSNorm(cfg.linear_value_head_dim, cfg.rms_norm_eps, dtype)
        self.out_proj = _linear(rngs, cfg.linear_value_dim, cfg.hidden_size, dtype, std)

    def __call__(self, x, conv_state, ssm_state, lengths, chunk_size: int | None = None, rule=None, saves=None,
                 schedule: str = "auto", kernel: bool = True):
        """x: [B, T, D]; conv_state: [B, K-1, C]; ssm_state: [B, Hv, dk, dv] -> (out, conv_state, ssm_state).
        `chunk_size` of the chunked rule (same maths; None: `gated_delta.default_chunk_size()`). `rule`, if given,
        replaces the gated delta rule and the ssm_state argument: (q, k, v, g, beta) -> (o, new ssm state); the
        engine's decode step passes one that advances the states inside their pool. `saves` = (rows, offsets), [S]
        each, offsets multiples of `chunk_size`: also returns the states after those tokens of those rows, (conv
        [S, K-1, C], ssm [S, Hv, dk, dv]), from the chunked scan's chunk-boundary states (or copied out by the CPU
        kernel as it passes them). `schedule`: the chunked
        rule's (`chunk_gated_delta_rule`'s impl: "auto", "fused" or "parallel"; same maths); with "auto" and
        `kernel`, a step of more than one token per row on the CPU runs the compiled kernel instead
        (`cpu_kernels.gdn_prefill`), which has no gradient: training passes `kernel=False`."""
        cfg = self.cfg
        chunk_size = chunk_size or default_chunk_size()
        B, T, _ = x.shape
        nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        mixed, z, b, a = self.in_proj(x)
        saved_conv = None
        if saves is not None:  # the K-1 conv inputs before each boundary, as causal_conv1d keeps them
            rows, offsets = saves
            xx = jnp.concatenate([conv_state.astype(mixed.dtype), mixed], axis=1)  # [B, K-1+T, C]
            idx = offsets[:, None] + jnp.arange(conv_state.shape[1], dtype=jnp.int32)[None, :]
            saved_conv = xx[rows[:, None], idx].astype(conv_state.dtype)       # [S, K-1, C]
        qkv, conv_state = causal_conv1d(mixed, self.conv1d[...], conv_state, lengths)  # [B, T, C]
        q, k, v = jnp.split(qkv, [cfg.linear_key_dim, 2 * cfg.linear_key_dim], axis=-1)
        q = l2norm(q.reshape(B, T, nk, dk).astype(jnp.float32)) * dk**-0.5
        k = l2norm(k.reshape(B, T, nk, dk).astype(jnp.float32))
        v = v.reshape(B, T, nv, dv)
        beta = jax.nn.sigmoid(b.astype(jnp.float32))  # [B, T, Hv]
        g = -jnp.exp(self.A_log[...]) * jax.nn.softplus(a.astype(jnp.float32) + self.dt_bias[...])
        if T > 1 and kernel and rule is None and schedule == "auto" and cpu_kernels.prefill_applies(k, v):
            # the CPU kernel: token by token, each state in the core's cache, the key heads read where they lie
            # (cpu_kernels.gdn_prefill)
            o, ssm_state, *saved_ssm = cpu_kernels.gdn_prefill(q, k, v, g, beta, ssm_state, lengths, saves)
            saved = (saved_conv, *saved_ssm)  # (used only with saves)
        else:
            # value head h reads key head h // (nv / nk)
            q, k = jnp.repeat(q, nv // nk, axis=2), jnp.repeat(k, nv // nk, axis=2)
            if saves is not None:
                rows, offsets = saves
                o, ssm_state, saved_ssm = chunk_gated_delta_rule(
                    q, k, v, g, beta, initial_state=ssm_state, lengths=lengths, chunk_size=chunk_size,
                    save_chunks=(rows, jnp.maximum(offsets // chunk_size - 1, 0)), impl=schedule)  # [S, Hv, dk, dv]
                saved = (saved_conv, saved_ssm)
            else:
                if rule is None:
                    kw = {} if T == 1 else {"chunk_size": chunk_size, "impl": schedule}
                    rule = partial(recurrent_gated_delta_rule if T == 1 else chunk_gated_delta_rule,
                                   initial_state=ssm_state, lengths=lengths, **kw)
                o, ssm_state = rule(q, k, v, g, beta)  # o: [B, T, Hv, dv]
        o = self.norm(o.astype(x.dtype), z.reshape(B, T, nv, dv))
        out = self.out_proj(o.reshape(B, T, nv * dv))
        return (out, conv_state, ssm_state) if saves is None else (out, conv_state, ssm_state, saved)


def advance_in_pool(pool, src, live, warm, lengths, q, k, v, g, beta, *, layer):
    """One decode token of the gated delta rule for every row, on the states of GDN layer `layer` kept in their
    stacked pool [layers, num_slots, Hv, dk, dv]: a few rows at a time
    (`rows_per_iteration`), each reads its initial state from slot `src` (zeros where not `warm`) and writes the
    new one to its live slot in place. Returns (o [B, 1, Hv, dv], pool).

    Why a few rows at a time: XLA schedules every layer's state gather at the start of the step, so the batch's
    states of all GDN layers are live at once (256 KiB per row and layer at hidden 1024, 2 MiB at Qwen3.5-9B):
    tens of MB of temporaries (hidden 1024, float32, batch 16: 34 -> 7.5 MB, ~15% off the step). Rows are
    independent, and no row reads a slot another row writes (in a one-token step a restore source is never a live
    slot: `validate_cache_ops`), so the order does not matter.

    One row at a time (a state of 2 MiB or more, as in Qwen3.5-9B, or a batch of one) reads its state with a dynamic
    slice rather than `read_slots`' gather, which reads a padding slot besides (twice the state). The rule's output
    comes from its product with the state it read (`gated_delta.decode_token`), never from the new state, so
    nothing reads the pool after the write: XLA keeps the update in place.

    On CPU each row's new state is written by a dynamic update slice of its own that computes it (e S + k delta^T,
    from the state read and the token's gate and delta): XLA fuses that arithmetic into the write. (Elsewhere one
    scatter writes them all: a loop over the rows would cost a device round trip per row.) A scatter of the
    iteration's new states needed them materialised first, and XLA gave `where(warm, ...)` a pass of its own: 9
    passes over the states' bytes against 5 now. Hybrid-1024, bfloat16, 16 rows: 26-29 -> 24.5 ms per decode step
    (the 6 GDN layers' state updates alone: 6.9 -> 5.3 ms; 64 rows 33.5 -> 23.9 ms).

    Where the compiled CPU kernel is available (`cpu_kernels`), it does all of this instead: each state read once,
    written once, the rows' heads shared among the CPU threads (XLA's write above runs on one)."""
    if cpu_kernels.applies(pool):
        return cpu_kernels.gdn_decode(pool, src, live, warm, lengths, q, k, v, g, beta, layer)
    B = q.shape[0]
    chunk = rows_per_iteration(B, math.prod(pool.shape[2:]) * pool.dtype.itemsize, "gdn_decode")

    def rows(i, a):
        return jax.lax.dynamic_slice_in_dim(a, i * chunk, chunk)

    def read(pool, ids):
        if chunk > 1:
            return read_slots(pool, ids, layer)
        return jax.lax.dynamic_slice(pool, (layer, ids[0]) + (0,) * (pool.ndim - 2), (1, 1) + pool.shape[2:])[0]

    def body(i, carry):
        pool, o = carry
        s0 = jnp.where(rows(i, warm)[:, None, None, None], read(pool, rows(i, src)), 0.0)
        oi, e, kf, delta = decode_token(s0, *(rows(i, a) for a in (q, k, v, g, beta)), lengths=rows(i, lengths))
        ids = rows(i, live)
        o = jax.lax.dynamic_update_slice_in_dim(o, oi, i * chunk, 0)
        if jax.default_backend() != "cpu":  # one scatter (a loop over the rows costs a device round trip a turn)
            return write_rows(pool, (layer_ids(layer, ids), ids), new_state(s0, e, kf, delta)), o

        def write(r, pool):  # the row's new state, computed where it is written
            s1 = new_state(s0[r], e[r], kf[r], delta[r])
            return jax.lax.dynamic_update_slice(pool, s1[None, None], (layer, ids[r]) + (0,) * (pool.ndim - 2))

        # With the layer known (layers unrolled) and one row per iteration, XLA would inline a loop of one turn and
        # fuse the next layer's read of the pool with this write, then copy the whole pool around every layer (5
        # copies of 228 MB in hybrid-1024's one-row step, 390 ms against 12.6); a trip count it cannot fold keeps
        # the loop, as with two rows (live slots are never negative: `n` is `chunk`).
        n = chunk if not isinstance(layer, int) else jnp.where(ids[0] >= 0, chunk, 0)
        return jax.lax.fori_loop(0, n, write, pool), o

    pool, o = jax.lax.fori_loop(0, B // chunk, body, (pool, jnp.zeros(v.shape, v.dtype)))
    return o, pool


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


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs, std):
        self.cfg = cfg
        H, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qkv_proj = _fused(rngs, cfg, "self_attn", "qkv_proj", dtype, std)  # [q (per head query | gate) | k | v]
        self.o_proj = _linear(rngs, H * hd, cfg.hidden_size, dtype, std)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype)

    def project(self, x, positions):
        """x: [B, T, D], positions: [B, T] -> q [B, T, H, hd], k and v [B, T, kvh, hd] (normed, rotated), and the
        output gate [B, T, H * hd]: the projections of `__call__`, for the dense training path (gdn_jax/train.py)."""
        cfg = self.cfg
        B, T, _ = x.shape
        H, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qg, k, v = self.qkv_proj(x)
        qg = qg.reshape(B, T, H, 2 * hd)
        q, gate = self.q_norm(qg[..., :hd]), qg[..., hd:].reshape(B, T, H * hd)
        k = self.k_norm(k.reshape(B, T, kvh, hd))
        v = v.reshape(B, T, kvh, hd)
        q = rope(q, positions, cfg.rotary_dim, cfg.rope_theta)
        k = rope(k, positions, cfg.rotary_dim, cfg.rope_theta)
        return q, k, v, gate

    def __call__(self, x, k_cache, v_cache, batch: Batch, layer):
        """x: [B, T, D]; caches: [kvh, layers, NB, bs, hd] paged, of which this layer's is [:, layer]
        -> (out, k_cache, v_cache): `project_write`, then `attend` over each row's keys up to its last token."""
        q, gate, k_cache, v_cache = self.project_write(x, k_cache, v_cache, batch, layer)
        out = self.attend(q, gate, k_cache, v_cache, layer, batch.positions, batch.block_tables,
                          batch.start_pos + batch.lengths)
        return out, k_cache, v_cache

    def project_write(self, x, k_cache, v_cache, batch: Batch, layer):
        """x: [B, T, D] -> (q [B, T, H, hd] normed and rotated, output gate [B, T, H * hd], caches with the chunk's
        keys and values written)."""
        cfg = self.cfg
        B, T, _ = x.shape
        H, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qg, k, v = self.qkv_proj(x)
        qg = qg.reshape(B, T, H, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(B, T, H * hd)
        q = self.q_norm(q)
        k = self.k_norm(k.reshape(B, T, kvh, hd))
        v = v.reshape(B, T, kvh, hd)
        q = rope(q, batch.positions, cfg.rotary_dim, cfg.rope_theta)
        k = rope(k, batch.positions, cfg.rotary_dim, cfg.rope_theta)
        bs = k_cache.shape[3]
        flat = batch.slot_mapping.reshape(-1)
        at = (layer_ids(layer, flat), flat // bs, flat % bs)  # (layer, block, offset) per token
        k_cache = write_rows(k_cache, at, k.reshape(B * T, kvh, hd), axis=1)
        v_cache = write_rows(v_cache, at, v.reshape(B * T, kvh, hd), axis=1)
        return q, gate, k_cache, v_cache

    def attend(self, q, gate, k_cache, v_cache, layer, positions, block_tables, extent):
        """The attention output [B, T, D] of queries q [B, T, H, hd] at `positions` [B, T] over the cached keys
        (causal: a query sees the keys at its position and before), through the output gate and projection. `extent`
        [B]: the keys a row's queries reach at most (start + length), which bounds the chunks read.

        Each row attends to its keys in chunks of `kv_chunk_keys(T)` (an online softmax), as many chunks as the
        longest row of the batch needs: the block tables' width (padding blocks) costs nothing. A long chunk's
        queries go in tiles (`query_tiles`), each over the key chunks up to its last query only. The caches are
        head-major so that a row's gathered keys, [kvh, S, hd], have the matmuls' batch axis (kv head) in front: the
        products read them as they are gathered, with no transposed copy. One query per row on the CPU backend runs
        the compiled kernel instead (`cpu_kernels.attention_decode`: the keys and values read in place, no gathered
        copy) where it is available."""
        cfg = self.cfg
        B, T = q.shape[:2]
        H, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        dtype = gate.dtype
        if T == 1 and cpu_kernels.attention_applies(k_cache, H):  # one query per row on CPU: the compiled kernel
            out = cpu_kernels.attention_decode(k_cache, v_cache, layer, q[:, 0], block_tables, positions[:, 0] + 1)
            return self.gated_output(out.astype(dtype).reshape(B, T, H * hd), gate)
        bs = k_cache.shape[3]
        g = H // kvh  # per (row, kv head) one matmul over its g * Tq queries
        NB = block_tables.shape[1]
        cb = max(1, min(NB, kv_chunk_keys(T) // bs))  # blocks per chunk
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
            def chunk(c, carry):  # keys [c * cb * bs, (c + 1) * cb * bs)
                top, total, acc = carry  # running max [kvh, gTq], sum of exp [kvh, gTq], output [kvh, gTq, hd]
                blocks = jax.lax.dynamic_slice_in_dim(table, c * cb, cb)
                keys = from_pool(k_cache[:, layer, blocks], dtype).reshape(kvh, cb * bs, hd)
                values = from_pool(v_cache[:, layer, blocks], dtype).reshape(kvh, cb * bs, hd)
                scores = attention_scores(qh, keys) * hd**-0.5
                causal = c * cb * bs + jnp.arange(cb * bs)[None, :] <= qpos[:, None]  # [gTq, cb * bs]
                scores = jnp.where(causal[None], scores, -jnp.inf)
                new_top = jnp.maximum(top, jnp.max(scores, axis=-1))  # finite: key 0 is in every query's reach
                p = jnp.exp(scores - new_top[..., None])
                scale = jnp.exp(top - new_top)
                pv = jnp.einsum("kqs,ksd->kqd", p.astype(dtype), values, preferred_element_type=jnp.float32,
                                precision=float32_precision(dtype))
                return new_top, total * scale + jnp.sum(p, axis=-1), acc * scale[..., None] + pv

            init = (jnp.full(qh.shape[:2], -jnp.inf, jnp.float32), jnp.zeros(qh.shape[:2], jnp.float32),
                    jnp.zeros(qh.shape, jnp.float32))
            _, total, acc = jax.lax.fori_loop(0, n, chunk, init)
            return acc / total[..., None]

        per_row = 2 * kvh * cb * bs * hd * jnp.dtype(dtype).itemsize  # the keys + values of one chunk
        rows = rows_per_iteration(B, per_row, "attention")

        def tile(a):  # one query tile of every row; its chunk count is the same for all rows (a loop, not a mask)
            qt, pt, n = a
            return jax.lax.map(lambda r: attend(*r, n), (qt, tables, pt), batch_size=rows)

        if nq == 1:  # a decode step, a short chunk: no loop over tiles
            out = tile((qh[0], qpos[0], tile_chunks[0]))[None]
        else:
            out = jax.lax.map(tile, (qh, qpos, tile_chunks))  # [nq, B, kvh, g * Tq, hd]
        out = out.astype(dtype).reshape(nq, B, kvh, g, Tq, hd).transpose(1, 0, 4, 2, 3, 5).reshape(B, T, H * hd)
        return self.gated_output(out, gate)

    def gated_output(self, out, gate):
        """The heads' outputs [B, T, H * hd] through the output gate and the output projection."""
        return self.o_proj(out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(out.dtype))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str, dtype, rngs, std):
        self.layer_type = layer_type
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if layer_type == LINEAR:
            self.linear_attn = GatedDeltaNet(cfg, dtype, rngs, std)
        else:
            self.self_attn = Attention(cfg, dtype, rngs, std)
        self.mlp = MLP(cfg, dtype, rngs, std)

    def residual(self, x, h):
        """The layer's output from its input x and its mixer's (GDN or attention) output h: both residual adds
        around the MLP."""
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


def layer_groups(layer_types) -> tuple[tuple[tuple[str, int], ...], int]:
    """The layer list as `repeats` copies of one group, the group as runs of consecutive layers of one kind:
    Qwen3.5's 3 GDN + 1 full attention, repeated -> (((LINEAR, 3), (FULL, 1)), layers / 4). The group is the
    shortest one that repeats to the whole list; a list with none (say G G A G) is a single group of its runs."""
    types, n = tuple(layer_types), len(layer_types)
    p = next(p for p in range(1, n + 1) if n % p == 0 and types[:p] * (n // p) == types)
    return tuple((kind, len(list(run))) for kind, run in itertools.groupby(types[:p])), n // p


UNROLL_ENV = "GDN_JAX_UNROLL_LAYERS"  # "1": every step's layers unrolled, "decode": one-token steps', unset or "0": none


def unroll_layers(tokens: int) -> bool:
    """Whether a step of `tokens` tokens per row traces every layer with its index known, with no layer loop and no
    switch over the layers' matrices (`Qwen35Model.scan_layers`), as `UNROLL_ENV` says: "1" every step, "decode" the
    one-token steps only, unset or "0" none (the default). For comparisons: XLA's GPU runtime reads each conditional's
    branch index back to the host, and unrolled layers have none, but compile in about twice the time; a decode
    shape compiles faster than a prefill one (docs/design.md, "On a GPU")."""
    env = os.environ.get(UNROLL_ENV, "").strip()
    if env not in ("", "0", "1", "decode"):
        raise ValueError(f"{UNROLL_ENV} must be 1, decode or 0 (unset: 0), got {env!r}")
    return env == "1" or (env == "decode" and tokens == 1)


def _repeat(n: int, body, carry, unroll: bool = False):
    """carry = body(i, carry) for i in range(n): a loop (its body compiled once), a plain call when n == 1; unrolled
    (every layer traced with its index known) when `unroll`."""
    if unroll:
        for i in range(n):
            carry = body(i, carry)
        return carry
    return body(0, carry) if n == 1 else jax.lax.fori_loop(0, n, body, carry)


class Qwen35Model(nnx.Module):
    """Qwen3_5ForCausalLM: embeddings, hybrid decoder layers, final norm, lm_head (tied or not)."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs, std: float = 0.02):
        self.cfg = cfg
        self.embed_tokens = nnx.Param(jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size), dtype) * std)
        self.layers = nnx.List([DecoderLayer(cfg, t, dtype, rngs, std) for t in cfg.layer_types])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = _linear(rngs, cfg.hidden_size, cfg.vocab_size, dtype, std)

    def scan_layers(self, carry, linear, full, unroll: bool = False):
        """Runs the decoder layers in order on `carry`: `linear(layer, j, carry) -> carry` for the j-th GDN layer,
        `full(layer, j, carry)` for the j-th full-attention layer, where `layer` is a `DecoderLayer` with that
        layer's parameters and j (an int32 scalar, or an int) indexes its kind's stacked pools (`DeviceState`).

        The layers run under loops, one over the repeats of the layer group (`layer_groups`) and inside it one per
        run of same-kind layers, so a step compiles one GDN and one full-attention layer whatever the depth
        (Qwen3.5-9B's 32 layers compile as 2). In the loop body `layer` holds, for each projection matrix, a
        `LayerKernel` (every layer's matrix, each in its own buffer; `dense` multiplies by the loop's layer's), and
        the loop's layer's small parameters (norms, conv taps, gates), picked together by one switch. With `unroll`
        (`unroll_layers`) every layer is traced in turn with its index known: no loop and no switch."""
        runs, repeats = layer_groups(self.cfg.layer_types)
        fns = {LINEAR: linear, FULL: full}
        kinds = {}  # kind -> (graphdef, treedef of its state, per leaf: the tuple of every layer's array)
        for kind in (LINEAR, FULL):
            layers = [layer for layer in self.layers if layer.layer_type == kind]
            if layers:
                paths, treedef = jax.tree_util.tree_flatten_with_path(nnx.state(layers[0]))
                leaves = zip(*(jax.tree.leaves(nnx.state(layer)) for layer in layers))
                kinds[kind] = (nnx.graphdef(layers[0]), treedef,
                               [(jax.tree_util.DictKey("kernel") in path, arrays)
                                for (path, _), arrays in zip(paths, leaves)])

        def layer_at(kind, j):
            graphdef, treedef, leaves = kinds[kind]
            small = [arrays for is_kernel, arrays in leaves if not is_kernel]
            per_layer = list(zip(*small))  # per layer, the tuple of its small parameters
            picked = iter(per_layer[j] if isinstance(j, int) else
                          jax.lax.switch(j, [partial(_identity, arrays) for arrays in per_layer]))
            return nnx.merge(graphdef, jax.tree_util.tree_unflatten(
                treedef, [LayerKernel(arrays, j) if is_kernel else next(picked) for is_kernel, arrays in leaves]))

        def group(g, carry):
            seen = dict.fromkeys(kinds, 0)
            for kind, n in runs:
                per_group = sum(m for k, m in runs if k == kind)
                base = g * per_group + seen[kind]
                seen[kind] += n
                carry = _repeat(n, lambda i, c, kind=kind, base=base: fns[kind](layer_at(kind, base + i),
                                                                               base + i, c), carry, unroll)
            return carry

        return _repeat(repeats, group, carry, unroll)

    def __call__(self, batch: Batch, state: DeviceState, all_logits: bool = False, chunk_size: int | None = None,
                 gdn_schedule: str = "auto"):
        """`gdn_schedule`: the chunked GDN rule's schedule ("auto", "fused", "parallel"; same maths).
        `chunk_size`: the chunked GDN rule's (a divisor of the engine's chunk_stride, so that every checkpoint
        boundary is a chunk boundary of a row's scan; None: `gated_delta.default_chunk_size()`)."""
        x = self.embed_tokens[...][batch.tokens]  # [B, T, D]
        warm = batch.has_initial_state
        ids = batch.linear_state_ids
        src = ids if batch.initial_state_ids is None else batch.initial_state_ids

        T = batch.tokens.shape[1]
        last = jnp.maximum(batch.lengths - 1, 0)  # each row's last real token

        def at_last(a):  # [B, T, ...] -> [B, ...] at each row's last token
            return jnp.take_along_axis(a, last.reshape((-1,) + (1,) * (a.ndim - 1)), axis=1)[:, 0]

        # A step that samples needs the last layer's output at each row's last token only: there that layer's loop
        # turn computes what every position needs (its keys and values, its GDN state), keeps the rest of its inputs
        # at those tokens (`pending`), and `last_layer_tail` finishes one row each after the loop.
        defer = not all_logits and T > 1
        last_kind, last_j = self.cfg.layer_types[-1], self.cfg.layer_types.count(self.cfg.layer_types[-1]) - 1

        def tail(kind, j, whole, at_tokens, x, pending):
            """(x, pending) after a layer: (whole(), pending) for any layer but the last of a deferring step,
            (x, at_tokens()) for that one; by a switch on j where the loop's layer is traced."""
            if not defer or kind != last_kind:
                return whole(), pending
            if isinstance(j, int):
                return (x, at_tokens()) if j == last_j else (whole(), pending)
            return jax.lax.cond(j == last_j, lambda: (x, at_tokens()), lambda: (whole(), pending))

        pending = ()
        if defer:
            B, cfg = batch.tokens.shape[0], self.cfg
            pending = (jnp.zeros((B, cfg.hidden_size), x.dtype),) + (
                (jnp.zeros((B, cfg.hidden_size), x.dtype),) if last_kind == LINEAR else
                (jnp.zeros((B, cfg.num_attention_heads, cfg.head_dim), x.dtype),
                 jnp.zeros((B, cfg.num_attention_heads * cfg.head_dim), x.dtype)))

        def linear(layer, j, carry):
            x, st, pending = carry
            h = layer.input_layernorm(x)
            conv_in = jnp.where(warm[:, None, None], from_pool(read_slots(st.conv, src, j), x.dtype), 0)
            slots = ids
            if batch.tokens.shape[1] == 1:  # decode: the states advance in their pool
                rule = partial(advance_in_pool, st.ssm, src, ids, warm, batch.lengths, layer=j)
                h, conv_out, ssm = layer.linear_attn(h, conv_in, None, batch.lengths, rule=rule)
            else:
                ssm_in = jnp.where(warm[:, None, None, None], read_slots(st.ssm, src, j), 0.0)
                if batch.save_slots is None:
                    h, conv_out, ssm_out = layer.linear_attn(h, conv_in, ssm_in, batch.lengths, chunk_size,
                                                                     schedule=gdn_schedule)
                else:  # also the checkpoints at the listed boundaries, written with the live slots at once
                    h, conv_out, ssm_out, (conv_sv, ssm_sv) = layer.linear_attn(
                        h, conv_in, ssm_in, batch.lengths, chunk_size, saves=(batch.save_rows, batch.save_offsets),
                        schedule=gdn_schedule)
                    slots = jnp.concatenate([ids, batch.save_slots])
                    conv_out, ssm_out = jnp.concatenate([conv_out, conv_sv]), jnp.concatenate([ssm_out, ssm_sv])
                ssm = write_rows(st.ssm, (layer_ids(j, slots), slots), ssm_out)
            conv = write_rows(st.conv, (layer_ids(j, slots), slots), conv_out)
            x, pending = tail(LINEAR, j, lambda: layer.residual(x, h), lambda: (at_last(x), at_last(h)), x, pending)
            return x, dataclasses.replace(st, conv=conv, ssm=ssm), pending

        def full(layer, j, carry):
            x, st, pending = carry
            q, gate, k, v = layer.self_attn.project_write(layer.input_layernorm(x), st.k, st.v, batch, j)
            x, pending = tail(FULL, j, lambda: layer.residual(x, layer.self_attn.attend(
                q, gate, k, v, j, batch.positions, batch.block_tables, batch.start_pos + batch.lengths)),
                              lambda: (at_last(x), at_last(q), at_last(gate)), x, pending)
            return x, dataclasses.replace(st, k=k, v=v), pending

        x, state, pending = self.scan_layers((x, state, pending), linear, full, unroll=unroll_layers(T))
        if defer:
            x = self.last_layer_tail(pending, state, batch, last, last_j)
        elif not all_logits:  # hidden state of each row's last real token
            x = at_last(x)
        return self.logits(x), state

    def last_layer_tail(self, pending, state: DeviceState, batch: Batch, last, j: int):
        """The last layer's output [B, D] at each row's last token `last` [B], from what its loop turn left
        (`pending`: the layer's input there, and the GDN mixer's output or the attention's query and gate there): the
        attention of those queries, the output projection and the MLP, one row each. `j`: the layer's index among
        its kind's layers (its pools')."""
        layer, kind = self.layers[-1], self.cfg.layer_types[-1]
        if kind == LINEAR:
            x, h = pending
        else:
            x, q, gate = pending
            position = batch.start_pos + last
            h = layer.self_attn.attend(q[:, None], gate[:, None], state.k, state.v, j, position[:, None],
                                       batch.block_tables, position + 1)[:, 0]
        return layer.residual(x, h)

    def logits(self, x):
        """Final norm and LM head (tied or not): hidden [..., D] -> float32 logits [..., V]."""
        head = self.embed_tokens if self.cfg.tie_word_embeddings else self.lm_head.kernel
        return dense(self.norm(x), head[...])


def forward(graphdef, params, batch: Batch, state: DeviceState, all_logits: bool = False,
            chunk_size: int | None = None, gdn_schedule: str = "auto"):
    """Pure forward: (graphdef, params, batch, state) -> (logits [B, V] or [B, T, V] float32, new state)."""
    model = nnx.merge(graphdef, params)
    return model(batch, state, all_logits=all_logits, chunk_size=chunk_size, gdn_schedule=gdn_schedule)


def init_model(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32):
    """Deterministic random model; returns (graphdef, params). Norm weights are perturbed so that a
    `(1 + w)` vs `w` mistake shows."""
    model = Qwen35Model(cfg, dtype=dtype, rngs=nnx.Rngs(seed), std=0.05)
    key = jax.random.PRNGKey(seed + 1)
    for path, p in nnx.iter_graph(model):
        if isinstance(p, (RMSNorm, GatedRMSNorm)):
            key, sub = jax.random.split(key)
            base = 1.0 if isinstance(p, GatedRMSNorm) else 0.0
            p.weight[...] = (base + 0.2 * jax.random.normal(sub, p.weight.shape)).astype(dtype)
    return nnx.split(model)
