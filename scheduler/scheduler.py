"""Continuous batching with chunked prefill aligned to checkpoint boundaries.

A step is either all-prefill or all-decode; prefill goes first whenever something can be
prefilled. A prefill chunk ends at the next multiple of `chunk_stride` (or the end of the known
tokens), so every full chunk leaves the live slot at a checkpoint boundary. Admission takes KV
blocks for every known token and one live slot, so a prefill never stalls halfway; when decode runs
out of KV the most recently admitted sequence is preempted by recompute.
"""
from collections import Counter, deque

from scheduler.composite import CompositeBlockManager, PrefixMatch
from scheduler.config import SchedulerConfig
from scheduler.linear_cache import LinearStateCacheOp
from scheduler.plan import ScheduledSequence, StepPlan
from scheduler.sequence import Sequence, SequenceStatus


class Scheduler:

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.block_manager = CompositeBlockManager(config)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order, oldest first
        self.prefilling: dict[int, Sequence] = {}  # running, more than one token left to compute
        self.seqs: dict[int, Sequence] = {}  # every unfinished sequence by id
        self.inflight: StepPlan | None = None  # scheduled, not yet postprocessed
        self.counters = Counter(queries=0, hits=0, query_tokens=0, reused_tokens=0,
                                checkpoints_restored=0, preemptions=0)

    # -- requests --------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if not seq.token_ids:
            raise ValueError(f"request {seq.seq_id}: empty prompt")
        if len(seq.token_ids) > self.config.max_model_len:
            raise ValueError(f"request {seq.seq_id}: prompt of {len(seq.token_ids)} tokens is longer "
                             f"than max_model_len={self.config.max_model_len}")
        if seq.seq_id in self.seqs:
            raise ValueError(f"request {seq.seq_id}: seq_id already in use")
        if seq.status != SequenceStatus.WAITING or seq.num_computed_tokens or seq.block_table:
            raise ValueError(f"request {seq.seq_id}: sequence was already scheduled")
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def abort(self, seq_id: int) -> bool:
        seq = self.seqs.get(seq_id)
        if seq is None:
            return False
        if seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    # -- one step --------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        assert self.inflight is None, "postprocess the previous plan before scheduling again"
        plan = self._schedule_prefill() or self._schedule_decode()
        for row in plan.seqs if plan else ():
            if row.linear_op is not None and row.linear_op.is_warm_restore:
                self.counters["checkpoints_restored"] += 1
        self.inflight = plan
        return plan

    def _chunk_end(self, num_computed: int, num_tokens: int) -> int:
        stride = self.config.chunk_stride
        return min(num_tokens, (num_computed // stride + 1) * stride)

    def _schedule_prefill(self) -> StepPlan | None:
        budget = self.config.max_num_batched_tokens
        rows: list[ScheduledSequence] = []
        # Sequences admitted earlier whose prompt is still being prefilled.
        for seq in self.prefilling.values():
            end = self._chunk_end(seq.num_computed_tokens, len(seq.token_ids))
            if end - seq.num_computed_tokens > budget:
                continue
            assert self.block_manager.can_allocate(seq, end), "KV is taken for the whole prompt at admission"
            budget -= end - seq.num_computed_tokens
            op = self.block_manager.allocate(seq, end)
            rows.append(self._row(seq, end, op))
        # New (or preempted) sequences, first come first served.
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            m = self.block_manager.admissible(seq, self.block_manager.match(seq))
            if m is None:
                break
            end = self._chunk_end(m.reuse, len(seq.token_ids))
            if end - m.reuse > budget:
                break
            self.waiting.popleft()
            op = self.block_manager.admit(seq, m)
            self._record_admission(seq, m)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            budget -= end - m.reuse
            rows.append(self._row(seq, end, op))
        return StepPlan(is_prefill=True, seqs=rows) if rows else None

    def _schedule_decode(self) -> StepPlan | None:
        rows: list[ScheduledSequence] = []
        scheduled: set[int] = set()
        for seq in list(self.running):
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            end = seq.num_computed_tokens + 1
            if not self._make_room(seq, end, scheduled):
                continue
            op = self.block_manager.allocate(seq, end)
            rows.append(self._row(seq, end, op))
            scheduled.add(seq.seq_id)
        return StepPlan(is_prefill=False, seqs=rows) if rows else None

    def _make_room(self, seq: Sequence, num_tokens: int, scheduled: set[int]) -> bool:
        """Preempt the newest unscheduled running sequences until `seq` gets KV blocks for
        [0, num_tokens). False if `seq` itself had to go."""
        while not self.block_manager.can_allocate(seq, num_tokens):
            victim = next(s for s in reversed(self.running) if s.seq_id not in scheduled)
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _row(self, seq: Sequence, end: int, op: LinearStateCacheOp | None) -> ScheduledSequence:
        bs = self.config.block_size
        start = seq.num_computed_tokens
        table = seq.block_table[:-(-end // bs)]
        if end - start == 1:
            slot_mapping = [table[start // bs] * bs + start % bs]
        else:
            slot_mapping = [table[p // bs] * bs + p % bs for p in range(start, end)]
        return ScheduledSequence(
            seq_id=seq.seq_id, token_ids=seq.token_ids[start:end], start_pos=start,
            block_table=table, slot_mapping=slot_mapping, linear_op=op,
            sample=end == len(seq.token_ids), sampling_params=seq.sampling_params,
            num_generated=seq.num_generated)

    def postprocess(self, plan: StepPlan, sampled_token_ids: list[int | None]) -> list[Sequence]:
        """Advance the sequences of an executed plan; return the ones that finished."""
        assert plan is self.inflight, "postprocess takes the plan of the last schedule()"
        if len(sampled_token_ids) != len(plan.seqs):
            raise ValueError(f"{len(sampled_token_ids)} sampled tokens for {len(plan.seqs)} rows")
        self.inflight = None
        self.block_manager.release_step(row.linear_op for row in plan.seqs)
        finished = []
        for row, token in zip(plan.seqs, sampled_token_ids):
            seq = self.seqs.get(row.seq_id)
            if seq is None or seq.status != SequenceStatus.RUNNING:
                continue  # aborted after it was scheduled
            seq.num_computed_tokens = row.start_pos + len(row.token_ids)
            self.block_manager.on_computed(seq)
            if plan.is_prefill:
                if seq.is_prefilling:
                    self.prefilling[seq.seq_id] = seq
                else:
                    self.prefilling.pop(seq.seq_id, None)
            if not row.sample:
                continue
            if token is None:
                raise ValueError(f"row for seq {row.seq_id} samples but got no token")
            seq.append_token(token)
            reason = self._stop_reason(seq, seq.token_ids[-1])
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        sp = seq.sampling_params
        if not sp.ignore_eos and token == self.config.eos_token_id:
            return "stop"
        if sp.stop_token_ids and token in sp.stop_token_ids:
            return "stop"
        if seq.num_generated >= sp.max_tokens or len(seq.token_ids) >= self.config.max_model_len:
            return "length"
        return None

    # -- lifecycle -------------------------------------------------------------------------
    def _record_admission(self, seq: Sequence, m: PrefixMatch) -> None:
        if self.config.enable_prefix_caching and not seq.sampling_params.skip_reading_prefix_cache:
            self.counters["queries"] += 1
            self.counters["hits"] += m.reuse > 0
            self.counters["query_tokens"] += len(seq.token_ids)
            self.counters["reused_tokens"] += m.reuse
        if seq.num_admissions == 0:  # per-request metrics describe the first admission
            seq.kv_match, seq.linear_reach, seq.num_cached_tokens = m.kv_len, m.linear_reach, m.reuse
            seq.reuse_lost = m.kv_len - m.reuse
            seq.restored = m.src_slot > 0
        seq.num_admissions += 1

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.prefilling.pop(seq.seq_id, None)
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.counters["preemptions"] += 1
        self.waiting.appendleft(seq)

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.prefilling.pop(seq.seq_id, None)
            self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self.seqs[seq.seq_id]

    def reset_prefix_cache(self) -> None:
        """Forget every cached KV block and checkpoint not in use (e.g. between A/B runs)."""
        kv, linear = self.block_manager.kv, self.block_manager.linear
        for block in list(kv.cached_lru):
            kv.evict(block)
        if linear is not None and linear.index is not None:
            for slot in list(linear.index.lru):
                linear.evict_checkpoint(slot)

    # -- observability ---------------------------------------------------------------------
    def stats(self) -> dict:
        kv, linear = self.block_manager.kv, self.block_manager.linear
        out = dict(self.counters)
        out.update(
            checkpoints_saved=linear.num_saved if linear else 0,
            checkpoints_save_skipped=linear.num_save_skipped if linear else 0,
            checkpoints_evicted=linear.num_evicted if linear else 0,
            live_slots=len(linear.live_slots) if linear else 0,
            checkpoint_slots=linear.num_checkpoints if linear else 0,
            free_slots=len(linear.free_slots) if linear else 0,
            kv_blocks_cached=kv.num_cached_blocks,
            kv_blocks_evicted=kv.num_evictions,
            kv_blocks_free=kv.num_free_blocks,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
        )
        return out

    def check_invariants(self) -> None:
        """Cheap consistency checks (tests call this after every step)."""
        bs = self.config.block_size
        for seq in self.running:
            assert seq.status == SequenceStatus.RUNNING and self.seqs[seq.seq_id] is seq
            assert len(seq.block_table) * bs >= seq.num_computed_tokens
            assert seq.num_computed_tokens < len(seq.token_ids) <= self.config.max_model_len
        for seq in self.waiting:
            assert seq.status == SequenceStatus.WAITING and self.seqs[seq.seq_id] is seq
            assert not seq.block_table and seq.linear_state_id == -1 and seq.num_computed_tokens == 0
            assert seq.pending_save_hash is None
        assert len(self.running) + len(self.waiting) == len(self.seqs)
        if self.inflight is None:
            assert list(self.prefilling.values()) == [s for s in self.running if s.is_prefilling]
        assert len(self.running) <= self.config.max_num_seqs
        self.block_manager.kv.check_invariants(self.running)
        linear = self.block_manager.linear
        if linear is not None:
            linear.check_invariants(self.running, pins_allowed=self.inflight is not None)
            if linear.index is not None:
                expected = Counter(row.linear_op.restore_src_slot_id for row in self.inflight.seqs
                                   if row.linear_op.is_warm_restore) if self.inflight else Counter()
                pins = Counter({s: p for s, p in linear.index.pins.items() if p})
                assert pins == expected, "pins differ from the in-flight restore sources"
