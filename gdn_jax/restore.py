"""Restore of linear-state checkpoints into live slots: a functional copy across every GDN layer.

`restore_sources` turns the ops into the slot each row's initial state is read from and its `has_initial_state`
flag. The worker's step folds the restore into the forward's read of the initial state: a restoring row reads its
source slot, and its new state is written to its live slot, so the live slot ends up with its own copy, advanced by
the step's tokens; a row that restores nothing reads its own live slot and costs nothing extra (no self-copy of
every slot, every step). `restore_linear_state_slots` is the same copy as a standalone pure function.
`validate_cache_ops` is the host-side gate that fails closed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from gdn_jax.model import DeviceState


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
