"""Speculative decoding at the scheduler level: verify rows, the draft slots, and the rollback of a rejection.

The fake device computes a verify row as the worker does: the row's tokens (the last sample and its drafts) are
written to the KV, the state after each draft goes to the row's draft slot, the live slot advances over them all;
it samples at every position with the fake model and keeps the drafts that match. Its drafts are the fake model's
own continuation with some tokens made wrong, so that every acceptance length happens. The plain fake device then
checks, at every later step, that each live state and each KV read is exactly the sequence's prefix, and that each
checkpoint holds exactly the tokens its hash names: a rejected draft never reaches a state or a checkpoint."""
import random

import pytest

from scheduler import Scheduler
from tests.scheduler.sched_helpers import FakeDevice, make_seq, next_token, small_config, submit

PROMPTS = [[3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 0, 2, 6, 4, 3, 3, 2, 3, 0], [2, 0, 1, 1, 2, 1],
           [1, 4, 1, 4, 2, 1, 3, 5, 6, 2, 3, 0, 3, 0, 2, 5, 0, 4, 1, 1, 2, 0, 4]]


class SpecDevice(FakeDevice):
    """`FakeDevice` with verify rows, and drafts: the model's continuation, each token wrong with `p_wrong`."""

    def __init__(self, config, k: int, p_wrong: float, seed: int = 0):
        super().__init__(config)
        self.k, self.p_wrong, self.rng = k, p_wrong, random.Random(seed)
        self.accepted: list[tuple[int, int]] = []  # (drafts, accepted) per verify row

    def drafts(self, seq_id: int) -> list[int]:
        toks, out = list(self.tokens[seq_id]), []
        for _ in range(self.k):
            t = next_token(toks)
            if self.rng.random() < self.p_wrong:
                t = (t + 1) % 7
            out.append(t)
            toks.append(t)
        return out

    def execute(self, plan):
        # every decode row is a verify row (of no drafts, some); saves index the prefill rows, which come first
        verify = range(plan.num_prefill_rows if plan.is_prefill else 0, len(plan.seqs))
        plain = type(plan)(plan.is_prefill, plan.prefill_seqs, plan.saves, 0, plan.host_ops)
        sampled = dict(enumerate(super().execute(plain))) if plain.seqs else {}
        bs = self.config.block_size
        for i in verify:
            row = plan.seqs[i]
            toks, start, drafts = self.tokens[row.seq_id], row.start_pos, list(row.draft_token_ids)
            assert row.token_ids == [toks[start]] + drafts and len(toks) == start + 1 and row.sample
            assert len(row.draft_slots) == len(drafts) and len(set(row.draft_slots)) == len(drafts)
            assert 0 not in row.block_table and len(row.block_table) >= -(-(start + len(row.token_ids)) // bs)
            stride = self.config.chunk_stride
            assert start + len(row.token_ids) <= (start // stride + 1) * stride, "a verify row crosses a boundary"
            live = row.linear_op.linear_state_id
            if row.linear_op.restore_requested:  # the copy after a deferred save
                self.state[live] = self.state[row.linear_op.restore_src_slot_id]
            assert self.state.get(live) == tuple(toks[:start])
            assert not set(row.draft_slots) & {r.linear_op.linear_state_id for r in plan.seqs}
            seen = toks[:start] + row.token_ids  # what the row computes, drafts included
            for j, slot in enumerate(row.draft_slots):
                self.state[slot] = tuple(seen[:start + j + 1])
            self.state[live] = tuple(seen)
            for p in range(start, start + len(row.token_ids)):
                assert row.slot_mapping[p - start] == row.block_table[p // bs] * bs + p % bs
                self.kv[(row.block_table[p // bs], p % bs)] = seen[p]
            for p in range(start):
                assert self.kv.get((row.block_table[p // bs], p % bs)) == toks[p]
            out = []
            for j in range(len(drafts) + 1):  # sample at each position until a draft differs
                t = next_token(toks)
                toks.append(t)
                out.append(t)
                if j == len(drafts) or drafts[j] != t:
                    break
            if drafts:
                self.accepted.append((len(drafts), len(out) - 1))
            self.num_tokens_computed += len(row.token_ids)
            sampled[i] = out
        out = [sampled[i] for i in range(len(plan.seqs))]
        return [t if isinstance(t, list) or t is None else [t] for t in out]


def _serve(cfg, k: int, p_wrong: float, max_tokens: int = 30, **sp):
    sched, dev = Scheduler(cfg), SpecDevice(cfg, k, p_wrong)
    seqs = [submit(sched, dev, make_seq(i + 1, p, max_tokens=max_tokens, ignore_eos=True, **sp))
            for i, p in enumerate(PROMPTS)]
    plans = []
    while sched.has_unfinished():
        plans.append(_step(sched, dev)[0])
    return seqs, plans, dev, sched


def _step(sched, dev):
    """One step, checked: (its plan, the samples the scheduler kept per row)."""
    plan = sched.schedule()
    sampled = dev.execute(plan)
    sched.check_invariants()
    drafts = [dev.drafts(r.seq_id) if r.sample else None for r in plan.seqs]
    # the device made its samples the sequence's; the scheduler appends them, cut after one that finishes it
    for r, s in zip(plan.seqs, sampled):
        if s is not None:
            del dev.tokens[r.seq_id][len(dev.tokens[r.seq_id]) - len(s):]
    sched.postprocess(plan, sampled, drafts)
    for r, s in zip(plan.seqs, sampled):
        if s is not None:
            dev.tokens[r.seq_id] += s
    sched.check_invariants()
    dev.check_checkpoints(sched)
    return plan, sampled


@pytest.mark.parametrize("k, p_wrong", [(1, 0.3), (3, 0.0), (3, 0.25), (3, 1.0)])
def test_verify_rows_keep_exactly_the_accepted_drafts_and_roll_back_the_rest(k, p_wrong):
    cfg = small_config(num_speculative_tokens=k, num_linear_slots=16 + 4 * k)
    seqs, plans, dev, sched = _serve(cfg, k, p_wrong)
    plain = [make_seq(i + 1, p, max_tokens=30, ignore_eos=True) for i, p in enumerate(PROMPTS)]
    ref_sched, ref_dev = Scheduler(small_config()), FakeDevice(small_config())
    for s in plain:
        submit(ref_sched, ref_dev, s)
    while ref_sched.has_unfinished():
        plan = ref_sched.schedule()
        ref_sched.postprocess(plan, ref_dev.execute(plan))
    assert [s.output_token_ids for s in seqs] == [s.output_token_ids for s in plain]
    drafted, accepted = sum(d for d, _ in dev.accepted), sum(a for _, a in dev.accepted)
    assert sched.stats()["spec_draft_tokens"] == drafted and sched.stats()["spec_accepted_tokens"] == accepted
    assert sum(s.num_accepted_tokens for s in seqs) == accepted
    lengths = {a for _, a in dev.accepted}
    if p_wrong == 0.0:
        assert accepted == drafted > 0  # a draft is cut only at a boundary, max_tokens or the model's end
    elif p_wrong == 1.0:
        assert accepted == 0 and drafted > 0
    else:
        assert 0 < accepted < drafted and len(lengths) > 1
    # boundaries crossed while decoding became checkpoints (from the live slot, after a row that accepted all)
    assert sched.stats()["checkpoints_saved"] > 0
    assert len(sched.block_manager.linear.draft_slots) == k * cfg.max_num_seqs


def test_a_row_drafts_no_further_than_max_tokens_and_a_penalty_row_drafts_none():
    cfg = small_config(num_speculative_tokens=3, num_linear_slots=28, chunk_stride=32, block_size=4,
                       max_num_batched_tokens=32)
    seqs, plans, dev, _ = _serve(cfg, 3, 0.0, max_tokens=6)
    assert [len(s.output_token_ids) for s in seqs] == [6, 6, 6]
    verify = [r for p in plans for r in p.seqs if r.draft_token_ids]
    assert verify and all(r.num_generated + len(r.token_ids) <= 6 for r in verify)
    _, plans, _, _ = _serve(cfg, 3, 0.0, max_tokens=6, repetition_penalty=1.2)
    assert not any(r.draft_token_ids for p in plans for r in p.seqs)


def test_a_stop_token_among_the_accepted_drafts_ends_the_sequence_there():
    cfg = small_config(num_speculative_tokens=3, num_linear_slots=28)
    sched, dev = Scheduler(cfg), SpecDevice(cfg, 3, 0.0)
    prompt = PROMPTS[0]
    toks = list(prompt)
    for _ in range(6):
        toks.append(next_token(toks))
    stop = toks[len(prompt) + 3]  # the fourth output token (not among the three before it)
    assert stop not in toks[len(prompt):len(prompt) + 3]
    seq = submit(sched, dev, make_seq(1, prompt, max_tokens=20, stop_token_ids=[stop]))
    while sched.has_unfinished():
        _, sampled = _step(sched, dev)
    assert seq.output_token_ids == toks[len(prompt):len(prompt) + 4] and seq.finish_reason == "stop"
    assert sampled == [toks[len(prompt) + 1:len(prompt) + 4]]  # the last step's samples, cut after the stop
