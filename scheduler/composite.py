"""CompositeBlockManager: one entry point over the KV leaf and the linear leaf.

It decides how much of a new sequence's prefix is reused: `min(kv_match, linear_reach)` aligned
down to an actual checkpoint boundary, with the KV blocks clamped to it. Restoring KV without the
matching recurrent state would be silently wrong, so reuse never goes past a checkpoint.
"""
from dataclasses import dataclass

from scheduler.config import SchedulerConfig
from scheduler.kv_cache import BlockManagerImpl
from scheduler.linear_cache import (LinearStateBlockManager, LinearStateCacheOp,
                                    deepest_hit_at_or_below)
from scheduler.sequence import Sequence


@dataclass
class PrefixMatch:
    """What admitting a sequence would reuse (probed; nothing taken yet)."""
    kv_blocks: list[int]  # matched KV blocks already clamped to `reuse`
    kv_len: int           # tokens the KV leaf matched
    linear_reach: int     # deepest checkpoint boundary the linear leaf matched
    reuse: int            # tokens that will be skipped
    src_slot: int         # checkpoint restored at `reuse`, -1 for a cold start


class CompositeBlockManager:

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.kv = BlockManagerImpl(config.num_kv_blocks, config.block_size,
                                   config.enable_prefix_caching)
        self.linear = (LinearStateBlockManager(config.num_linear_slots, config.chunk_stride,
                                               config.enable_prefix_caching)
                       if config.has_linear_attention_layers else None)

    # -- admission of a sequence with nothing computed -------------------------------------
    def match(self, seq: Sequence) -> PrefixMatch:
        cfg = self.config
        if not cfg.enable_prefix_caching or seq.sampling_params.skip_reading_prefix_cache:
            return PrefixMatch([], 0, 0, 0, -1)  # (a skipping sequence still hashes and caches what it computes)
        seq.update_block_hashes(cfg.block_size, cfg.state_fingerprint)
        kv_blocks = self.kv.match(seq.token_ids, seq.block_hashes)
        kv_len = len(kv_blocks) * cfg.block_size
        if self.linear is None:  # plain KV path: every matched block is reused
            return PrefixMatch(kv_blocks, kv_len, 0, kv_len, -1)
        seq.update_linear_state_hashes(cfg.chunk_stride, cfg.state_fingerprint)
        hits, reach = self.linear.index.match(seq.token_ids, seq.linear_state_hashes)
        reuse, src = deepest_hit_at_or_below(hits, kv_len)  # <= min(kv_len, reach), a checkpoint
        if cfg.unsafe_reuse == "cold":    # ablation: all the KV, a zero GDN state
            return PrefixMatch(kv_blocks, kv_len, reach, kv_len, -1)
        if cfg.unsafe_reuse == "stale":   # ablation: all the KV, the GDN state of the deepest checkpoint below it
            return PrefixMatch(kv_blocks, kv_len, reach, kv_len, src)
        return PrefixMatch(kv_blocks[:reuse // cfg.block_size], kv_len, reach, reuse, src)

    def admissible(self, seq: Sequence, m: PrefixMatch) -> PrefixMatch | None:
        """The match to admit `seq` with now, or None if it does not fit.

        Needs KV blocks for every known token (taken at admission, not chunk by chunk, so a
        prefill never stalls halfway: only decode preempts) and one live slot. If pinning the
        restore source would take the last slot the live state needs, fall back to a cold start.
        """
        if self._fits(seq, m):
            return m
        if m.src_slot > 0:
            cold = PrefixMatch([], m.kv_len, m.linear_reach, 0, -1)
            if self._fits(seq, cold):
                return cold
        return None

    def _fits(self, seq: Sequence, m: PrefixMatch) -> bool:
        new_blocks = -(-len(seq.token_ids) // self.config.block_size) - len(m.kv_blocks)
        if new_blocks > self.kv.num_free_blocks - self.kv.num_evictable_among(m.kv_blocks):
            return False
        if self.linear is not None:
            pinned_now = m.src_slot > 0 and not self.linear.index.is_pinned(m.src_slot)
            if self.linear.num_obtainable - pinned_now < 1:
                return False
        return True

    def admit(self, seq: Sequence, m: PrefixMatch) -> LinearStateCacheOp | None:
        """Mount the reused prefix, allocate the rest, emit the op. `m` from `admissible`."""
        num_tokens = len(seq.token_ids)
        self.kv.allocate_shared(seq, m.kv_blocks)
        self.kv.allocate(seq, num_tokens)
        op = None
        if self.linear is not None:
            src = -1
            if m.src_slot > 0:
                src, boundary, _ = self.linear.allocate_shared(
                    seq.token_ids, seq.linear_state_hashes, limit=m.reuse)
                assert src == m.src_slot and (boundary == m.reuse or self.config.unsafe_reuse == "stale")
            op = self.linear.allocate_for_sequence(seq, num_tokens)
            assert op is not None and op.restore_requested, "admissible promised a live slot"
            op.restore_src_slot_id = src  # the source was pinned before the live slot was taken
        seq.num_computed_tokens = m.reuse
        return op

    # -- n > 1: a child forked from its parent at a block boundary --------------------------
    def can_fork(self, child: Sequence, point: int) -> bool:
        """Room for the child's own blocks from `point` on and one live slot."""
        new_blocks = -(-len(child.token_ids) // self.config.block_size) - point // self.config.block_size
        if new_blocks > self.kv.num_free_blocks:
            return False
        return self.linear is None or self.linear.num_obtainable >= 1

    def fork(self, child: Sequence, parent: Sequence, point: int) -> LinearStateCacheOp | None:
        """Mount the parent's first `point` tokens of KV by refcount (full blocks: `point` is a block boundary),
        allocate the child's own blocks for the rest, and emit a live slot restored from the parent's live slot.
        The copy runs in the step before any forward, so it reads the parent's state at `point` even when the
        parent advances (or rotates its slot into a checkpoint) in the same step."""
        bs = self.config.block_size
        assert point % bs == 0 and parent.num_computed_tokens == point and not child.block_table
        self.kv.allocate_shared(child, parent.block_table[:point // bs])
        self.kv.allocate(child, len(child.token_ids))
        if self.linear is None:
            return None
        assert parent.linear_state_id > 0, "a fork needs the parent's live slot"
        slot = self.linear.acquire_live_slot()
        assert slot is not None, "can_fork promised a live slot"
        child.linear_state_id = slot
        return LinearStateCacheOp(slot, True, parent.linear_state_id, fork=True)

    # -- a running sequence's next step ----------------------------------------------------
    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.kv.can_allocate(seq, num_tokens)

    def allocate(self, seq: Sequence, num_tokens: int) -> LinearStateCacheOp | None:
        """KV blocks up to `num_tokens` positions, then the linear step (deferred save)."""
        self.kv.allocate(seq, num_tokens)
        if self.linear is None:
            return None
        return self.linear.allocate_for_sequence(seq, num_tokens)

    # -- after a step ----------------------------------------------------------------------
    def release_step(self, ops) -> None:
        """Unpin the restore sources a finished step used."""
        for op in ops:
            if op is not None and op.restores_checkpoint:
                self.linear.release_source(op.restore_src_slot_id)

    def on_computed(self, seq: Sequence, saved_in_step: bool = False) -> None:
        """Hash what became full and computed; record a pending save at a chunk boundary, unless the step wrote
        its checkpoints itself (`saved_in_step`: a "scan" prefill)."""
        cfg = self.config
        if not cfg.enable_prefix_caching:
            return
        seq.update_block_hashes(cfg.block_size, cfg.state_fingerprint)
        self.kv.hash_computed_blocks(seq)
        n = seq.num_computed_tokens
        if self.linear is not None and not saved_in_step and n > 0 and n % cfg.chunk_stride == 0:
            seq.update_linear_state_hashes(cfg.chunk_stride, cfg.state_fingerprint)
            seq.pending_save_hash = seq.linear_state_hashes[n // cfg.chunk_stride - 1]
            seq.pending_save_len = n

    def deallocate(self, seq: Sequence) -> None:
        self.kv.deallocate(seq)
        if self.linear is not None:
            self.linear.deallocate(seq)
