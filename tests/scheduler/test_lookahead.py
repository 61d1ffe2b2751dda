"""Async scheduling: the next step planned before this one's samples are known (`postprocess(ahead=True)`, `resolve`)
gives every sequence the tokens and the end it gets step by step, on the fake device that checks every state and KV
entry a row reads."""
import dataclasses
import random

from scheduler import SamplingParams, Scheduler
from scheduler.plan import PENDING_TOKEN
from tests.scheduler.sched_helpers import FakeDevice, make_seq, small_config, submit


def fed(plan, dev: FakeDevice):
    """The plan as the device runs it: a pending token is the one the device sampled in the step before."""
    rows = [dataclasses.replace(r, token_ids=[dev.tokens[r.seq_id][r.start_pos + i] if t == PENDING_TOKEN else t
                                              for i, t in enumerate(r.token_ids)]) for r in plan.seqs]
    return dataclasses.replace(plan, seqs=rows)


def run_ahead(sched: Scheduler, dev: FakeDevice, arrivals: dict | None = None, aborts: dict | None = None,
              max_steps: int = 10_000) -> tuple[list, int]:
    """The engine's async loop on the fake device: a step is dispatched (run here at once), the next one planned and
    dispatched before the first's samples are resolved. `arrivals`/`aborts`: step -> sequences to add / ids to abort
    after it. Returns (the plans, the steps planned ahead)."""
    plans, inflight, ahead = [], None, 0
    for step in range(max_steps):
        if inflight is None:
            if not sched.has_unfinished():
                return plans, ahead
            plan = sched.schedule()
            assert plan is not None, "scheduler stalled with unfinished requests"
            plans.append(plan)
            sampled = dev.execute(fed(plan, dev))
        else:
            plan, sampled = inflight
        inflight = None
        if sched.can_look_ahead(plan):
            sched.postprocess(plan, None, ahead=True)
            nxt = sched.schedule()
            if nxt is not None:
                plans.append(nxt)
                ahead += 1
                inflight = nxt, dev.execute(fed(nxt, dev))
            sched.resolve(plan, sampled)
        else:
            sched.postprocess(plan, sampled)
        for seq in (arrivals or {}).get(step, ()):
            submit(sched, dev, seq)
        for seq_id in (aborts or {}).get(step, ()):
            sched.abort(seq_id)
        sched.check_invariants()
        dev.check_checkpoints(sched)
    raise AssertionError("did not finish")


def _requests(seed: int, n: int, **sp):
    rng = random.Random(seed)
    system = [rng.randrange(7) for _ in range(20)]
    return [(i, (system if i % 2 else [])[:rng.randrange(21)] + [rng.randrange(7) for _ in range(rng.randrange(1, 30))],
             rng.randrange(1, 12)) for i in range(n)], sp


def _both(cfg_kw: dict, requests, sp, arrive_at=None, abort_at=None):
    """The same requests step by step and planned ahead: per run, each sequence's (tokens, finish reason), the steps
    planned ahead and the preemptions."""
    results = []
    for ahead in (False, True):
        cfg = small_config(async_scheduling=ahead, **cfg_kw)
        sched, dev = Scheduler(cfg), FakeDevice(cfg)
        seqs = [make_seq(i, toks, max_tokens=m, **sp) for i, toks, m in requests]
        first = seqs if arrive_at is None else seqs[:arrive_at[0]]
        for seq in first:
            submit(sched, dev, seq)
        arrivals = None if arrive_at is None else {arrive_at[1]: seqs[arrive_at[0]:]}
        aborts = None if abort_at is None else {abort_at[1]: [abort_at[0]]}
        _, count = run_ahead(sched, dev, arrivals, aborts)  # (without async_scheduling: step by step)
        assert ahead or count == 0
        stats = sched.stats()
        assert stats["live_slots"] == 0 and stats["kv_blocks_free"] == cfg.num_kv_blocks - 1  # nothing leaked
        results.append(({s.seq_id: (s.token_ids, s.finish_reason) for s in seqs}, count, stats["preemptions"]))
    return results


def test_planning_ahead_gives_the_tokens_and_ends_of_step_by_step():
    requests, sp = _requests(1, 8)
    (plain, _, _), (ahead, count, _) = _both(dict(eos_token_id=3), requests, sp)
    assert ahead == plain and count > 10
    assert {r for _, r in plain.values()} == {"stop", "length"}  # sequences ended by EOS with a row in flight too


def test_planning_ahead_under_preemption_and_arrivals():
    requests, sp = _requests(2, 10)
    (plain, _, _), (ahead, count, preempted) = _both(dict(eos_token_id=5, num_kv_blocks=17, num_linear_slots=6),
                                                     requests, sp, arrive_at=(6, 3))
    assert ahead == plain and count > 10 and preempted > 0


def test_an_abort_with_a_row_in_flight_and_penalties_that_plan_step_by_step():
    requests, _ = _requests(3, 6)
    (plain, _, _), (ahead, count, _) = _both(dict(), requests, {}, abort_at=(2, 4))
    assert ahead == plain and plain[2][1] == "abort" and count > 5
    # a sampling row with penalties: its next row needs its history, so that step is planned once its token is known
    cfg = small_config(async_scheduling=True)
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    seq = submit(sched, dev, make_seq(0, [1, 2, 3], max_tokens=4, repetition_penalty=1.2))
    plan = sched.schedule()
    assert plan.seqs[0].sample and not sched.can_look_ahead(plan)
    assert SamplingParams(repetition_penalty=1.2).uses_penalties
    sched.postprocess(plan, dev.execute(plan))
    plans, count = run_ahead(sched, dev)
    assert count == 0 and len(plans) == 3 and len(seq.output_token_ids) == 4  # a step per further token


def test_a_pending_token_is_in_the_next_row_not_in_the_sequence():
    cfg = small_config(async_scheduling=True)
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    seq = submit(sched, dev, make_seq(0, [1, 2, 3, 4, 5], max_tokens=3))
    plan = sched.schedule()  # the prompt, sampling its first token
    sampled = dev.execute(plan)
    sched.postprocess(plan, None, ahead=True)
    assert seq.num_pending == 1 and seq.token_ids == [1, 2, 3, 4, 5] and seq.num_computed_tokens == 5
    row = sched.schedule().seqs[0]
    assert row.token_ids == [PENDING_TOKEN] and row.start_pos == 5 and row.sample and row.num_generated == 1
    sched.resolve(plan, sampled)
    assert seq.num_pending == 0 and seq.token_ids == [1, 2, 3, 4, 5, sampled[0]]


def test_samples_that_will_not_come_end_their_sequences_with_error():
    """The step of a plan postprocessed ahead raised: its sequences waiting for a sample end with "error" (one that
    was preempted meanwhile leaves the queue too), the failure is counted once, and nothing stays pending."""
    cfg = small_config(async_scheduling=True)
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    a, b = (submit(sched, dev, make_seq(i, [1, 2, 3, i], max_tokens=3)) for i in range(2))
    plan = sched.schedule()
    dev.execute(plan)
    sched.postprocess(plan, None, ahead=True)
    sched._preempt(b)  # as planning the next step may
    assert sched.fail_pending(plan, step_counted=False) == [a, b]
    assert (a.finish_reason, b.finish_reason) == ("error", "error") and not sched.has_unfinished()
    stats = sched.stats()
    assert stats["failed_steps"] == 1 and stats["failed_requests"] == 2 and stats["live_slots"] == 0
    sched.check_invariants()
