"""The host tier's bytes: the GDN states of checkpoints the scheduler moved out of the device's slot pool
(`scheduler.host_tier` decides; this only copies). An entry is one slot of every GDN layer's conv and recurrent pools,
as numpy arrays, keyed by the checkpoint's hash."""
from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np


@jax.jit
def _read(conv, ssm, slot):
    return conv[:, slot], ssm[:, slot]


@functools.partial(jax.jit, donate_argnums=(0, 1))  # the pools are updated in place
def _write(conv, ssm, slot, c, s):
    return conv.at[:, slot].set(c), ssm.at[:, slot].set(s)


class HostStore:
    """Host copies of checkpoint slots; `apply` runs a plan's `host_ops` on a worker's pools before its step."""

    def __init__(self):
        self.entries: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def apply(self, state, ops: list[tuple]):
        """The state after ("out", slot, hash) copies, ("drop", hash) and ("in", hash, slot) writes, in order (a
        write donates the pools it is given)."""
        for op in ops:
            if op[0] == "out":
                c, s = jax.device_get(_read(state.conv, state.ssm, np.int32(op[1])))
                self.entries[op[2]] = np.asarray(c), np.asarray(s)
            elif op[0] == "drop":
                self.entries.pop(op[1], None)  # (an entry a failed step was to copy out may be absent)
            else:
                c, s = self.entries.pop(op[1])
                conv, ssm = _write(state.conv, state.ssm, np.int32(op[2]), c, s)
                state = dataclasses.replace(state, conv=conv, ssm=ssm)
        return state
