"""The checkpoint tiers' bytes: the GDN states of checkpoints the scheduler moved out of the device's slot pool
(`scheduler.host_tier` decides; these only copy). An entry is one slot of every GDN layer's conv and recurrent pools,
keyed by the checkpoint's hash: as numpy arrays in host memory (`HostStore`), or compressed on the device
(`CompressedStore`, `checkpoint_dtype`)."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from gdn_jax.model.state import from_pool, to_pool

# the largest magnitude of each compressed dtype with a scale: a head's largest |value| maps to it
SCALED_MAX = {"int8": 127.0, "float8_e4m3fn": 448.0}


@jax.jit
def _read(conv, ssm, slot):
    return conv[:, slot], ssm[:, slot]


@functools.partial(jax.jit, donate_argnums=(0, 1))  # the pools are updated in place
def _write(conv, ssm, slot, c, s):
    return conv.at[:, slot].set(c), ssm.at[:, slot].set(s)


class HostStore:
    """Host copies of checkpoint slots; `apply` runs a plan's `host_ops` on a worker's pools before its step."""

    def __init__(self):
        self.entries: dict[int, tuple] = {}

    def copy_out(self, state, slot: int):
        c, s = jax.device_get(_read(state.conv, state.ssm, np.int32(slot)))
        return np.asarray(c), np.asarray(s)

    def copy_in(self, state, slot: int, entry):
        conv, ssm = _write(state.conv, state.ssm, np.int32(slot), *entry)
        return dataclasses.replace(state, conv=conv, ssm=ssm)

    def apply(self, state, ops: list[tuple]):
        """The state after ("out", slot, hash) copies, ("drop", hash) and ("in", hash, slot) writes (the entry
        stays), in order (a write donates the pools it is given)."""
        for op in ops:
            if op[0] == "out":
                self.entries[op[2]] = self.copy_out(state, op[1])
            elif op[0] == "drop":
                self.entries.pop(op[1], None)  # (an entry a failed step was to copy out may be absent)
            else:
                state = self.copy_in(state, op[2], self.entries[op[1]])
        return state


def compress(x, dtype: str, axes: tuple[int, ...]):
    """float32 x -> (values in `dtype`, float32 scales over the axes not in `axes`: one per head of a state). A
    scaled dtype maps each group's largest |value| to its largest magnitude (int8 rounds to the nearest step);
    bfloat16 has no scale (None)."""
    if dtype == "bfloat16":
        return x.astype(jnp.bfloat16), None
    top = jnp.max(jnp.abs(x), axis=axes, keepdims=True)
    scale = jnp.where(top > 0, top / SCALED_MAX[dtype], 1.0)
    y = x / scale
    q = jnp.clip(jnp.round(y), -127, 127).astype(jnp.int8) if dtype == "int8" else y.astype(jnp.float8_e4m3fn)
    return q, scale


def expand(q, scale):
    """`compress`'s output -> float32 values."""
    x = q.astype(jnp.float32)
    return x if scale is None else x * scale


def _activation_dtype(conv):
    """The dtype the conv pool's values are in (a 16-bit float pool holds its bit patterns: `state.pool_dtype`)."""
    return jnp.bfloat16 if conv.dtype == jnp.uint16 else conv.dtype


@functools.partial(jax.jit, static_argnums=3)
def _compress_slot(conv, ssm, slot, dtype: str):
    c, s = conv[:, slot], ssm[:, slot]  # [L, K-1, C] in the pool's dtype, [L, Hv, dk, dv] float32
    return compress(from_pool(c, _activation_dtype(c)).astype(jnp.float32), dtype, (2,)), compress(s, dtype, (2, 3))


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _expand_slot(conv, ssm, slot, entry):
    (qc, sc), (qs, ss) = entry
    return _write(conv, ssm, slot, to_pool(expand(qc, sc).astype(_activation_dtype(conv)), conv), expand(qs, ss))


class CompressedStore(HostStore):
    """Checkpoints compressed to `dtype` in device memory (`checkpoint_dtype`): the conv state with a scale per
    layer and tap, the recurrent state with one per layer and head. A restore expands one into the restoring
    sequence's live slot, which stays float32."""

    def __init__(self, dtype: str):
        super().__init__()
        self.dtype = dtype

    def copy_out(self, state, slot: int):
        return _compress_slot(state.conv, state.ssm, np.int32(slot), self.dtype)

    def copy_in(self, state, slot: int, entry):
        conv, ssm = _expand_slot(state.conv, state.ssm, np.int32(slot), entry)
        return dataclasses.replace(state, conv=conv, ssm=ssm)


def compressed_entry_bytes(layers: int, conv_shape: tuple[int, int], ssm_shape: tuple[int, int, int],
                           dtype: str) -> int:
    """Bytes of one `CompressedStore` entry: every GDN layer's conv state [K-1, C] and recurrent state [Hv, dk, dv]
    in `dtype`, with their float32 scales."""
    item = 2 if dtype == "bfloat16" else 1
    scales = 0 if dtype == "bfloat16" else 4 * (conv_shape[0] + ssm_shape[0])
    return layers * (item * (int(np.prod(conv_shape)) + int(np.prod(ssm_shape))) + scales)
