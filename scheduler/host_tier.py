"""The host tier: checkpoints evicted from the device's slot pool live on in host memory, and a hit there is copied
into the restoring sequence's live slot before its step.

The scheduler decides everything and the engine only moves the bytes: each step's plan lists, in the order they were
decided and before anything else of the step runs (`StepPlan.host_ops`), the slots to copy out ("out", read before
the step overwrites them), the host entries to forget ("drop": the least recently used when the tier is full, or one
the device holds again) and the entries to copy in ("in", into the live slot of the sequence that restores it, whose
step then reads its own slot; the entry stays). An entry is keyed by its checkpoint's hash, so it is matched as the
device's checkpoints are; a checkpoint is on the device or on the host, never both. KV blocks stay on the device: a
host hit is reused up to the KV match, as any checkpoint. The compressed tier (`checkpoint_dtype`) is the same
bookkeeping, its entries kept compressed on the device.
"""
from collections import OrderedDict

from scheduler.linear_cache import deepest_off_grid


class HostTier:
    """Up to `capacity` checkpoints in host memory, by hash: hash -> depth (tokens), least recently used first."""

    def __init__(self, capacity: int, chunk_stride: int):
        self.capacity, self.chunk_stride = capacity, chunk_stride
        self.entries: OrderedDict[int, int] = OrderedDict()
        self.num_off_grid = 0  # entries at a block boundary off the stride grid, keyed by the KV block hash
        self.ops: list[tuple] = []  # ("out", slot, hash), ("drop", hash), ("in", hash, slot), for the next plan
        self.num_offloaded = self.num_onloaded = self.num_dropped = 0
        self.reserved = None  # an entry being restored (`reserve`)

    def __len__(self) -> int:
        return len(self.entries)

    def offer(self, slot: int, h: int, depth: int) -> None:
        """A checkpoint leaves device slot `slot`: keep it (the plan copies the slot out), making room by forgetting
        the least recently used entry."""
        if not depth:  # (a checkpoint of unknown depth could not be matched)
            return
        if len(self.entries) >= self.capacity:
            victim = next((e for e in self.entries if e != self.reserved), None)
            if victim is None:  # (the one entry is the one being restored)
                return
            self.forget(victim)
        self.entries[h] = depth
        self.num_off_grid += depth % self.chunk_stride != 0
        self.ops.append(("out", slot, h))
        self.num_offloaded += 1

    def forget(self, h: int) -> None:
        """Drop entry `h` (the tier is full, or the device holds that checkpoint again)."""
        depth = self.entries.pop(h)
        self.num_off_grid -= depth % self.chunk_stride != 0
        self.ops.append(("drop", h))
        self.num_dropped += 1

    def match(self, stride_hashes: list[int], usable_strides: int, block_hashes: list[int], block_size: int,
              above: int, limit: int) -> tuple[int, int | None]:
        """(depth, hash) of the deepest entry in (above, limit]: a stride boundary among the first `usable_strides`
        chain hashes, or a block boundary off the grid; (0, None) if none."""
        best = 0, None
        for i in range(min(usable_strides, limit // self.chunk_stride), above // self.chunk_stride, -1):
            if stride_hashes[i - 1] in self.entries:
                best = i * self.chunk_stride, stride_hashes[i - 1]
                break
        if self.num_off_grid:
            depth, h = deepest_off_grid(self.entries, block_hashes, block_size, self.chunk_stride,
                                        max(above, best[0]), limit)
            if depth:
                return depth, h
        return best

    def reserve(self, h: int) -> None:
        """Entry `h` is about to be restored (`load`): no offer forgets it meanwhile (taking the live slot may evict a
        checkpoint to the tier)."""
        self.reserved = h
        self.entries.move_to_end(h)

    def load(self, h: int, slot: int) -> None:
        """Entry `h` is copied into live slot `slot` before the step (after the copies out decided before: the slot
        may be one of theirs), and stays: it is the most recently used."""
        self.reserved = None
        self.entries.move_to_end(h)
        self.ops.append(("in", h, slot))
        self.num_onloaded += 1

    def drain(self) -> list[tuple]:
        """The copies and drops the next plan carries, in the order they run."""
        ops, self.ops = self.ops, []
        return ops

    def cancel(self, ops: list[tuple]) -> None:
        """A step failed before its copies were known to be done: forget what it was to copy out."""
        for op in ops:
            if op[0] == "out" and op[2] in self.entries:
                self.forget(op[2])
