"""CompositeBlockManager: the scheduler's only door to cache state, over the KV leaf and the linear leaf.

It decides how much of a new sequence's prefix is reused: `min(kv_match, linear_reach)` aligned
down to an actual checkpoint boundary, with the KV blocks clamped to it. Restoring KV without the
matching recurrent state would be silently wrong, so reuse never goes past a checkpoint. The prefix is
matched once (`match`); `admit` takes exactly what that match found. It also owns the step's cache
bookkeeping (saves, pins), `reset_prefix_cache`, `stats` and `check_invariants`.
"""
from collections import Counter
from dataclasses import dataclass

from scheduler.eviction import eviction_policy
from scheduler.config import SchedulerConfig
from scheduler.host_tier import HostTier
from scheduler.kv_cache import BlockManagerImpl
from scheduler.linear_cache import LinearStateBlockManager, deepest_hit_at_or_below
from scheduler.plan import LinearStateCacheOp, StepPlan
from scheduler.sequence import Sequence


@dataclass(frozen=True)
class PrefixMatch:
    """What admitting a sequence would reuse (probed; nothing taken yet)."""
    kv_blocks: list[int]      # matched KV blocks already clamped to `reuse`
    kv_match: int             # tokens the KV leaf matched
    linear_reach: int         # deepest checkpoint boundary the linear leaf matched
    reuse: int                # tokens that will be skipped
    restore_src_slot_id: int  # checkpoint restored at `reuse`, -1 for a cold start
    host_key: int | None = None  # a tier hit at `reuse`: copied into the live slot at admission (`HostTier`)


class CompositeBlockManager:

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.kv = BlockManagerImpl(config.num_kv_blocks, config.block_size,
                                   config.enable_prefix_caching)
        eviction = eviction_policy(config.checkpoint_eviction, config.prefill_cost, config.eviction_alpha)
        self.linear = (LinearStateBlockManager(config.num_linear_slots, config.chunk_stride,
                                               config.enable_prefix_caching, eviction, config.num_draft_slots)
                       if config.has_linear_attention_layers else None)
        self.host = None
        if config.num_host_checkpoints and self.saves_checkpoints:
            self.host = self.linear.index.host = HostTier(config.num_host_checkpoints, config.chunk_stride)

    @property
    def saves_checkpoints(self) -> bool:
        """Checkpoints exist at all: GDN layers and prefix caching."""
        return self.linear is not None and self.config.enable_prefix_caching

    # -- admission of a sequence with nothing computed -------------------------------------
    def match(self, seq: Sequence) -> PrefixMatch:
        """Walk both leaves' indexes once; the admission takes what this finds."""
        cfg = self.config
        if not cfg.enable_prefix_caching or seq.sampling_params.skip_reading_prefix_cache:
            return PrefixMatch([], 0, 0, 0, -1)  # (a skipping sequence still hashes and caches what it computes)
        seq.update_block_hashes(cfg.block_size, cfg.state_fingerprint)
        kv_blocks = self.kv.match(seq.token_ids, seq.block_hashes)
        if seq.num_admissions and seq.sampling_params.prompt_logprobs is not None:
            # re-admitted after a preemption: its prompt logprobs exist up to where it had computed (and the first
            # admission's reuse); a prefix that another request cached further since would leave the positions
            # past that without their logprobs, so the reuse stops there
            kv_blocks = kv_blocks[:seq.max_num_computed_tokens // cfg.block_size]
        kv_match = len(kv_blocks) * cfg.block_size
        if self.linear is None:  # plain KV path: every matched block is reused
            return PrefixMatch(kv_blocks, kv_match, 0, kv_match, -1)
        seq.update_linear_state_hashes(cfg.chunk_stride, cfg.state_fingerprint)
        if self.host is not None and cfg.offload_checkpoints:  # every restore reads a compressed checkpoint
            self.linear.offload_unpinned()
        hits, reach = self.linear.match(seq.token_ids, seq.linear_state_hashes)
        reuse, src = deepest_hit_at_or_below(hits, kv_match)  # <= min(kv_match, reach), a checkpoint
        if cfg.unsafe_reuse == "cold":    # ablation: all the KV, a zero GDN state
            return PrefixMatch(kv_blocks, kv_match, reach, kv_match, -1)
        if cfg.unsafe_reuse == "stale":   # ablation: all the KV, the GDN state of the deepest checkpoint below it
            return PrefixMatch(kv_blocks, kv_match, reach, kv_match, src)
        top = min(kv_match, (len(seq.token_ids) - 1) // cfg.block_size * cfg.block_size)
        if self.linear.index.num_off_grid:  # a block boundary off the stride grid (`keep_state`)
            depth, slot = self.linear.index.match_blocks(seq.block_hashes, cfg.block_size, reuse, top)
            if depth > reuse:
                reuse, src, reach = depth, slot, max(reach, depth)
        if self.host is not None and self.host.entries:  # deeper on the host than on the device
            usable = min((len(seq.token_ids) - 1) // cfg.chunk_stride, len(seq.linear_state_hashes))
            depth, h = self.host.match(seq.linear_state_hashes, usable, seq.block_hashes, cfg.block_size, reuse, top)
            if depth > reuse:
                return PrefixMatch(kv_blocks[:depth // cfg.block_size], kv_match, max(reach, depth), depth, -1, h)
        return PrefixMatch(kv_blocks[:reuse // cfg.block_size], kv_match, reach, reuse, src)

    def admissible(self, seq: Sequence, m: PrefixMatch) -> PrefixMatch | None:
        """The match to admit `seq` with now, or None if it does not fit.

        Needs KV blocks for every known token (taken at admission, not chunk by chunk, so a
        prefill never stalls halfway: only decode preempts) and one live slot. If pinning the
        restore source would take the last slot the live state needs, fall back to a cold start.
        """
        if self._fits(seq, m):
            return m
        if m.restore_src_slot_id > 0 or m.host_key is not None:
            cold = PrefixMatch([], m.kv_match, m.linear_reach, 0, -1)
            if self._fits(seq, cold):
                return cold
        return None

    def _fits(self, seq: Sequence, m: PrefixMatch) -> bool:
        """KV blocks for the known tokens past the reused ones, and one live slot. The restore source is no part of
        the sequence's budget (it holds a pin for the step only); it counts only when pinning it takes an unpinned
        checkpoint out of the slots that the live slot could be taken from."""
        new_blocks = -(-len(seq.token_ids) // self.config.block_size) - len(m.kv_blocks)
        if new_blocks > self.kv.num_free_blocks - self.kv.num_evictable_among(m.kv_blocks):
            return False
        if self.linear is not None:
            pinned_now = m.restore_src_slot_id > 0 and not self.linear.is_pinned(m.restore_src_slot_id)
            if self.linear.num_obtainable - pinned_now < 1:
                return False
        return True

    def admit(self, seq: Sequence, m: PrefixMatch) -> LinearStateCacheOp | None:
        """Mount the reused prefix `m` found (from `admissible`, with nothing allocated since), allocate the rest,
        and return the row's op: a live slot restored from the match's source, pinned before the live slot is
        taken."""
        self.kv.allocate_shared(seq, m.kv_blocks)
        self.kv.allocate(seq, len(seq.token_ids))
        op = None
        if self.linear is not None:
            if m.host_key is not None:
                self.host.reserve(m.host_key)
            op = self.linear.admit(seq, m.restore_src_slot_id)
            assert op is not None, "admissible promised a live slot"
            if m.host_key is not None:  # the tier's entry is copied into the live slot before the step, which reads it
                self.host.load(m.host_key, op.linear_state_id)
                op = LinearStateCacheOp(op.linear_state_id)
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
        assert child.token_ids == parent.token_ids
        # the same tokens: the same hash chains, taken rather than each sample hashing the whole prompt again
        child.block_hashes, child.linear_state_hashes = parent.block_hashes[:], parent.linear_state_hashes[:]
        self.kv.allocate_shared(child, parent.block_table[:point // bs])
        self.kv.allocate(child, len(child.token_ids))
        if self.linear is None:
            return None
        assert parent.linear_state_id > 0, "a fork needs the parent's live slot"
        op = self.linear.admit(child, parent.linear_state_id, fork=True)
        assert op is not None, "can_fork promised a live slot"
        return op

    def keep_state(self, seq: Sequence, point: int, replaces: bool = False) -> None:
        """`seq` has just computed `point` tokens (a block boundary): its state there becomes a checkpoint, like a
        deferred save (the live slot turns into it at the sequence's next step, or its release). Off the stride grid
        it is keyed by the KV hash of the block ending at `point`. For a fork point that samples could not fork from
        (they restore it instead of prefilling the prompt) and for an application's hinted positions; nothing when
        that checkpoint exists or is being saved. With `replaces` (the end of an output so far) the sequence's
        previous such checkpoint off the grid is dropped, if no step restores it: one per sequence is kept."""
        cfg = self.config
        if not self.saves_checkpoints or seq.pending_save_hash is not None:
            return
        if point % cfg.chunk_stride:
            seq.update_block_hashes(cfg.block_size, cfg.state_fingerprint)
            h = seq.block_hashes[point // cfg.block_size - 1]
        else:
            h = self._stride_key(seq, point)
        index = self.linear.index
        if index.contains(h) or h in self.linear.saving_hashes:
            return
        seq.pending_save_hash, seq.pending_save_len = h, point
        if replaces:
            slot = index.slot_of.get(seq.replaced_hash)
            if slot is not None and slot in index.lru and index.depth_of[slot] % cfg.chunk_stride:
                self.linear.evict_checkpoint(slot)
            seq.replaced_hash = h if point % cfg.chunk_stride else None

    # -- a running sequence's next step ----------------------------------------------------
    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.kv.can_allocate(seq, num_tokens)

    def allocate(self, seq: Sequence, num_tokens: int) -> LinearStateCacheOp | None:
        """KV blocks up to `num_tokens` positions, then the linear step (deferred save)."""
        self.kv.allocate(seq, num_tokens)
        if self.linear is None:
            return None
        return self.linear.allocate_for_sequence(seq, num_tokens)

    # -- checkpoints the step writes ("scan" mode) --------------------------------------------
    def acquire_save_slot(self, seq: Sequence, boundary: int) -> int | None:
        """A slot for the step to write `seq`'s checkpoint at `boundary` (a chunk_stride multiple) into, or None
        (counted as skipped) when that checkpoint exists or is being saved already, or no slot can be had."""
        return self.linear.acquire_save_slot(self._stride_key(seq, boundary), boundary)

    def _stride_key(self, seq: Sequence, boundary: int) -> int:
        """The checkpoint key of `seq`'s state at `boundary`, a chunk_stride multiple: its linear chain hash there."""
        seq.update_linear_state_hashes(self.config.chunk_stride, self.config.state_fingerprint)
        return seq.linear_state_hashes[boundary // self.config.chunk_stride - 1]

    # -- after a step ----------------------------------------------------------------------
    def finish_step(self, plan: StepPlan, completed: bool) -> None:
        """Unpin the restore sources the step used; index the checkpoints it wrote if it `completed`, else give
        their slots back (whatever became of their sequences since)."""
        for row in plan.seqs:
            if row.linear_op is not None and row.linear_op.restores_checkpoint:
                self.linear.release_source(row.linear_op.restore_src_slot_id)
        for save in plan.saves:
            if completed:
                self.linear.commit_save(save.slot)
            else:
                self.linear.cancel_save(save.slot)
        if not completed and self.host is not None:  # its copies may not have run: nothing of them is trusted
            self.host.cancel(plan.host_ops)

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
            seq.pending_save_hash, seq.pending_save_len = self._stride_key(seq, n), n

    def deallocate(self, seq: Sequence) -> None:
        self.kv.deallocate(seq)
        if self.linear is not None:
            self.linear.deallocate(seq)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block and checkpoint not in use. True when the prefix cache is then empty; False
        when running requests still hold cached blocks or checkpoints (kept, and still matched), or a step in flight
        is writing checkpoints."""
        self.kv.reset_prefix_cache()
        if self.linear is None:
            return self.kv.num_cached_blocks == 0
        self.linear.reset_prefix_cache()
        if self.host is not None:  # (the engine drops their bytes with the next step's plan)
            for h in list(self.host.entries):
                self.host.forget(h)
        return self.kv.num_cached_blocks == 0 and self.linear.num_checkpoints == 0 and not self.linear.saving

    # -- observability ---------------------------------------------------------------------
    def stats(self) -> dict:
        """The leaves' figures (slot counts are 0 without GDN layers)."""
        out = (self.linear.stats() if self.linear is not None else
               dict(checkpoints_saved=0, checkpoints_save_skipped=0, checkpoints_evicted=0, live_slots=0,
                    checkpoint_slots=0, free_slots=0))
        out.update(self.kv.stats())
        host, compressed = self.host, self.config.offload_checkpoints  # (an empty tier is falsy: `len`)
        out.update(host_checkpoints=len(host) if host is not None and not compressed else 0,
                   compressed_checkpoints=len(host) if host is not None and compressed else 0,
                   checkpoints_offloaded=host.num_offloaded if host is not None else 0,
                   checkpoints_onloaded=host.num_onloaded if host is not None else 0)
        return out

    def check_invariants(self, running: list[Sequence], inflight: StepPlan | None) -> None:
        """Both leaves consistent with the running sequences; while a step is in flight, exactly its restore sources
        are pinned and exactly its saves are being written."""
        self.kv.check_invariants(running)
        if self.linear is None:
            return
        saves = {save.slot for save in inflight.saves} if inflight is not None else set()
        sources = Counter(row.linear_op.restore_src_slot_id for row in inflight.seqs
                          if row.linear_op.restores_checkpoint) if inflight is not None else Counter()
        self.linear.check_invariants(running, pins_allowed=inflight is not None, saves=saves, sources=sources)
