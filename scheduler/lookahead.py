"""Async scheduling: the next step is planned while the device runs this one, before this one's samples are known.

`Scheduler.postprocess(plan, None, ahead=True)` advances the plan's sequences with each sampled token pending
(`Sequence.num_pending`; the next row's token is `PENDING_TOKEN`, which the worker takes from the step's results on
the device); `resolve` appends the tokens once they are known and ends the sequences they finish. Such a sequence
may have a row in the step in flight, computed for nothing, and its blocks and live slot are released before that
step ends: its writes to them come before any later step's use (the pools pass from step to step, in order), and no
checkpoint save of it is pending (planning its row took the one there was: `LinearStateBlockManager.save_pending`).
"""
from scheduler.plan import StepPlan
from scheduler.sequence import Sequence, SequenceStatus


class AheadScheduling:
    """The `Scheduler`'s part of async scheduling (`SchedulerConfig.async_scheduling`)."""

    def can_look_ahead(self, plan: StepPlan) -> bool:
        """Whether the step after `plan` may be planned before its samples are known: not with speculation (a row's
        tokens are known only once its drafts are verified), not while forks wait for their parents, and not when a
        row that samples uses penalties (its next row's history would lack the token)."""
        return (self.config.async_scheduling and self.spec is None and not self.forks
                and not any(r.sample and r.sampling_params.uses_penalties for r in plan.seqs))

    def resolve(self, plan: StepPlan, sampled_token_ids: list) -> set[int]:
        """The samples of a plan postprocessed ahead: each pending token is appended, and the sequences they finish
        end. A sequence finished, aborted or computed again meanwhile (`redo_step`) is passed over. Returns the rows
        whose tokens were appended."""
        if len(sampled_token_ids) != len(plan.seqs):
            raise ValueError(f"{len(sampled_token_ids)} sampled tokens for {len(plan.seqs)} rows")
        kept = set()
        for i, (row, token) in enumerate(zip(plan.seqs, sampled_token_ids)):
            seq = self.seqs.get(row.seq_id)
            if not row.sample or seq is None or not seq.num_pending:
                continue
            if token is None:
                raise ValueError(f"row for seq {row.seq_id} samples but got no token")
            seq.num_pending -= 1
            seq.append_token(token)
            kept.add(i)
            reason = seq.stop_reason(token, self.config.eos_token_id, self.config.max_model_len)
            if reason is None:
                continue
            assert seq.pending_save_hash is None or not self._in_flight(seq), "a save pending past its boundary"
            if seq.status == SequenceStatus.WAITING:  # preempted when the step in flight was planned
                self.waiting.remove(seq)
            self._finish(seq, reason)
        return kept

    def fail_pending(self, plan: StepPlan, step_counted: bool) -> list[Sequence]:
        """A plan postprocessed ahead whose samples will not come (its step, or the launch of the next, raised): the
        sequences waiting for them end with "error", as a failed step's do (`fail_step`; `step_counted`: it counted
        this failure already), and every other pending token is dropped. Returns the sequences failed."""
        failed = []
        for row in plan.seqs:
            seq = self.seqs.get(row.seq_id)
            if seq is None or not seq.num_pending:
                continue
            if seq.status == SequenceStatus.WAITING:
                self.waiting.remove(seq)
            seq.pending_save_hash = None
            self._finish(seq, "error")
            failed.append(seq)
        self.counters["failed_steps"] += not step_counted
        self.counters["failed_requests"] += len(failed)
        self.drop_pending()
        return failed

    def _in_flight(self, seq: Sequence) -> bool:
        return self.inflight is not None and any(row.seq_id == seq.seq_id for row in self.inflight.seqs)

    def drop_pending(self) -> None:
        """After a failed step: no pending token will come; each is sampled again when its sequence computes on."""
        for seq in self.seqs.values():
            seq.num_pending = 0
