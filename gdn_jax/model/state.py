"""Device state: the KV and linear-state pools, the step's `Batch`, and the restore of checkpoints into live
slots.

The modules hold parameters only. The recurrent and KV state lives outside them in `DeviceState`, so a jitted
step can take it as a donated argument: `forward(graphdef, params, batch, state) -> (logits, state)`.

Donation holds (XLA updates the pools in place and never copies one) as long as, within a step, every read of a
pool's old contents is ordered before its write by data dependence. So a KV pool is written first and read after
(attention reads the updated pool), and a GDN pool is read by one gather whose result feeds the write (see
`read_slots`); scatters promise in-bounds indices (the host validates them), since an out-of-bounds check reads
the pool too. `tests/gdn_jax/test_donation.py` checks every compiled step shape.

`restore_sources` turns the ops into the slot each row's initial state is read from and its `has_initial_state`
flag. The worker's step folds the restore into the forward's read of the initial state: a restoring row reads its
source slot, and its new state is written to its live slot, so the live slot ends up with its own copy, advanced by
the step's tokens; a row that restores nothing reads its own live slot and costs nothing extra (no self-copy of
every slot, every step). `restore_linear_state_slots` is the same copy as a standalone pure function.
`validate_cache_ops` is the host-side gate that fails closed.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from gdn_jax.config import ModelConfig


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
    n_full, n_lin = cfg.num_kv_layers, len(cfg.linear_layer_ids)
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




def validate_cache_ops(ops, num_slots: int, in_place: bool = False) -> None:
    """Rejects, before dispatch, any op whose live or source slot is out of range or the padding slot 0, two ops
    advancing one live slot, a restore from a slot this step also restores into, and, when the step advances the
    states `in_place` (one token per row), a restore from a slot that a row of the same step advances (rows are read
    and written in any order, so that read could see the slot before or after its write)."""
    for i, op in enumerate(ops):
        if not 1 <= op.linear_state_id < num_slots:
            raise ValueError(f"op {i}: linear_state_id {op.linear_state_id} outside [1, {num_slots})")
        if op.restore_requested and op.restore_src_slot_id != -1:
            if not 1 <= op.restore_src_slot_id < num_slots:
                raise ValueError(f"op {i}: restore_src_slot_id {op.restore_src_slot_id} outside [1, {num_slots})")
            if op.restore_src_slot_id == op.linear_state_id:
                raise ValueError(f"op {i}: restore source and live slot are both {op.linear_state_id}")
    linear_state_ids = {op.linear_state_id for op in ops}  # a set: the one-token check below looks up every row
    if len(linear_state_ids) != len(ops):
        raise ValueError(f"two ops advance the same live slot: {sorted(op.linear_state_id for op in ops)}")
    # every copy reads the pools as they were before the step: a source that this step also restores into would
    # hand over its stale content
    targets = {op.linear_state_id for op in ops if op.restore_requested and op.restore_src_slot_id != -1}
    for i, op in enumerate(ops):
        if op.restore_requested and op.restore_src_slot_id in targets:
            raise ValueError(f"op {i}: restore source {op.restore_src_slot_id} is itself restored in this step")
    # a one-token step advances the states in their pool, rows in any order: a row could read a live slot before
    # or after another row writes it (a fork, which reads its parent's live slot, only happens in prefill steps)
    if in_place:
        for i, op in enumerate(ops):
            if op.restore_requested and op.restore_src_slot_id in linear_state_ids:
                raise ValueError(f"op {i}: restore_src_slot_id {op.restore_src_slot_id} is a live slot of this "
                                 "one-token step")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RestoreOps:
    """The linear-state ops of a step's rows as arrays [rows] (a pytree). Padding rows: slot 0, forced cold."""
    linear_state_ids: np.ndarray      # int32 live slot each row advances
    restore_requested: np.ndarray     # bool
    restore_src_slot_ids: np.ndarray  # int32 slot restored from (-1: none)

    @classmethod
    def from_ops(cls, ops, rows: int) -> "RestoreOps":
        live, requested, src = np.zeros(rows, np.int32), np.ones(rows, bool), np.full(rows, -1, np.int32)
        for i, op in enumerate(ops):
            live[i], requested[i], src[i] = op.linear_state_id, op.restore_requested, op.restore_src_slot_id
        return cls(live, requested, src)

    def sources(self, xp=np):
        """(initial_state_ids, has_initial_state) [rows]: see `restore_sources`."""
        return restore_sources(self.linear_state_ids, self.restore_requested, self.restore_src_slot_ids, xp)


def restore_sources(linear_state_ids, restore_requested, restore_src_slot_ids, xp=jnp):
    """Per row, the slot its initial GDN state comes from and whether it has one: requested + source -> the source,
    warm (True); requested, no source (-1) -> cold start (False; the forward treats the state as zeros); not
    requested -> its own live slot, warm (True). Returns (initial_state_ids [B] int32, has_initial_state [B] bool).
    `xp`: jax.numpy, or numpy to fold them on the host."""
    copy = restore_requested & (restore_src_slot_ids >= 0)
    return xp.where(copy, restore_src_slot_ids, linear_state_ids), xp.where(restore_requested, copy, True)


def restore_linear_state_slots(state: DeviceState, linear_state_ids, restore_requested, restore_src_slot_ids):
    """Copies `restore_src_slot_ids[b]` into `linear_state_ids[b]` in every GDN layer where a restore is requested
    with a valid source (see `restore_sources`). Returns (state, has_initial_state [B] bool). Nothing is shared: the
    live slot gets its own copy."""
    read, has_initial_state = restore_sources(linear_state_ids, restore_requested, restore_src_slot_ids)

    def _copy(pool):  # pool: [layers, num_slots, ...]; a row that restores nothing copies its slot onto itself
        return None if pool is None else pool.at[:, linear_state_ids].set(pool[:, read])

    state = DeviceState(state.k, state.v, _copy(state.conv), _copy(state.ssm))
    return state, has_initial_state


restore_linear_state_slots_jit = jax.jit(restore_linear_state_slots, donate_argnums=(0,))


def restore_ops(state: DeviceState, ops, num_slots: int):
    """Host entry: validate (fail closed), then the jitted copy. Returns (state, has_initial_state)."""
    validate_cache_ops(ops, num_slots)
    arrays = RestoreOps.from_ops(ops, len(ops))
    return restore_linear_state_slots_jit(state, *(jnp.asarray(a) for a in (
        arrays.linear_state_ids, arrays.restore_requested, arrays.restore_src_slot_ids)))
