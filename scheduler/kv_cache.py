"""KV leaf: paged KV blocks shared by refcount, found through the chained block hash."""
from collections import OrderedDict, deque

from scheduler.sequence import Sequence


class BlockManagerImpl:
    """Pool of KV block ids [1, num_blocks) (block 0 is padding).

    Every usable block is exactly one of:
      free    never cached (or its hash was dropped), in `free_blocks`;
      cached  hashed with refcount 0, in `cached_lru` (oldest first), evicted on demand;
      used    refcount > 0 (possibly hashed, then shared zero-copy by matching sequences).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free_blocks: deque[int] = deque(range(1, num_blocks))
        self.cached_lru: OrderedDict[int, None] = OrderedDict()
        self.num_evictions = 0

    # -- pool ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: never-cached ones plus evictable cached ones."""
        return len(self.free_blocks) + len(self.cached_lru)

    def _take_block(self) -> int:
        if not self.free_blocks:
            self.evict(next(iter(self.cached_lru)))  # the least recently used
        return self.free_blocks.popleft()

    def evict(self, block: int) -> None:
        """Drop an unreferenced cached block's hash; the block becomes free."""
        assert self.ref_counts[block] == 0 and block in self.cached_lru, f"block {block} not evictable"
        del self.cached_lru[block]
        del self.hash_to_block[self.block_hash[block]]
        self.block_hash[block] = None
        self.free_blocks.appendleft(block)
        self.num_evictions += 1

    def _ref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            self.cached_lru.pop(block, None)
        self.ref_counts[block] += 1

    def _unref(self, block: int) -> None:
        self.ref_counts[block] -= 1
        assert self.ref_counts[block] >= 0, f"negative refcount on KV block {block}"
        if self.ref_counts[block] == 0:
            if self.block_hash[block] is not None:
                self.cached_lru[block] = None  # most recently used end
            else:
                self.free_blocks.append(block)

    # -- prefix matching -------------------------------------------------------------------
    def match(self, token_ids: list[int], hashes: list[int]) -> list[int]:
        """Cached blocks of the longest full-block prefix strictly below the final token.

        Probes only (no refcount, no LRU change). Block i is usable iff
        (i + 1) * block_size <= len(token_ids) - 1, so at least one token is always computed.
        """
        if not self.enable_prefix_caching:
            return []
        usable = min((len(token_ids) - 1) // self.block_size, len(hashes))
        blocks = []
        for i in range(usable):
            block = self.hash_to_block.get(hashes[i])
            if block is None:
                break
            blocks.append(block)
        return blocks

    def num_evictable_among(self, blocks: list[int]) -> int:
        """How many of `blocks` sit in the cached LRU (taking them shrinks the free count)."""
        return sum(1 for b in blocks if self.ref_counts[b] == 0)

    def allocate_shared(self, seq: Sequence, blocks: list[int]) -> int:
        """Mount matched blocks at the head of an empty block table (refcount + 1). -> kv_match."""
        assert not seq.block_table
        for block in blocks:
            self._ref(block)
        seq.block_table.extend(blocks)
        seq.num_kv_hashed_blocks = len(blocks)
        return len(blocks) * self.block_size

    # -- allocation ------------------------------------------------------------------------
    def num_blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks for the block table to cover positions [0, num_tokens)."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_blocks_needed(seq, num_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        for _ in range(self.num_blocks_needed(seq, num_tokens)):
            block = self._take_block()
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def can_append(self, seq: Sequence) -> bool:
        """Room for one more decode token."""
        return self.can_allocate(seq, seq.num_computed_tokens + 1)

    def may_append(self, seq: Sequence) -> None:
        """Add a block if the next decode token starts one."""
        self.allocate(seq, seq.num_computed_tokens + 1)

    def hash_computed_blocks(self, seq: Sequence) -> None:
        """Register every block that is full and computed (its hash already in the chain)."""
        if not self.enable_prefix_caching:
            return
        end = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        for i in range(seq.num_kv_hashed_blocks, end):
            h = seq.block_hashes[i]
            block = seq.block_table[i]
            if h not in self.hash_to_block and self.block_hash[block] is None:
                self.hash_to_block[h] = block
                self.block_hash[block] = h
            # else: same content already cached in another block; this one stays private.
        seq.num_kv_hashed_blocks = max(seq.num_kv_hashed_blocks, end)

    def deallocate(self, seq: Sequence) -> None:
        # Deepest blocks first, so the LRU evicts a prefix's tail before its head.
        for block in reversed(seq.block_table):
            self._unref(block)
        seq.block_table.clear()
        seq.num_kv_hashed_blocks = 0

    def reset_prefix_cache(self) -> None:
        """Evict every unreferenced cached block."""
        for block in list(self.cached_lru):
            self.evict(block)

    # -- accounting ------------------------------------------------------------------------
    def stats(self) -> dict:
        return dict(kv_blocks_cached=self.num_cached_blocks, kv_blocks_evicted=self.num_evictions,
                    kv_blocks_free=self.num_free_blocks)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.hash_to_block)

    def check_invariants(self, running: list[Sequence]) -> None:
        refs = [0] * self.num_blocks
        for seq in running:
            for block in seq.block_table:
                assert 0 < block < self.num_blocks, f"seq {seq.seq_id} holds KV block {block}"
                refs[block] += 1
        assert refs == self.ref_counts, "KV refcounts differ from the block tables"
        free, lru = set(self.free_blocks), set(self.cached_lru)
        used = {b for b in range(1, self.num_blocks) if self.ref_counts[b] > 0}
        assert len(free) == len(self.free_blocks), "duplicate id in the KV free list"
        assert not (free & lru) and not (free & used) and not (lru & used)
        assert free | lru | used == set(range(1, self.num_blocks)), "KV block leaked"
        assert all(self.block_hash[b] is not None for b in lru)
        assert all(self.block_hash[b] is None for b in free)
        for h, b in self.hash_to_block.items():
            assert self.block_hash[b] == h
        assert sum(h is not None for h in self.block_hash) == len(self.hash_to_block)
