"""Continuous batching with chunked prefill aligned to checkpoint boundaries.

With `mixed_steps` ("scan" mode, the default) a step gives each running decode its token (with speculation, its
verify row: `scheduler.speculation`), then fills the rest of `max_num_batched_tokens` with prefill rows (vLLM v1's
single budget); the plan lists the prefill rows first. Otherwise (and always with "promote") a step is all-prefill
or all-decode, prefill first. A prefill row ends at the end of the known tokens or, cut by the budget, at a multiple
of `chunk_stride`, so every row starts on a checkpoint boundary. "scan": a row covers as many strides as the budget
allows and the forward writes the state at each boundary it crosses (`StepPlan.saves`); "promote": a row stops at
each boundary and the next step promotes the live slot. Admission takes KV blocks for every known token and one live
slot, so a prefill never stalls halfway; when decode runs out of KV the newest sequence is preempted by recompute.
The waiting queue admits preempted sequences first, then one sequence per request in turn (`WaitingQueue`), so that
a request of many samples cannot hold up those queued after it; the head waits until it fits, nothing passes it.
The samples of an n > 1 request fork from their parent's state (`scheduler.forks`).
"""
import bisect
import dataclasses
from collections import Counter

from scheduler.composite import CompositeBlockManager, PrefixMatch
from scheduler.config import SchedulerConfig
from scheduler.forks import ForkScheduling
from scheduler.placement import OverlapPlacement
from scheduler.lookahead import AheadScheduling
from scheduler.plan import PENDING_TOKEN, CheckpointSave, LinearStateCacheOp, ScheduledSequence, StepPlan
from scheduler.sequence import Sequence, SequenceStatus
from scheduler.speculation import Speculation
from scheduler.waiting import WaitingQueue


class Scheduler(ForkScheduling, AheadScheduling):

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.block_manager = CompositeBlockManager(config)
        self.waiting = WaitingQueue()  # an abort removes its sequence in O(1)
        self.running: list[Sequence] = []  # admission order, oldest first
        self.prefilling: dict[int, Sequence] = {}  # running, more than one token left to compute
        self.seqs: dict[int, Sequence] = {}  # every unfinished sequence by id
        self.inflight: StepPlan | None = None  # scheduled, not yet postprocessed
        self.aborted_inflight: set[int] = set()  # aborted while their step runs: released at postprocess
        # first admissions only: queries, hits, query_tokens, reused_tokens (re-admissions after preemption are
        # `readmissions`); checkpoints_restored: admissions that restored a checkpoint; rotation_copies: the copies
        # into a fresh live slot after each deferred save; forks: samples of n > 1 forked from their parent (not
        # cache hits); failed_steps: device steps that raised; redone_steps: those recomputed instead (`redo_step`);
        # planned_ahead: steps planned before the samples of the step before were known (async scheduling)
        self.counters = Counter(queries=0, hits=0, query_tokens=0, reused_tokens=0, readmissions=0,
                                checkpoints_restored=0, rotation_copies=0, preemptions=0, forks=0, fork_fallbacks=0,
                                failed_steps=0, failed_requests=0, redone_steps=0, planned_ahead=0)
        # parent seq_id -> (fork point, children not yet forked); the children are in `seqs` only
        self.forks: dict[int, tuple[int, list[Sequence]]] = {}
        # child seq_id -> its parent's, and parent seq_id -> its place in `forks`: a step and an abort look up only
        # the requests they touch, never every queued one
        self.fork_parent: dict[int, int] = {}
        self.fork_rank: dict[int, int] = {}
        self._num_fork_groups = 0
        self.placement = None  # "overlap": `OverlapPlacement`, fed the KV match of each first admission
        self._new_request_step = False  # the last step was one of new requests' first prefills (`new_request_steps`)
        self.end_of_turn = config.checkpoint_placement == "end_of_turn"
        self.spec = Speculation(config, self.block_manager) if config.num_speculative_tokens else None
        if config.checkpoint_placement == "overlap":
            checkpoints = config.num_linear_slots - 1 - config.max_num_seqs
            self.placement = OverlapPlacement(config.chunk_stride, config.prefill_cost,
                                              checkpoints // config.max_num_seqs)

    # -- requests --------------------------------------------------------------------------
    def add(self, seq: Sequence, forks: list[Sequence] = (), group=None) -> None:
        """Queue `seq`; `forks` are further samples of the same prompt (n > 1), forked from `seq` once it has
        computed the fork point instead of each prefilling the prompt. Requests of one `group` (any hashable; None:
        a group of its own) share one lane of the waiting queue, so one client's many prompts take one turn."""
        forks = list(forks)
        for s in [seq] + forks:
            self._check_new(s)
        ids = [s.seq_id for s in [seq] + forks]
        if len(set(ids)) != len(ids):
            raise ValueError(f"request {seq.seq_id}: forks need distinct seq_ids, got {ids}")
        if any(c.token_ids != seq.token_ids for c in forks):
            raise ValueError(f"request {seq.seq_id}: a fork shares its parent's prompt")
        lane = seq.seq_id if group is None else ("group", group)
        bs = self.config.block_size
        if self.end_of_turn and len(seq.token_ids) >= bs:  # the prompt's end is a hinted position
            end = len(seq.token_ids) // bs * bs
            seq.checkpoint_positions = tuple(sorted({*seq.checkpoint_positions, end}))
        self.seqs[seq.seq_id] = seq
        for s in [seq] + forks:
            s.lane = lane
        self.waiting.append(seq, request=lane)
        for c in forks:
            self.seqs[c.seq_id] = c
        point = (len(seq.token_ids) - 1) // self.config.block_size * self.config.block_size
        # a fork reads its parent's live slot while the parent advances: only a step of two or more tokens per row
        # reads every state before writing any (chunk_stride 1 makes every step a one-token step)
        if forks and point > 0 and self.config.chunk_stride > 1:
            self.forks[seq.seq_id] = (point, forks)
            self.fork_rank[seq.seq_id] = self._num_fork_groups
            self._num_fork_groups += 1
            self.fork_parent.update((c.seq_id, seq.seq_id) for c in forks)
        else:  # nothing to share: plain requests
            self.waiting.extend(forks, request=lane)

    def _check_new(self, seq: Sequence) -> None:
        if not seq.token_ids:
            raise ValueError(f"request {seq.seq_id}: empty prompt")
        if len(seq.token_ids) > self.config.max_model_len:
            raise ValueError(f"request {seq.seq_id}: prompt of {len(seq.token_ids)} tokens is longer "
                             f"than max_model_len={self.config.max_model_len}")
        if seq.seq_id in self.seqs:
            raise ValueError(f"request {seq.seq_id}: seq_id already in use")
        if seq.status != SequenceStatus.WAITING or seq.num_computed_tokens or seq.block_table:
            raise ValueError(f"request {seq.seq_id}: sequence was already scheduled")
        seq.check_hints(self.config.block_size)

    def abort(self, seq_id: int) -> bool:
        """Finish a request. One whose step is in flight keeps its KV blocks and live slot until `postprocess` (or
        `fail_step`): the running step still writes them, so they must not be handed to anyone else before."""
        seq = self.seqs.get(seq_id)
        if seq is None or seq_id in self.aborted_inflight:
            return False
        if self.inflight is not None and any(row.seq_id == seq_id for row in self.inflight.seqs):
            if not self.config.async_scheduling:  # (async: released at once, as `scheduler.lookahead` says)
                self.aborted_inflight.add(seq_id)
                return True
        if seq_id in self.forks:  # the children no longer have a parent to fork from
            self._release_forks(seq_id)
        parent = self.fork_parent.pop(seq_id, None)
        if parent is not None:  # a child still waiting for its fork: in no queue
            self.forks[parent][1].remove(seq)
            if not self.forks[parent][1]:
                self._pop_forks(parent)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    # -- one step --------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        assert self.inflight is None, "postprocess the previous plan before scheduling again"
        if self.spec is not None:
            self.spec.begin_step()
        if self.config.mixed_steps and self.config.checkpoint_mode == "scan":
            plan = self._schedule_mixed()
        else:
            plan = self._schedule_prefill() or self._schedule_decode()
        if plan is not None and self.block_manager.host is not None:
            plan = dataclasses.replace(plan, host_ops=self.block_manager.host.drain())
        self.inflight = plan
        return plan

    def _schedule_mixed(self) -> StepPlan | None:
        """Forks first (a child's few tokens; its parent's live slot is read before anything advances it), then a
        decode row, one token, for every running sequence with one token left to compute (but a parent whose children
        fork in this step: it decodes next step), then prefill rows within what is left of the budget. Decode rows
        are allocated (and may preempt) before any admission, and the saves are planned once every row of the step
        has its slots."""
        budget, forked, parents = self.config.max_num_batched_tokens, [], set()
        if self.config.new_request_steps and not self._new_request_step and self.waiting.new_head() is not None:
            # a new request's first prefill runs in a step of its own, so that its first token waits for the step
            # in flight only; every other step stays an ordinary one, so the running requests lose one step in two
            # at most
            rows: list[ScheduledSequence] = []
            self._admit(rows, budget, 0, self.waiting.new_head, self.waiting.pop_new)
            if rows:
                self._new_request_step = True
                return StepPlan(is_prefill=True, seqs=rows, saves=self._plan_saves(rows))
        self._new_request_step = False
        if self.forks:
            budget = self._schedule_forks(forked, budget, parents)
        skip = {r.seq_id for r in forked} | parents
        ready = [s for s in self.running
                 if s.seq_id not in self.prefilling and s.seq_id not in self.forks and s.seq_id not in skip]
        decode = self._decode_rows(ready[:budget], protect=skip)  # a fork's parent and child are never preempted
        prefill = self._prefill_rows(budget - len(decode), forked)
        if not prefill:
            return StepPlan(is_prefill=False, seqs=decode) if decode else None
        return StepPlan(is_prefill=True, seqs=prefill + decode, saves=self._plan_saves(prefill),
                        num_decode_rows=len(decode))

    def _row_budget(self, num_rows: int, longest: int, budget: int) -> int:
        """Tokens one more prefill row may take, after `num_rows` rows of at most `longest` tokens. "scan" also bounds
        the padded batch: the worker pads every row to the longest, so (rows + 1) x longest stays within
        max_num_batched_tokens (0: no room for another row)."""
        if self.config.checkpoint_mode == "promote" or not num_rows:
            return budget
        cap = self.config.max_num_batched_tokens // (num_rows + 1)
        return min(budget, cap) if cap >= longest else 0

    def _chunk_end(self, num_computed: int, num_tokens: int, budget: int) -> int | None:
        """Where a prefill row from `num_computed` ends this step: `num_tokens` if it fits, else the deepest stride
        boundary the budget reaches ("promote": never past the next boundary). None if that is no progress."""
        stride = self.config.chunk_stride
        if self.config.checkpoint_mode == "promote":
            end = min(num_tokens, (num_computed // stride + 1) * stride)
            return end if end - num_computed <= budget else None
        end = min(num_tokens, num_computed + budget)
        if end < num_tokens:
            end = end // stride * stride
        return end if end > num_computed else None

    def _target(self, seq: Sequence, start: int | None = None) -> int:
        """How far `seq` may compute now from `start` (default: what it has computed): a parent stops at its fork
        point until its children are forked, and a prompt at each hinted position (`checkpoint_positions`); from
        a hinted position off the stride grid, at the next stride boundary, so that its later rows start on the
        grid and save their boundaries as any prompt's."""
        pending = self.forks.get(seq.seq_id)
        end = pending[0] if pending is not None else len(seq.token_ids)
        if seq.checkpoint_positions:
            start = seq.num_computed_tokens if start is None else start
            hints, stride = seq.checkpoint_positions, self.config.chunk_stride
            # a row crossing a hint on the grid saves it as any boundary ("scan": `_plan_saves`; "promote" rows stop
            # at every boundary)
            nxt = next((h for h in hints[bisect.bisect_right(hints, start):] if h % stride), end)
            end = min(end, nxt)
            if start % stride and start in hints:
                end = min(end, (start // stride + 1) * stride)
        return end

    def _schedule_prefill(self) -> StepPlan | None:
        rows = self._prefill_rows(self.config.max_num_batched_tokens)
        return StepPlan(is_prefill=True, seqs=rows, saves=self._plan_saves(rows)) if rows else None

    def _prefill_rows(self, budget: int, rows: list[ScheduledSequence] | None = None) -> list[ScheduledSequence]:
        """Prefill rows within `budget` tokens: forks (unless `rows` holds the ones already scheduled), then prompts
        being prefilled, then admissions."""
        if rows is None:
            rows = []
            if self.forks:
                budget = self._schedule_forks(rows, budget)
        longest = max((len(r.token_ids) for r in rows), default=0)  # kept as rows are added: each is read once
        # Sequences admitted earlier whose prompt is still being prefilled.
        for seq in self.prefilling.values():
            end = self._chunk_end(seq.num_computed_tokens, self._target(seq),
                                  self._row_budget(len(rows), longest, budget))
            if end is None:
                continue
            assert self.block_manager.can_allocate(seq, end), "KV is taken for the whole prompt at admission"
            budget -= end - seq.num_computed_tokens
            op = self._allocate(seq, end)
            rows.append(self._row(seq, end, op))
            longest = max(longest, end - seq.num_computed_tokens)
        # Preempted sequences, then new ones, one per request in turn (`WaitingQueue`).
        self._admit(rows, budget, longest, lambda: self.waiting[0] if self.waiting else None, self.waiting.popleft)
        return rows

    def _admit(self, rows: list[ScheduledSequence], budget: int, longest: int, head, pop) -> None:
        """Admit `head()` (None: no more) while it fits in the rows, blocks, slots and `budget`; `pop` takes it
        out of the waiting queue. A request at `max_running_per_request` passes its turn instead."""
        running, passed = self._running_per_request(), set()
        while len(self.running) < self.config.max_num_seqs and (seq := head()) is not None:
            if self._at_bound(running, seq) and self.waiting.pass_turn():  # the other requests' turn
                if seq.lane in passed:  # every request that waits is at its bound
                    break
                passed.add(seq.lane)
                continue
            m = self.block_manager.admissible(seq, self.block_manager.match(seq))
            if m is None:
                break
            # the fork point is cached: the children restore it as well, as ordinary requests
            cached_fork = seq.seq_id in self.forks and m.reuse >= self.forks[seq.seq_id][0]
            target = len(seq.token_ids) if cached_fork else self._target(seq, m.reuse)
            end = self._chunk_end(m.reuse, target, self._row_budget(len(rows), longest, budget))
            if end is None:
                break
            pop()
            if cached_fork:
                self._release_forks(seq.seq_id)
            op = self.block_manager.admit(seq, m)
            self._record_admission(seq, m)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if running is not None:
                running[seq.lane] += 1
            budget -= end - m.reuse
            rows.append(self._row(seq, end, op))
            longest = max(longest, end - m.reuse)

    def _running_per_request(self) -> Counter | None:
        """Running sequences per request (lane), where `max_running_per_request` bounds them (else None)."""
        return Counter(s.lane for s in self.running) if self.config.max_running_per_request else None

    def _at_bound(self, running: Counter | None, seq: Sequence) -> bool:
        """Whether `seq`'s request runs `max_running_per_request` sequences (`running`: `_running_per_request`)."""
        return running is not None and running[seq.lane] >= self.config.max_running_per_request

    def _plan_saves(self, rows: list[ScheduledSequence]) -> list[CheckpointSave]:
        """"scan" mode: a checkpoint slot for each boundary a row crosses (policy "all") or for the deepest one
        ("last"), taken after every row has its live slot (deepest first with compressed checkpoints: few slots). A row
        starting off the stride grid (a fork, the unsafe ablation's KV-only reuse) saves nothing: no chunk ends."""
        cfg = self.config
        if cfg.checkpoint_mode != "scan" or not self.block_manager.saves_checkpoints:
            return []
        stride, saves = cfg.chunk_stride, []
        for i, row in enumerate(rows):
            start, end = row.start_pos, row.start_pos + len(row.token_ids)
            if start % stride:
                continue
            boundaries = list(range(start + stride, end + 1, stride))
            if cfg.checkpoint_policy == "last":
                boundaries = boundaries[-1:]
            seq = self.seqs[row.seq_id]
            if self.placement is not None:
                if not seq.placement_chosen:
                    seq.placed_boundaries = self.placement.boundaries(seq.num_prompt_tokens // stride)
                    seq.placement_chosen = True
                if seq.placed_boundaries is not None:
                    boundaries = [b for b in boundaries if b // stride in seq.placed_boundaries]
            if seq.checkpoint_positions:  # hinted boundaries on the grid (the row stops at the others: `_target`)
                boundaries = sorted({*boundaries, *(h for h in seq.checkpoint_positions
                                                    if h % stride == 0 and start < h <= end)})
            for b in reversed(boundaries) if cfg.offload_checkpoints else boundaries:
                slot = self.block_manager.acquire_save_slot(seq, b)
                if slot is not None:
                    saves.append(CheckpointSave(row=i, offset=b - start, boundary=b, slot=slot))
        return saves

    def _schedule_decode(self) -> StepPlan | None:
        rows = self._decode_rows(list(self.running))
        return StepPlan(is_prefill=False, seqs=rows) if rows else None

    def _decode_rows(self, seqs: list[Sequence], protect: set[int] = frozenset()) -> list[ScheduledSequence]:
        """One-token rows for `seqs` (running, oldest first), preempting the newest running sequences neither
        scheduled nor in `protect` when KV runs out."""
        rows: list[ScheduledSequence] = []
        scheduled: set[int] = set(protect)
        for seq in seqs:
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            end = seq.num_computed_tokens + 1
            reach = end if self.spec is None else self.spec.reach(seq)  # (the drafts' positions too)
            if not self._make_room(seq, reach, scheduled):
                continue
            op = self._allocate(seq, reach)
            row = self._row(seq, end, op)
            rows.append(row if self.spec is None else self.spec.row(seq, row))
            scheduled.add(seq.seq_id)
        return rows

    def _allocate(self, seq: Sequence, end: int) -> LinearStateCacheOp | None:
        """A running sequence's next step; a warm op here is the copy after a deferred save."""
        op = self.block_manager.allocate(seq, end)
        if op is not None and op.restores_checkpoint:
            self.counters["rotation_copies"] += 1
        return op

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
        known = seq.token_ids[start:end]  # (async scheduling: less the token the step in flight samples)
        sample = end == len(seq.token_ids) + seq.num_pending
        assert not (seq.num_pending and sample and seq.sampling_params.uses_penalties), "a history lacks a token"
        return ScheduledSequence(
            seq_id=seq.seq_id, token_ids=known + [PENDING_TOKEN] * (end - start - len(known)), start_pos=start,
            block_table=table, slot_mapping=slot_mapping, linear_op=op,
            sample=sample, sampling_params=seq.sampling_params,
            num_generated=seq.num_generated + seq.num_pending,
            history=seq.history() if sample and seq.sampling_params.uses_penalties else None,
            num_prompt_tokens=seq.num_prompt_tokens, next_token_id=seq.token_ids[end] if end < len(seq) else -1)

    def postprocess(self, plan: StepPlan, sampled_token_ids: list | None, drafts: list | None = None,
                    ahead: bool = False) -> list[Sequence]:
        """Advance the sequences of an executed plan; return the ones that finished. A row's sample is a token, or
        with speculation a list of them (a verify row's: one more than the drafts it accepted), which is cut after a
        token that finishes the sequence; `drafts[i]`: the MTP block's drafts after row i's samples. `ahead` (async
        scheduling): the plan is still running and its samples are not known: each sampling row's token is left
        pending (`resolve` appends it), so that the next step can be planned now."""
        assert plan is self.inflight, "postprocess takes the plan of the last schedule()"
        if not ahead and len(sampled_token_ids) != len(plan.seqs):
            raise ValueError(f"{len(sampled_token_ids)} sampled tokens for {len(plan.seqs)} rows")
        self.counters["planned_ahead"] += ahead
        self.inflight = None
        self.block_manager.finish_step(plan, completed=True)
        self._release_aborted_inflight()
        finished = []
        for i, (row, token) in enumerate(zip(plan.seqs, sampled_token_ids or [None] * len(plan.seqs))):
            seq = self.seqs.get(row.seq_id)
            if seq is None or seq.status != SequenceStatus.RUNNING:
                continue  # aborted after it was scheduled
            seq.num_computed_tokens = row.start_pos + (len(row.token_ids) if self.spec is None else
                                                       self.spec.computed(seq, row, token))
            prefill_row = i < plan.num_prefill_rows
            # a "scan" row saved its boundaries in the step, unless it started off the stride grid (`_plan_saves`)
            scanned = (prefill_row and self.config.checkpoint_mode == "scan"
                       and row.start_pos % self.config.chunk_stride == 0)
            self.block_manager.on_computed(seq, saved_in_step=scanned)
            if seq.checkpoint_positions and seq.num_computed_tokens in seq.checkpoint_positions:
                self.block_manager.keep_state(seq, seq.num_computed_tokens)
            elif self.end_of_turn and not prefill_row and seq.num_computed_tokens % self.config.block_size == 0:
                self.block_manager.keep_state(seq, seq.num_computed_tokens, replaces=True)  # where the output is
            if prefill_row:
                if seq.is_prefilling:
                    self.prefilling[seq.seq_id] = seq
                else:
                    self.prefilling.pop(seq.seq_id, None)
            if not row.sample:
                continue
            if ahead:
                seq.num_pending += 1
                continue
            if self.spec is not None:  # (its samples are appended: `Speculation.computed`)
                reason = self.spec.stopped
                seq.draft_token_ids = list(drafts[i]) if drafts is not None and drafts[i] is not None else []
            elif token is None:
                raise ValueError(f"row for seq {row.seq_id} samples but got no token")
            else:
                seq.append_token(token)
                reason = seq.stop_reason(token, self.config.eos_token_id, self.config.max_model_len)
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    def _release_aborted_inflight(self) -> None:
        ids, self.aborted_inflight = sorted(self.aborted_inflight), set()
        for seq_id in ids:
            seq = self.seqs.get(seq_id)
            if seq is not None:
                seq.pending_save_hash = None  # its step may not have completed: save nothing of it
                self.abort(seq_id)

    def fail_step(self, plan: StepPlan) -> list[Sequence]:
        """The device step of `plan` raised: finish its sequences with "error" and release everything they held
        (KV blocks, live slots, restore pins, pending saves). Nothing of the step is indexed: its KV blocks were never
        hashed and its live slots are freed, not promoted. Returns the sequences that were failed."""
        assert plan is self.inflight, "fail_step takes the plan of the last schedule()"
        self.inflight = None
        self.block_manager.finish_step(plan, completed=False)
        self._release_aborted_inflight()
        failed = []
        for row in plan.seqs:
            seq = self.seqs.get(row.seq_id)
            if seq is None or seq.status != SequenceStatus.RUNNING:
                continue
            seq.pending_save_hash = None
            self._finish(seq, "error")
            failed.append(seq)
            for child in self._pop_forks(seq.seq_id) if seq.seq_id in self.forks else ():  # samples waiting to fork
                self._finish(child, "error")
                failed.append(child)
        self.counters["failed_steps"] += 1
        self.counters["failed_requests"] += len(failed)
        return failed

    def redo_step(self, plan: StepPlan, pools_kept: bool = False) -> None:
        """The device step of `plan` raised without fault of its sequences (an executable that must be compiled
        again), or was interrupted before its postprocess: nothing of the step is kept, and every running sequence,
        the step's too, is preempted and computed again; none fails. Unless `pools_kept`, the device state may have
        been lost or replaced, so the prefix cache is emptied too (`drop_device_state`). With `pools_kept` (the pools
        are those before the step or after it: a step writes only its rows' live slots, the KV positions they had
        not computed, and the checkpoint slots it saves into, none of them indexed yet) the prefix cache stays, and
        the preempted sequences match it again when they are readmitted."""
        assert plan is self.inflight, "redo_step takes the plan of the last schedule()"
        self.inflight = None
        self.block_manager.finish_step(plan, completed=False)
        self._release_aborted_inflight()
        for row in plan.seqs:
            seq = self.seqs.get(row.seq_id)
            if seq is not None:
                seq.pending_save_hash = None
        self.counters["redone_steps"] += 1
        self.drop_pending()  # (async scheduling: every sequence is computed again, its samples too)
        if pools_kept:
            self._preempt_running()
        else:
            self.drop_device_state()

    def drop_device_state(self) -> None:
        """The device pools were lost (e.g. a failed step had consumed its donated buffers): nothing cached and no
        running sequence's state can be trusted. Running sequences are preempted (recomputed from scratch) and the
        prefix cache is emptied. Call with no plan in flight."""
        assert self.inflight is None, "fail or postprocess the in-flight plan first"
        self._preempt_running()
        self.reset_prefix_cache()

    def _preempt_running(self) -> None:
        """Preempt every running sequence: its live state is not trusted, so nothing of it becomes a checkpoint."""
        for seq in list(reversed(self.running)):
            seq.pending_save_hash = None
            self._preempt(seq)

    # -- lifecycle -------------------------------------------------------------------------
    def _record_admission(self, seq: Sequence, m: PrefixMatch) -> None:
        if self.placement is not None and seq.num_admissions == 0:
            self.placement.observe(m.kv_match)
        restored = m.restore_src_slot_id > 0 or m.host_key is not None
        self.counters["checkpoints_restored"] += restored
        if seq.num_admissions > 0:
            self.counters["readmissions"] += 1
        elif self.config.enable_prefix_caching and not seq.sampling_params.skip_reading_prefix_cache:
            self.counters["queries"] += 1
            self.counters["hits"] += m.reuse > 0
            self.counters["query_tokens"] += len(seq.token_ids)
            self.counters["reused_tokens"] += m.reuse
        if seq.num_admissions == 0:  # per-request metrics describe the first admission
            seq.kv_match, seq.linear_reach, seq.num_cached_tokens = m.kv_match, m.linear_reach, m.reuse
            seq.reuse_lost = m.kv_match - m.reuse
            seq.restored = restored
        seq.num_admissions += 1

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.prefilling.pop(seq.seq_id, None)
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        seq.max_num_computed_tokens = max(seq.max_num_computed_tokens, seq.num_computed_tokens)
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

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block and checkpoint not in use (e.g. between A/B runs). True when the prefix
        cache is then empty, False when running requests still hold some of it (`CompositeBlockManager`)."""
        return self.block_manager.reset_prefix_cache()

    # -- observability ---------------------------------------------------------------------
    def stats(self) -> dict:
        out = dict(self.counters, spec_draft_tokens=self.spec.num_draft_tokens if self.spec else 0,
                   spec_accepted_tokens=self.spec.num_accepted_tokens if self.spec else 0)
        out.update(self.block_manager.stats(), num_running=len(self.running), num_waiting=len(self.waiting))
        return out

    def check_invariants(self) -> None:
        """Cheap consistency checks (tests call this after every step)."""
        bs = self.config.block_size
        for seq in self.running:
            assert seq.status == SequenceStatus.RUNNING and self.seqs[seq.seq_id] is seq
            assert len(seq.block_table) * bs >= seq.num_computed_tokens
            assert seq.num_computed_tokens < len(seq.token_ids) + seq.num_pending <= self.config.max_model_len
        for seq in self.waiting:
            assert seq.status == SequenceStatus.WAITING and self.seqs[seq.seq_id] is seq
            assert not seq.block_table and seq.linear_state_id == -1 and seq.num_computed_tokens == 0
            assert seq.pending_save_hash is None
        pending = [c for _, children in self.forks.values() for c in children]
        for parent_id, (point, children) in self.forks.items():
            parent = self.seqs[parent_id]
            assert parent.status != SequenceStatus.FINISHED and parent.num_computed_tokens <= point and children
            assert point % bs == 0 and all(c.token_ids == parent.token_ids for c in children)
        for seq in pending:
            assert seq.status == SequenceStatus.WAITING and self.seqs[seq.seq_id] is seq
            assert not seq.block_table and seq.linear_state_id == -1 and seq.num_computed_tokens == 0
        assert self.fork_parent == {c.seq_id: p for p, (_, children) in self.forks.items() for c in children}
        assert self.fork_rank.keys() == self.forks.keys()
        assert sorted(self.forks, key=self.fork_rank.__getitem__) == list(self.forks)
        assert len(self.running) + len(self.waiting) + len(pending) == len(self.seqs)
        if self.inflight is None:
            assert list(self.prefilling.values()) == [s for s in self.running if s.is_prefilling]
        assert len(self.running) <= self.config.max_num_seqs
        self.block_manager.check_invariants(self.running, self.inflight)
