"""Linear leaf: live recurrent-state slots and the checkpoint index over them.

A GDN layer's state is overwritten every step, so it is never shared: a checkpoint is a slot
frozen at a chunk boundary, and reuse *copies* it into the reusing sequence's own live slot.
Slot ids [1, num_slots) are one pool; each is exactly one of free / live / checkpoint.
"""
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass

from scheduler.sequence import Sequence


@dataclass
class LinearStateCacheOp:
    linear_state_id: int = -1        # live slot the sequence advances
    restore_requested: bool = False  # kept separate from the source id on purpose
    restore_src_slot_id: int = -1    # checkpoint slot to copy from
    fork: bool = False               # the source is the live slot of the sequence this one forks from (n > 1)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LinearStateCacheOp":
        return cls(linear_state_id=int(d["linear_state_id"]),
                   restore_requested=bool(d["restore_requested"]),
                   restore_src_slot_id=int(d["restore_src_slot_id"]),
                   fork=bool(d.get("fork", False)))

    @property
    def is_warm_restore(self) -> bool:
        """The step copies a source slot into the live slot (a checkpoint restore or a fork)."""
        return self.restore_requested and self.restore_src_slot_id > 0

    @property
    def restores_checkpoint(self) -> bool:
        """A warm restore from a checkpoint, pinned for the step (a fork reads a live slot and pins nothing)."""
        return self.is_warm_restore and not self.fork


class LinearStatePrefixCache:
    """Checkpoint index: chunk-chain hash -> checkpoint slot, LRU over unpinned checkpoints.

    It owns the checkpoint slots it holds but not the pool; slots enter through
    `insert_with_recorded_hash` and leave through `evict_lru`.
    """

    def __init__(self, chunk_stride: int):
        self.chunk_stride = chunk_stride
        self.slot_of: dict[int, int] = {}     # hash -> slot
        self.hash_of: dict[int, int] = {}     # slot -> hash
        self.pins: dict[int, int] = {}        # slot -> restore references
        self.lru: OrderedDict[int, None] = OrderedDict()  # unpinned slots, oldest first

    def __len__(self) -> int:
        return len(self.slot_of)

    @property
    def num_evictable(self) -> int:
        return len(self.lru)

    def contains(self, h: int) -> bool:
        """Probe; LRU order untouched."""
        return h in self.slot_of

    def is_pinned(self, slot: int) -> bool:
        return self.pins.get(slot, 0) > 0

    def find(self, h: int) -> int | None:
        """Take a restore reference on the checkpoint for `h` (pin + 1, LRU promote)."""
        slot = self.slot_of.get(h)
        if slot is None:
            return None
        self.pins[slot] += 1
        self.lru.pop(slot, None)
        return slot

    def release(self, slot: int) -> None:
        """Drop a restore reference; an unpinned checkpoint becomes the most recently used."""
        self.pins[slot] -= 1
        assert self.pins[slot] >= 0, f"negative pin count on checkpoint slot {slot}"
        if self.pins[slot] == 0:
            self.lru[slot] = None

    def insert_with_recorded_hash(self, slot: int, h: int) -> bool:
        """Key `slot` by the hash recorded when its boundary was reached.

        Returns False, taking nothing, when `h` is already cached (idempotent): the existing
        checkpoint is kept and the duplicate slot stays with the caller, which frees it.
        """
        if h in self.slot_of:
            return False
        assert slot not in self.hash_of, f"slot {slot} is already a checkpoint"
        self.slot_of[h] = slot
        self.hash_of[slot] = h
        self.pins[slot] = 0
        self.lru[slot] = None
        return True

    def evict(self, slot: int) -> None:
        """Remove an unpinned checkpoint; its slot goes back to the caller."""
        assert slot in self.lru, f"slot {slot} is not an unpinned checkpoint"
        del self.lru[slot]
        del self.slot_of[self.hash_of.pop(slot)]
        del self.pins[slot]

    def evict_lru(self) -> int | None:
        """Remove the least recently used unpinned checkpoint; return its slot."""
        if not self.lru:
            return None
        slot = next(iter(self.lru))
        self.evict(slot)
        return slot

    def match(self, token_ids: list[int], hashes: list[int]) -> tuple[list[tuple[int, int]], int]:
        """Probe every whole chunk strictly below the final token.

        Chunk i is usable iff (i + 1) * chunk_stride <= len(token_ids) - 1. Gaps are allowed.
        Returns ([(boundary, slot)] for every hit, ascending; matched_tokens = deepest boundary,
        0 when all miss). Nothing is pinned: the caller mounts only the single hit it uses.
        """
        usable = min((len(token_ids) - 1) // self.chunk_stride, len(hashes))
        hits = []
        for i in range(usable):
            if self.contains(hashes[i]):
                hits.append(((i + 1) * self.chunk_stride, self.slot_of[hashes[i]]))
        return hits, (hits[-1][0] if hits else 0)


def deepest_hit_at_or_below(hits: list[tuple[int, int]], limit: int) -> tuple[int, int]:
    """(boundary, slot) of the deepest hit with boundary <= limit; (0, -1) if none."""
    for boundary, slot in reversed(hits):
        if boundary <= limit:
            return boundary, slot
    return 0, -1


class LinearStateBlockManager:
    """Owns the slot pool; hands out live slots, saves checkpoints, resolves restore sources."""

    participates_in_admission = False  # a restore source is not part of a sequence's budget

    def __init__(self, num_slots: int, chunk_stride: int, enable_prefix_caching: bool = True):
        self.num_slots = num_slots
        self.chunk_stride = chunk_stride
        self.free_slots: deque[int] = deque(range(1, num_slots))
        self.live_slots: set[int] = set()
        self.saving: dict[int, int] = {}  # slot -> hash: checkpoints the in-flight step writes ("scan" mode)
        self.index = LinearStatePrefixCache(chunk_stride) if enable_prefix_caching else None
        self.num_saved = 0
        self.num_save_skipped = 0
        self.num_evicted = 0

    # -- pool ------------------------------------------------------------------------------
    @property
    def num_checkpoints(self) -> int:
        return len(self.index) if self.index is not None else 0

    @property
    def num_obtainable(self) -> int:
        """Slots a live-slot request can get: free ones plus unpinned checkpoints."""
        return len(self.free_slots) + (self.index.num_evictable if self.index is not None else 0)

    def acquire_live_slot(self) -> int | None:
        """A fresh live slot: a free one, else the LRU unpinned checkpoint. Never a pinned or
        live one; None when there is none."""
        if self.free_slots:
            slot = self.free_slots.popleft()
        else:
            slot = self.index.evict_lru() if self.index is not None else None
            if slot is None:
                return None
            self.num_evicted += 1
        self.live_slots.add(slot)
        return slot

    def evict_checkpoint(self, slot: int) -> None:
        """Drop an unpinned checkpoint; its slot becomes free."""
        self.index.evict(slot)
        self.free_slots.append(slot)
        self.num_evicted += 1

    def free_live_slot(self, slot: int) -> None:
        self.live_slots.remove(slot)
        self.free_slots.append(slot)

    def insert_with_recorded_hash(self, slot: int, h: int) -> bool:
        """Promote live `slot` to a checkpoint keyed by `h`. If `h` is already cached the
        duplicate slot is freed and the existing checkpoint kept. True iff `slot` was inserted."""
        self.live_slots.remove(slot)
        if self.index.insert_with_recorded_hash(slot, h):
            self.num_saved += 1
            return True
        self.free_slots.append(slot)
        return False

    # -- checkpoints written inside a step ("scan" mode) --------------------------------------
    def acquire_save_slot(self, h: int) -> int | None:
        """A slot for the in-flight step to write the checkpoint of hash `h` into: a free one, else the LRU unpinned
        checkpoint (never a live, pinned or saving one). None, counted as skipped, when `h` is cached or being saved
        already, or when no slot can be had."""
        if self.index.contains(h) or h in self.saving.values():
            self.num_save_skipped += 1
            return None
        if self.free_slots:
            slot = self.free_slots.popleft()
        else:
            slot = self.index.evict_lru()
            if slot is None:
                self.num_save_skipped += 1
                return None
            self.num_evicted += 1
        self.saving[slot] = h
        return slot

    def commit_save(self, slot: int) -> None:
        """The step that wrote `slot` completed: it becomes the checkpoint of its hash."""
        h = self.saving.pop(slot)
        if self.index.insert_with_recorded_hash(slot, h):
            self.num_saved += 1
        else:  # cached meanwhile (a reset cannot race a step; kept for safety)
            self.free_slots.append(slot)
            self.num_save_skipped += 1

    def cancel_save(self, slot: int) -> None:
        """The step that should have written `slot` failed: the slot is free again, nothing is indexed."""
        del self.saving[slot]
        self.free_slots.append(slot)

    # -- per sequence ----------------------------------------------------------------------
    def save_pending(self, seq: Sequence) -> int:
        """The deferred save: promote the live slot under the recorded hash and rotate the
        sequence to a fresh live slot. Returns the new checkpoint slot, pinned for this step,
        or -1 when the save is skipped (hash already cached, or no fresh slot without touching
        live or pinned slots). A skipped save keeps the live slot with the sequence."""
        h, seq.pending_save_hash = seq.pending_save_hash, None
        if self.index.contains(h):
            self.num_save_skipped += 1
            return -1
        fresh = self.acquire_live_slot()
        if fresh is None:
            self.num_save_skipped += 1
            return -1
        checkpoint = seq.linear_state_id
        self.insert_with_recorded_hash(checkpoint, h)
        self.replace_block(seq, fresh)
        pinned = self.index.find(h)  # the restore source of this step
        assert pinned == checkpoint
        return checkpoint

    def replace_block(self, seq: Sequence, slot: int) -> None:
        seq.linear_state_id = slot

    def allocate_for_sequence(self, seq: Sequence, num_tokens: int | None = None) -> LinearStateCacheOp | None:
        """Per-step entry. `num_tokens` is unused: a sequence needs one slot whatever its length.

        1. perform the deferred save (replace: the live slot becomes a checkpoint, the sequence
           rotates to a fresh slot, and this step restores from the checkpoint);
        2. acquire a live slot if the sequence has none (append; restore requested, no source
           yet: the composite fills it in). None if no slot can be obtained.
        """
        if seq.pending_save_hash is not None and seq.linear_state_id > 0:
            src = self.save_pending(seq)
            if src > 0:
                return LinearStateCacheOp(seq.linear_state_id, True, src)
        if seq.linear_state_id <= 0:
            slot = self.acquire_live_slot()
            if slot is None:
                return None
            seq.linear_state_id = slot
            return LinearStateCacheOp(slot, True, -1)
        return LinearStateCacheOp(seq.linear_state_id, False, -1)

    def allocate_shared(self, token_ids: list[int], hashes: list[int],
                        limit: int | None = None) -> tuple[int, int, int]:
        """Resolve a restore source: the deepest checkpoint at or below `limit` tokens.

        Returns (source slot pinned via `find`, or -1; its boundary, 0 if none; reach = deepest
        hit overall). The source joins no block vector and no admission count.
        """
        if self.index is None:
            return -1, 0, 0
        hits, reach = self.index.match(token_ids, hashes)
        boundary, _ = deepest_hit_at_or_below(hits, reach if limit is None else limit)
        if boundary == 0:
            return -1, 0, reach
        src = self.index.find(hashes[boundary // self.chunk_stride - 1])
        return src, boundary, reach

    def release_source(self, slot: int) -> None:
        self.index.release(slot)

    def deallocate(self, seq: Sequence) -> None:
        """Give back the live slot; with a pending save it becomes that checkpoint instead."""
        slot, seq.linear_state_id = seq.linear_state_id, -1
        h, seq.pending_save_hash = seq.pending_save_hash, None
        if slot <= 0:
            return
        if h is not None and self.index is not None:
            self.insert_with_recorded_hash(slot, h)
        else:
            self.free_live_slot(slot)

    # -- accounting ------------------------------------------------------------------------
    def check_invariants(self, running: list[Sequence], pins_allowed: bool) -> None:
        live = {s.linear_state_id for s in running}
        assert len(live) == len(running), "two running sequences share a live slot"
        assert live == self.live_slots, "live slots differ from the running sequences'"
        free = set(self.free_slots)
        ckpt = set(self.index.hash_of) if self.index is not None else set()
        saving = set(self.saving)
        assert len(free) == len(self.free_slots), "duplicate id in the slot free list"
        assert len(free) + len(live) + len(ckpt) + len(saving) == len(free | live | ckpt | saving), "slot in two states"
        assert free | live | ckpt | saving == set(range(1, self.num_slots)), "slot leaked or slot 0 used"
        assert pins_allowed or not saving, "checkpoint being saved outside a step"
        assert len(set(self.saving.values())) == len(saving), "one hash saved twice in a step"
        if self.index is not None:
            idx = self.index
            assert {v: k for k, v in idx.slot_of.items()} == idx.hash_of
            assert set(idx.pins) == ckpt and all(p >= 0 for p in idx.pins.values())
            assert set(idx.lru) == {s for s in ckpt if idx.pins[s] == 0}, "LRU != unpinned checkpoints"
            if not pins_allowed:
                assert not any(idx.pins.values()), "checkpoint pinned outside a step"
