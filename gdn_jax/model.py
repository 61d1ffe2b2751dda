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
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdn_jax.config import LINEAR, ModelConfig
from gdn_jax.gated_delta import causal_conv1d, chunk_gated_delta_rule, l2norm, recurrent_gated_delta_rule


@partial(jax.tree_util.register_dataclass, data_fields=[
    "tokens", "start_pos", "lengths", "block_tables", "slot_mapping", "linear_ids", "has_initial_state",
    "initial_state_ids", "save_rows", "save_offsets", "save_slots",
], meta_fields=[])
@dataclasses.dataclass
class Batch:
    tokens: jax.Array             # [B, T] int32
    start_pos: jax.Array          # [B] int32, absolute position of tokens[:, 0]
    lengths: jax.Array            # [B] int32, real tokens per row (0 for a padding row)
    block_tables: jax.Array       # [B, NB] int32 KV block ids (0 = padding block)
    slot_mapping: jax.Array       # [B, T] int32 flat KV slot per token (padding tokens -> block 0)
    linear_ids: jax.Array         # [B] int32 live linear-state slot per row (0 = padding slot)
    has_initial_state: jax.Array  # [B] bool, False: the GDN state starts from zeros whatever the slot holds
    # [B] int32 slot each row's initial GDN state is read from: a restore's source, or the live slot itself
    # (None: linear_ids). The new state is always written to linear_ids, so a restore is a copy, never a move.
    initial_state_ids: jax.Array | None = None
    # Checkpoints the step writes (checkpoint_mode "scan"), [S] int32 each: the GDN state of row save_rows[s] after
    # save_offsets[s] of its tokens (a multiple of the chunked rule's chunk size) goes to slot save_slots[s], in every
    # GDN layer. Padding entries write slot 0. None: no saves in this step shape.
    save_rows: jax.Array | None = None
    save_offsets: jax.Array | None = None
    save_slots: jax.Array | None = None


@partial(jax.tree_util.register_dataclass, data_fields=["k", "v", "conv", "ssm"], meta_fields=[])
@dataclasses.dataclass
class DeviceState:
    k: tuple[jax.Array, ...]      # per full-attention layer [kv_heads, num_blocks, block_size, head_dim]
    v: tuple[jax.Array, ...]
    conv: tuple[jax.Array, ...]   # per GDN layer [num_slots, kernel - 1, conv_dim] (activation dtype, see pool_dtype)
    ssm: tuple[jax.Array, ...]    # per GDN layer [num_slots, Hv, dk, dv] float32


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
    kv_shape = (cfg.num_key_value_heads, num_blocks, block_size, cfg.head_dim)  # head-major: see Attention
    n_full, n_lin = len(cfg.full_layer_ids), len(cfg.linear_layer_ids)
    conv_shape = (num_slots, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim)
    ssm_shape = (num_slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    store = pool_dtype(dtype)
    return DeviceState(
        k=tuple(jnp.zeros(kv_shape, store) for _ in range(n_full)),
        v=tuple(jnp.zeros(kv_shape, store) for _ in range(n_full)),
        conv=tuple(jnp.zeros(conv_shape, store) for _ in range(n_lin)),
        ssm=tuple(jnp.zeros(ssm_shape, jnp.float32) for _ in range(n_lin)),
    )


def read_slots(pool, ids):
    """pool [num_slots, ...] -> pool[ids] [B, ...], gathered with one extra (padding) index.

    XLA turns a one-index gather into a dynamic slice and fuses that copy into every consumer: then the GDN
    output reads the pool after the slot's write was issued, and XLA copies the whole pool to keep the old
    contents. A gather of two or more indices is computed once, so only it reads the pool, before the write."""
    return pool[jnp.concatenate([ids, jnp.zeros((1,), ids.dtype)])][:-1]


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


def dense(x, kernel, spec: str = "...d,dv->...v"):
    """x [..., n_in] @ kernel [n_in, n_out] (or [n_out, n_in] with spec "...d,vd->...v") -> [..., n_out] float32,
    accumulated in float32.

    On CPU a single bfloat16 row is duplicated into two: XLA's CPU backend has no bfloat16 matrix-vector kernel and
    multiplies one row by first converting the whole weight to float32, on every call (~10x the bandwidth bound on
    the development machine), while two or more rows take its library GEMM path, which reads the bfloat16 weight as
    it is. (The engine's single-row decode step goes further: see `Worker`'s float32_decode_weights.) Elsewhere
    (GPU, float32) the product is left alone."""
    lead = x.shape[:-1]
    if x.dtype == jnp.bfloat16 and kernel.dtype == jnp.bfloat16 and math.prod(lead) == 1 \
            and jax.default_backend() == "cpu":
        pair = jnp.broadcast_to(x.reshape(1, -1), (2, x.shape[-1]))
        return jnp.einsum(spec, pair, kernel, preferred_element_type=jnp.float32)[:1].reshape(*lead, -1)
    return jnp.einsum(spec, x, kernel, preferred_element_type=jnp.float32)


class Linear(nnx.Linear):
    """Bias-free projection accumulating in float32 (the fast bfloat16 path on CPU AMX and GPU tensor cores),
    returning the activation dtype."""

    def __call__(self, x):
        return dense(x.astype(self.dtype), self.kernel[...]).astype(self.dtype)


def _linear(rngs, n_in, n_out, dtype, std):
    return Linear(n_in, n_out, use_bias=False, dtype=dtype, param_dtype=dtype, preferred_element_type=jnp.float32,
                  kernel_init=nnx.initializers.normal(std), rngs=rngs)


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
        self.gate_proj = _linear(rngs, cfg.hidden_size, cfg.intermediate_size, dtype, std)
        self.up_proj = _linear(rngs, cfg.hidden_size, cfg.intermediate_size, dtype, std)
        self.down_proj = _linear(rngs, cfg.intermediate_size, cfg.hidden_size, dtype, std)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class GatedDeltaNet(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs, std):
        self.cfg = cfg
        nv, K = cfg.linear_num_value_heads, cfg.linear_conv_kernel_dim
        self.in_proj_qkv = _linear(rngs, cfg.hidden_size, cfg.conv_dim, dtype, std)
        self.in_proj_z = _linear(rngs, cfg.hidden_size, cfg.linear_value_dim, dtype, std)
        self.in_proj_b = _linear(rngs, cfg.hidden_size, nv, dtype, std)
        self.in_proj_a = _linear(rngs, cfg.hidden_size, nv, dtype, std)
        self.conv1d = nnx.Param(jax.random.normal(rngs.params(), (cfg.conv_dim, K), dtype) * 0.3)  # [C, K]
        self.dt_bias = nnx.Param(jnp.ones((nv,), jnp.float32))
        # Mild decay by default (exp(A_log) in [0.01, 0.3]) so the state carries information over many tokens.
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (nv,), jnp.float32, 0.01, 0.3)))
        self.norm = GatedRMSNorm(cfg.linear_value_head_dim, cfg.rms_norm_eps, dtype)
        self.out_proj = _linear(rngs, cfg.linear_value_dim, cfg.hidden_size, dtype, std)

    def __call__(self, x, conv_state, ssm_state, lengths, chunk_size: int = 64, rule=None, saves=None):
        """x: [B, T, D]; conv_state: [B, K-1, C]; ssm_state: [B, Hv, dk, dv] -> (out, conv_state, ssm_state).
        `chunk_size` of the chunked rule (same maths; training on CPU runs fastest with 32). `rule`, if given,
        replaces the gated delta rule and the ssm_state argument: (q, k, v, g, beta) -> (o, new ssm state); the
        engine's decode step passes one that advances the states inside their pool. `saves` = (rows, offsets), [S]
        each, offsets multiples of `chunk_size`: also returns the states after those tokens of those rows, (conv
        [S, K-1, C], ssm [S, Hv, dk, dv]), from the chunked scan's chunk-boundary states."""
        cfg = self.cfg
        B, T, _ = x.shape
        nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        mixed = self.in_proj_qkv(x)
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
        q, k = jnp.repeat(q, nv // nk, axis=2), jnp.repeat(k, nv // nk, axis=2)  # value head h -> key head h // (nv/nk)
        v = v.reshape(B, T, nv, dv)
        beta = jax.nn.sigmoid(self.in_proj_b(x).astype(jnp.float32))  # [B, T, Hv]
        g = -jnp.exp(self.A_log[...]) * jax.nn.softplus(self.in_proj_a(x).astype(jnp.float32) + self.dt_bias[...])
        if saves is not None:
            o, ssm_state, chunk_states = chunk_gated_delta_rule(
                q, k, v, g, beta, initial_state=ssm_state, lengths=lengths, chunk_size=chunk_size,
                output_chunk_states=True)                                       # [B, N, Hv, dk, dv]
            rows, offsets = saves
            saved = (saved_conv, chunk_states[rows, jnp.maximum(offsets // chunk_size - 1, 0)])
        else:
            if rule is None:
                kw = {} if T == 1 else {"chunk_size": chunk_size}
                rule = partial(recurrent_gated_delta_rule if T == 1 else chunk_gated_delta_rule,
                               initial_state=ssm_state, lengths=lengths, **kw)
            o, ssm_state = rule(q, k, v, g, beta)  # o: [B, T, Hv, dv]
        o = self.norm(o.astype(x.dtype), self.in_proj_z(x).reshape(B, T, nv, dv))
        out = self.out_proj(o.reshape(B, T, nv * dv))
        return (out, conv_state, ssm_state) if saves is None else (out, conv_state, ssm_state, saved)


def advance_in_pool(pool, src, live, warm, lengths, q, k, v, g, beta):
    """One decode token of the gated delta rule for every row, on states kept in their pool: a few rows at a time
    (`rows_per_iteration`), each reads its initial state from slot `src` (zeros where not `warm`) and writes the
    new one to its live slot in place. Returns (o [B, 1, Hv, dv], pool).

    Why a few rows at a time: XLA schedules every layer's state gather at the start of the step, so the batch's
    states of all GDN layers are live at once (256 KiB per row and layer at hidden 1024, 2 MiB at Qwen3.5-9B):
    tens of MB of temporaries (hidden 1024, float32, batch 16: 34 -> 7.5 MB, ~15% off the step). Rows are
    independent, and no row reads a slot another row writes (in a one-token step a restore source is never a live
    slot: `validate_cache_ops`), so the order does not matter."""
    B = q.shape[0]
    chunk = rows_per_iteration(B, pool[0].nbytes, "gdn_decode")

    def rows(i, a):
        return jax.lax.dynamic_slice_in_dim(a, i * chunk, chunk)

    def body(i, carry):
        pool, o = carry
        s0 = jnp.where(rows(i, warm)[:, None, None, None], read_slots(pool, rows(i, src)), 0.0)
        oi, s1 = recurrent_gated_delta_rule(*(rows(i, a) for a in (q, k, v, g, beta)), initial_state=s0,
                                            lengths=rows(i, lengths))
        return write_rows(pool, (rows(i, live),), s1), jax.lax.dynamic_update_slice_in_dim(o, oi, i * chunk, 0)

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
        self.q_proj = _linear(rngs, cfg.hidden_size, H * hd * 2, dtype, std)  # per head [query | gate]
        self.k_proj = _linear(rngs, cfg.hidden_size, kvh * hd, dtype, std)
        self.v_proj = _linear(rngs, cfg.hidden_size, kvh * hd, dtype, std)
        self.o_proj = _linear(rngs, H * hd, cfg.hidden_size, dtype, std)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype)

    def project(self, x, positions):
        """x: [B, T, D], positions: [B, T] -> q [B, T, H, hd], k and v [B, T, kvh, hd] (normed, rotated), and the
        output gate [B, T, H * hd]: the projections of `__call__`, for the dense training path (gdn_jax/train.py)."""
        cfg = self.cfg
        B, T, _ = x.shape
        H, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qg = self.q_proj(x).reshape(B, T, H, 2 * hd)
        q, gate = self.q_norm(qg[..., :hd]), qg[..., hd:].reshape(B, T, H * hd)
        k = self.k_norm(self.k_proj(x).reshape(B, T, kvh, hd))
        v = self.v_proj(x).reshape(B, T, kvh, hd)
        q = rope(q, positions, cfg.rotary_dim, cfg.rope_theta)
        k = rope(k, positions, cfg.rotary_dim, cfg.rope_theta)
        return q, k, v, gate

    def __call__(self, x, k_cache, v_cache, batch: Batch):
        """x: [B, T, D]; caches: [kvh, NB, bs, hd] paged -> (out, k_cache, v_cache).

        The caches are head-major so that a row's gathered prefix, [kvh, S, hd], has the matmuls' batch axis (kv
        head) in front: the products read it as it is gathered, with no transposed copy."""
        cfg = self.cfg
        B, T, _ = x.shape
        H, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qg = self.q_proj(x).reshape(B, T, H, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(B, T, H * hd)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).reshape(B, T, kvh, hd))
        v = self.v_proj(x).reshape(B, T, kvh, hd)
        positions = batch.start_pos[:, None] + jnp.arange(T)[None, :]  # [B, T]
        q = rope(q, positions, cfg.rotary_dim, cfg.rope_theta)
        k = rope(k, positions, cfg.rotary_dim, cfg.rope_theta)

        # write this chunk's K/V into the paged cache, then read each row's whole prefix back
        bs = k_cache.shape[2]
        flat = batch.slot_mapping.reshape(-1)
        at = (flat // bs, flat % bs)  # (block, offset) per token
        k_cache = write_rows(k_cache, at, k.reshape(B * T, kvh, hd), axis=1)
        v_cache = write_rows(v_cache, at, v.reshape(B * T, kvh, hd), axis=1)
        g = H // kvh  # per (row, kv head) one matmul over its g * T queries
        qh = q.reshape(B, T, kvh, g, hd).transpose(0, 2, 3, 1, 4).reshape(B, kvh, g * T, hd)
        qpos = jnp.tile(positions, (1, g))  # [B, g*T]

        def attend(qh, table, qpos):  # one row: [kvh, gT, hd], [NB], [gT] -> [kvh, gT, hd]
            S = table.shape[0] * bs
            keys = from_pool(k_cache[:, table], x.dtype).reshape(kvh, S, hd)
            values = from_pool(v_cache[:, table], x.dtype).reshape(kvh, S, hd)
            scores = jnp.einsum("kqd,ksd->kqs", qh, keys, preferred_element_type=jnp.float32) * hd**-0.5
            causal = jnp.arange(S)[None, :] <= qpos[:, None]  # [gT, S]
            probs = jax.nn.softmax(jnp.where(causal[None], scores, -jnp.inf), axis=-1).astype(x.dtype)
            return jnp.einsum("kqs,ksd->kqd", probs, values, preferred_element_type=jnp.float32)

        per_row = 2 * kvh * batch.block_tables.shape[1] * bs * hd * jnp.dtype(x.dtype).itemsize  # its keys + values
        out = jax.lax.map(lambda a: attend(*a), (qh, batch.block_tables, qpos),
                          batch_size=rows_per_iteration(B, per_row, "attention"))
        out = out.astype(x.dtype).reshape(B, kvh, g, T, hd).transpose(0, 3, 1, 2, 4).reshape(B, T, H * hd)
        out = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(x.dtype)
        return self.o_proj(out), k_cache, v_cache


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


class Qwen35Model(nnx.Module):
    """Qwen3_5ForCausalLM: embeddings, hybrid decoder layers, final norm, lm_head (tied or not)."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs, std: float = 0.02):
        self.cfg = cfg
        self.embed_tokens = nnx.Param(jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size), dtype) * std)
        self.layers = nnx.List([DecoderLayer(cfg, t, dtype, rngs, std) for t in cfg.layer_types])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = _linear(rngs, cfg.hidden_size, cfg.vocab_size, dtype, std)

    def __call__(self, batch: Batch, state: DeviceState, all_logits: bool = False, chunk_size: int = 64):
        """`chunk_size`: the chunked GDN rule's (a divisor of the engine's chunk_stride, so that every checkpoint
        boundary is a chunk boundary of a row's scan)."""
        cfg = self.cfg
        x = self.embed_tokens[...][batch.tokens]  # [B, T, D]
        ks, vs, convs, ssms = list(state.k), list(state.v), list(state.conv), list(state.ssm)
        warm = batch.has_initial_state
        ids = batch.linear_ids
        src = ids if batch.initial_state_ids is None else batch.initial_state_ids
        i_full = i_lin = 0
        for layer in self.layers:
            h = layer.input_layernorm(x)
            if layer.layer_type == LINEAR:
                conv_in = jnp.where(warm[:, None, None], from_pool(read_slots(convs[i_lin], src), x.dtype), 0)
                slots = ids
                if batch.tokens.shape[1] == 1:  # decode: the states advance in their pool
                    rule = partial(advance_in_pool, ssms[i_lin], src, ids, warm, batch.lengths)
                    h, conv_out, ssms[i_lin] = layer.linear_attn(h, conv_in, None, batch.lengths, rule=rule)
                else:
                    ssm_in = jnp.where(warm[:, None, None, None], read_slots(ssms[i_lin], src), 0.0)
                    if batch.save_slots is None:
                        h, conv_out, ssm_out = layer.linear_attn(h, conv_in, ssm_in, batch.lengths, chunk_size)
                    else:  # also the checkpoints at the listed boundaries, written with the live slots at once
                        h, conv_out, ssm_out, (conv_sv, ssm_sv) = layer.linear_attn(
                            h, conv_in, ssm_in, batch.lengths, chunk_size, saves=(batch.save_rows, batch.save_offsets))
                        slots = jnp.concatenate([ids, batch.save_slots])
                        conv_out, ssm_out = jnp.concatenate([conv_out, conv_sv]), jnp.concatenate([ssm_out, ssm_sv])
                    ssms[i_lin] = write_rows(ssms[i_lin], (slots,), ssm_out)
                convs[i_lin] = write_rows(convs[i_lin], (slots,), conv_out)
                i_lin += 1
            else:
                h, ks[i_full], vs[i_full] = layer.self_attn(h, ks[i_full], vs[i_full], batch)
                i_full += 1
            x = x + h
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        if not all_logits:  # hidden state of each row's last real token
            last = jnp.maximum(batch.lengths - 1, 0)
            x = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]  # [B, D]
        x = self.norm(x)
        if cfg.tie_word_embeddings:
            logits = dense(x, self.embed_tokens[...], "...d,vd->...v")
        else:
            logits = dense(x, self.lm_head.kernel[...])
        return logits, DeviceState(tuple(ks), tuple(vs), tuple(convs), tuple(ssms))

    def logits(self, x):
        """Final norm and LM head (tied or not): hidden [..., D] -> float32 logits [..., V]."""
        x = self.norm(x)
        if self.cfg.tie_word_embeddings:
            return jnp.einsum("...d,vd->...v", x, self.embed_tokens[...], preferred_element_type=jnp.float32)
        return jnp.einsum("...d,dv->...v", x, self.lm_head.kernel[...], preferred_element_type=jnp.float32)


def forward(graphdef, params, batch: Batch, state: DeviceState, all_logits: bool = False, chunk_size: int = 64):
    """Pure forward: (graphdef, params, batch, state) -> (logits [B, V] or [B, T, V] float32, new state)."""
    model = nnx.merge(graphdef, params)
    return model(batch, state, all_logits=all_logits, chunk_size=chunk_size)


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
