"""Linear leaf: live recurrent-state slots and the checkpoint index over them.

A GDN layer's state is overwritten every step, so it is never shared: a checkpoint is a slot
frozen at a chunk boundary, and reuse *copies* it into the reusing sequence's own live slot.
Slot ids [1, num_slots) are one pool; each is exactly one of free / live / checkpoint.
"""
from collections import Counter, OrderedDict, deque

from scheduler.eviction import LRUEviction
from scheduler.plan import LinearStateCacheOp
from scheduler.sequence import Sequence


class LinearStatePrefixCache:
    """Checkpoint index: chunk-chain hash -> checkpoint slot, LRU over unpinned checkpoints.

    It owns the checkpoint slots it holds but not the pool; slots enter through
    `insert_with_recorded_hash` and leave through `evict_victim` (the eviction policy's choice) or `evict`.
    """

    def __init__(self, chunk_stride: int, policy=None):
        self.chunk_stride = chunk_stride
        self.policy = LRUEviction() if policy is None else policy  # `scheduler.eviction`
        self.slot_of: dict[int, int] = {}     # hash -> slot
        self.hash_of: dict[int, int] = {}     # slot -> hash
        self.pins: dict[int, int] = {}        # slot -> restore references
        self.lru: OrderedDict[int, None] = OrderedDict()  # unpinned slots, oldest first
        self.depth_of: dict[int, int] = {}    # slot -> the prefix length it holds the state of (0: not told)
        self.last_used: dict[int, int] = {}   # slot -> logical time of its insert or last restore
        self.clock = 0
        self.num_off_grid = 0  # checkpoints at a block boundary off the stride grid, keyed by its KV block hash
        self.host = None  # `HostTier`: where a checkpoint the policy evicts goes on living

    def _touch(self, slot: int) -> None:
        self.clock += 1
        self.last_used[slot] = self.clock

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
        if slot is not None:
            self.pin(slot)
        return slot

    def pin(self, slot: int) -> None:
        """Take a restore reference on checkpoint `slot` (one a `match` found): pin + 1, out of the LRU."""
        assert slot in self.hash_of, f"slot {slot} is not a checkpoint"
        self.pins[slot] += 1
        self.lru.pop(slot, None)
        self._touch(slot)

    def release(self, slot: int) -> None:
        """Drop a restore reference; an unpinned checkpoint becomes the most recently used."""
        self.pins[slot] -= 1
        assert self.pins[slot] >= 0, f"negative pin count on checkpoint slot {slot}"
        if self.pins[slot] == 0:
            self.lru[slot] = None
            self._touch(slot)

    def insert_with_recorded_hash(self, slot: int, h: int, depth: int = 0) -> bool:
        """Key `slot` by the hash recorded when its boundary (`depth` tokens) was reached.

        Returns False, taking nothing, when `h` is already cached (idempotent): the existing
        checkpoint is kept and the duplicate slot stays with the caller, which frees it.
        """
        if h in self.slot_of:
            return False
        assert slot not in self.hash_of, f"slot {slot} is already a checkpoint"
        if self.host is not None and h in self.host.entries:  # computed again: the device's copy is the one kept
            self.host.forget(h)
        self.slot_of[h] = slot
        self.hash_of[slot] = h
        self.pins[slot] = 0
        self.lru[slot] = None
        self.depth_of[slot] = depth
        self.num_off_grid += depth % self.chunk_stride != 0
        self._touch(slot)
        return True

    def evict(self, slot: int) -> None:
        """Remove an unpinned checkpoint; its slot goes back to the caller."""
        assert slot in self.lru, f"slot {slot} is not an unpinned checkpoint"
        del self.lru[slot]
        del self.slot_of[self.hash_of.pop(slot)]
        self.num_off_grid -= self.depth_of[slot] % self.chunk_stride != 0
        del self.pins[slot], self.depth_of[slot], self.last_used[slot]

    def evict_victim(self) -> int | None:
        """Remove the unpinned checkpoint the eviction policy picks; return its slot (None: none is unpinned)."""
        if not self.lru:
            return None
        slot = self.policy.victim(self.lru, self.depth_of, self.last_used)
        if self.host is not None:
            self.host.offer(slot, self.hash_of[slot], self.depth_of[slot])
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

    def match_blocks(self, block_hashes: list[int], block_size: int, above: int, limit: int) -> tuple[int, int]:
        """(depth, slot) of the deepest off-grid checkpoint in (above, limit] (`deepest_off_grid`); (0, -1) if none.
        Probes only; pins nothing."""
        depth, h = deepest_off_grid(self.slot_of, block_hashes, block_size, self.chunk_stride, above, limit)
        return (depth, self.slot_of[h]) if depth else (0, -1)


def deepest_off_grid(keys, block_hashes: list[int], block_size: int, chunk_stride: int, above: int,
                     limit: int) -> tuple[int, int | None]:
    """(depth, key) of the deepest block boundary in (above, limit], off the stride grid, whose KV block hash is in
    `keys` (a checkpoint kept there is keyed by the hash of the block ending there); (0, None) if none."""
    for i in range(min(limit // block_size, len(block_hashes)), above // block_size, -1):
        if block_hashes[i - 1] in keys and (i * block_size) % chunk_stride:
            return i * block_size, block_hashes[i - 1]
    return 0, None


def deepest_hit_at_or_below(hits: list[tuple[int, int]], limit: int) -> tuple[int, int]:
    """(boundary, slot) of the deepest hit with boundary <= limit; (0, -1) if none."""
    for boundary, slot in reversed(hits):
        if boundary <= limit:
            return boundary, slot
    return 0, -1


class LinearStateBlockManager:
    """Owns the slot pool; hands out live slots, saves checkpoints, resolves restore sources."""

    def __init__(self, num_slots: int, chunk_stride: int, enable_prefix_caching: bool = True, eviction=None,
                 num_draft_slots: int = 0):
        """`eviction`: the checkpoint index's policy (`scheduler.eviction`; None: LRU). `num_draft_slots`: slots set
        apart for speculative decoding's verify steps (`swap_draft_slot`)."""
        self.num_slots = num_slots
        self.chunk_stride = chunk_stride
        self.free_slots: deque[int] = deque(range(1, num_slots - num_draft_slots))
        self.draft_slots: set[int] = set(range(num_slots - num_draft_slots, num_slots))
        self.live_slots: set[int] = set()
        # slot -> (hash, boundary): the checkpoints the in-flight step writes ("scan" mode)
        self.saving: dict[int, tuple[int, int]] = {}
        self.saving_hashes: set[int] = set()  # their hashes (a step may plan thousands: looked up, not searched)
        self.index = LinearStatePrefixCache(chunk_stride, eviction) if enable_prefix_caching else None
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
        """A fresh live slot: a free one, else an unpinned checkpoint (the eviction policy's). Never a pinned or
        live one; None when there is none."""
        if self.free_slots:
            slot = self.free_slots.popleft()
        else:
            slot = self.index.evict_victim() if self.index is not None else None
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

    def offload_unpinned(self) -> None:
        """Every unpinned checkpoint goes to the tier (`index.host`), in the eviction policy's order; its slot is
        free."""
        while self.index.lru:
            self.free_slots.append(self.index.evict_victim())

    def swap_draft_slot(self, seq: Sequence, slot: int) -> None:
        """A verify step rejected a draft: draft slot `slot` holds the state after the last accepted position and
        becomes the sequence's live slot; the old live slot, a step ahead of it, becomes a draft slot."""
        self.draft_slots.remove(slot)
        self.draft_slots.add(seq.linear_state_id)
        self.live_slots.remove(seq.linear_state_id)
        self.live_slots.add(slot)
        seq.linear_state_id = slot

    def free_live_slot(self, slot: int) -> None:
        self.live_slots.remove(slot)
        self.free_slots.append(slot)

    def insert_with_recorded_hash(self, slot: int, h: int, depth: int = 0) -> bool:
        """Promote live `slot` to a checkpoint keyed by `h` (at `depth` tokens). If `h` is already cached the
        duplicate slot is freed and the existing checkpoint kept. True iff `slot` was inserted."""
        self.live_slots.remove(slot)
        if self.index.insert_with_recorded_hash(slot, h, depth):
            self.num_saved += 1
            return True
        self.free_slots.append(slot)
        return False

    # -- checkpoints written inside a step ("scan" mode) --------------------------------------
    def acquire_save_slot(self, h: int, depth: int = 0) -> int | None:
        """A slot for the in-flight step to write the checkpoint of hash `h` (at `depth` tokens) into: a free one,
        else an unpinned checkpoint, the eviction policy's (never a live, pinned or saving one). None, counted as
        skipped, when `h` is cached or being saved already, or when no slot can be had."""
        if self.index.contains(h) or h in self.saving_hashes:
            self.num_save_skipped += 1
            return None
        if self.free_slots:
            slot = self.free_slots.popleft()
        else:
            slot = self.index.evict_victim()
            if slot is None:
                self.num_save_skipped += 1
                return None
            self.num_evicted += 1
        self.saving[slot] = h, depth
        self.saving_hashes.add(h)
        return slot

    def commit_save(self, slot: int) -> None:
        """The step that wrote `slot` completed: it becomes the checkpoint of its hash."""
        h, depth = self.saving.pop(slot)
        self.saving_hashes.remove(h)
        if self.index.insert_with_recorded_hash(slot, h, depth):
            self.num_saved += 1
        else:  # cached meanwhile (a reset cannot race a step; kept for safety)
            self.free_slots.append(slot)
            self.num_save_skipped += 1

    def cancel_save(self, slot: int) -> None:
        """The step that should have written `slot` failed: the slot is free again, nothing is indexed."""
        self.saving_hashes.remove(self.saving.pop(slot)[0])
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
        self.insert_with_recorded_hash(checkpoint, h, seq.pending_save_len)
        self.replace_block(seq, fresh)
        pinned = self.index.find(h)  # the restore source of this step
        assert pinned == checkpoint
        return checkpoint

    def replace_block(self, seq: Sequence, slot: int) -> None:
        seq.linear_state_id = slot

    def allocate_for_sequence(self, seq: Sequence, num_tokens: int | None = None) -> LinearStateCacheOp:
        """Per-step entry of a running sequence (it holds a live slot: `admit` gave it one). `num_tokens` is unused:
        a sequence needs one slot whatever its length.

        With a deferred save pending, the live slot becomes the checkpoint and the sequence rotates to a fresh live
        slot that this step restores from it (replace); otherwise the sequence continues its own state.
        """
        assert seq.linear_state_id > 0, f"seq {seq.seq_id} runs without a live slot"
        if seq.pending_save_hash is not None:
            src = self.save_pending(seq)
            if src > 0:
                return LinearStateCacheOp(seq.linear_state_id, True, src)
        return LinearStateCacheOp(seq.linear_state_id, False, -1)

    def match(self, token_ids: list[int], hashes: list[int]) -> tuple[list[tuple[int, int]], int]:
        """Probe the checkpoint index (see `LinearStatePrefixCache.match`); no hit without prefix caching."""
        return self.index.match(token_ids, hashes) if self.index is not None else ([], 0)

    def is_pinned(self, slot: int) -> bool:
        return self.index is not None and self.index.is_pinned(slot)

    def admit(self, seq: Sequence, restore_src_slot_id: int = -1, fork: bool = False) -> LinearStateCacheOp | None:
        """A live slot for a sequence that holds none, restored from `restore_src_slot_id` (-1: a cold start).

        The source is a checkpoint slot found by the admission's match, or with `fork` the live slot of the sequence
        forked from. A checkpoint source is pinned for the step *before* the live slot is taken, so taking the live
        slot can never evict it, and the op is built complete, once. None (nothing pinned) when no slot can be had.
        """
        assert seq.linear_state_id <= 0 and seq.pending_save_hash is None, f"seq {seq.seq_id} already holds a slot"
        pin = restore_src_slot_id > 0 and not fork
        if pin:
            self.index.pin(restore_src_slot_id)
        slot = self.acquire_live_slot()
        if slot is None:
            if pin:
                self.index.release(restore_src_slot_id)
            return None
        seq.linear_state_id = slot
        return LinearStateCacheOp(slot, True, restore_src_slot_id, fork=fork)

    def release_source(self, slot: int) -> None:
        self.index.release(slot)

    def deallocate(self, seq: Sequence) -> None:
        """Give back the live slot; with a pending save it becomes that checkpoint instead."""
        slot, seq.linear_state_id = seq.linear_state_id, -1
        h, seq.pending_save_hash = seq.pending_save_hash, None
        if slot <= 0:
            return
        if h is not None and self.index is not None:
            if not self.insert_with_recorded_hash(slot, h, seq.pending_save_len):
                self.num_save_skipped += 1  # cached meanwhile: the slot is freed, the save skipped
        else:
            self.free_live_slot(slot)

    def reset_prefix_cache(self) -> None:
        """Evict every unpinned checkpoint."""
        if self.index is not None:
            for slot in list(self.index.lru):
                self.evict_checkpoint(slot)

    # -- accounting ------------------------------------------------------------------------
    def stats(self) -> dict:
        return dict(checkpoints_saved=self.num_saved, checkpoints_save_skipped=self.num_save_skipped,
                    checkpoints_evicted=self.num_evicted, live_slots=len(self.live_slots),
                    checkpoint_slots=self.num_checkpoints, free_slots=len(self.free_slots))

    def check_invariants(self, running: list[Sequence], pins_allowed: bool, saves: set[int] = frozenset(),
                         sources: Counter | None = None) -> None:
        """Every slot in exactly one state. `saves`: the slots the in-flight step writes; `sources`: the
        checkpoints it restores from (slot -> rows), exactly what may be pinned (None: not checked)."""
        live = {s.linear_state_id for s in running}
        assert len(live) == len(running), "two running sequences share a live slot"
        assert live == self.live_slots, "live slots differ from the running sequences'"
        free = set(self.free_slots)
        ckpt = set(self.index.hash_of) if self.index is not None else set()
        saving, draft = set(self.saving), self.draft_slots
        assert len(free) == len(self.free_slots), "duplicate id in the slot free list"
        assert (len(free) + len(live) + len(ckpt) + len(saving) + len(draft)
                == len(free | live | ckpt | saving | draft)), "slot in two states"
        assert free | live | ckpt | saving | draft == set(range(1, self.num_slots)), "slot leaked or slot 0 used"
        assert pins_allowed or not saving, "checkpoint being saved outside a step"
        assert len({h for h, _ in self.saving.values()}) == len(saving), "one hash saved twice in a step"
        assert self.saving_hashes == {h for h, _ in self.saving.values()}, "hashes being saved differ from the saves'"
        assert saving == set(saves), "slots being saved differ from the in-flight plan's saves"
        if self.index is not None:
            idx = self.index
            assert {v: k for k, v in idx.slot_of.items()} == idx.hash_of
            assert set(idx.pins) == ckpt and all(p >= 0 for p in idx.pins.values())
            assert set(idx.lru) == {s for s in ckpt if idx.pins[s] == 0}, "LRU != unpinned checkpoints"
            assert set(idx.depth_of) == ckpt == set(idx.last_used), "depths or uses kept for a slot not indexed"
            assert idx.num_off_grid == sum(d % self.chunk_stride != 0 for d in idx.depth_of.values())
            if idx.host is not None:  # a checkpoint is on the device or on the host, never both
                host = idx.host
                assert len(host) <= host.capacity and not host.entries.keys() & idx.slot_of.keys()
                assert host.num_off_grid == sum(d % self.chunk_stride != 0 for d in host.entries.values())
            if not pins_allowed:
                assert not any(idx.pins.values()), "checkpoint pinned outside a step"
            if sources is not None:
                pins = Counter({s: p for s, p in idx.pins.items() if p})
                assert pins == Counter(sources), "pins differ from the in-flight restore sources"
