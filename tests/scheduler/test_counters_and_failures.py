"""Counters that mean what they say; a failed step and an abort during an in-flight step release exactly."""
import pytest

from scheduler import Scheduler, SequenceStatus
from tests.scheduler.sched_helpers import FakeDevice, make_seq, run, small_config, submit

P = [3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 0, 2, 6, 4, 3, 3, 2, 3, 0, 4, 6, 2, 6, 4, 3, 1, 1, 0, 2, 5]


def _held(sched, seq):
    return list(seq.block_table), seq.linear_state_id


@pytest.mark.promote_only
def test_a_request_that_never_hits_restores_nothing_but_rotates():
    cfg = small_config(max_num_batched_tokens=8)  # prompt 30 tokens, 12 decoded: boundaries 8..40 on the way
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    submit(sched, dev, make_seq(1, P, max_tokens=12))
    run(sched, dev)
    s = sched.stats()
    assert s["queries"] == 1 and s["hits"] == 0 and s["reused_tokens"] == 0
    assert s["checkpoints_restored"] == 0
    assert s["rotation_copies"] >= 3 and s["checkpoints_saved"] >= 3   # boundaries 8, 16, 24 (prefill), 32, 40
    assert len(dev.restores) == s["rotation_copies"]                    # every warm copy was a rotation


def test_a_hit_counts_one_restore_and_readmissions_do_not_count_as_queries():
    cfg = small_config(num_kv_blocks=17, max_num_seqs=4, max_model_len=64)  # 16 usable blocks: pressure
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    submit(sched, dev, make_seq(1, P[:20], max_tokens=2))
    run(sched, dev)
    submit(sched, dev, make_seq(2, P[:20] + [6, 6], max_tokens=2))
    run(sched, dev)
    s = sched.stats()
    assert (s["queries"], s["hits"], s["checkpoints_restored"]) == (2, 1, 1)
    assert s["reused_tokens"] == 16  # deepest boundary below the final token
    # now four long requests that must preempt each other: re-admissions are counted apart
    for i in range(4):
        submit(sched, dev, make_seq(10 + i, [i] * 30, max_tokens=30))
    run(sched, dev)
    s = sched.stats()
    assert s["preemptions"] > 0 and s["readmissions"] == s["preemptions"]
    assert s["queries"] == 6 and s["query_tokens"] == 20 + 22 + 4 * 30


def test_abort_during_an_inflight_step_defers_the_release_to_postprocess():
    cfg = small_config()
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    a = submit(sched, dev, make_seq(1, P[:12], max_tokens=5))
    b = submit(sched, dev, make_seq(2, P[12:24], max_tokens=5))
    plan = sched.schedule()
    blocks, slot = _held(sched, a)
    free_blocks, free_slots = sched.block_manager.kv.num_free_blocks, list(sched.block_manager.linear.free_slots)
    assert sched.abort(1)
    # the running step still writes a's blocks and live slot: nothing of it may be handed out yet
    assert sched.block_manager.kv.num_free_blocks == free_blocks
    assert slot in sched.block_manager.linear.live_slots and slot not in sched.block_manager.linear.free_slots
    assert sched.block_manager.linear.free_slots == type(sched.block_manager.linear.free_slots)(free_slots)
    sched.check_invariants()
    sched.postprocess(plan, dev.execute(plan))
    sched.check_invariants()
    assert a.is_finished and a.finish_reason == "abort" and a.block_table == []
    assert slot in sched.block_manager.linear.free_slots
    assert sched.block_manager.kv.num_free_blocks == free_blocks + len(blocks)
    run(sched, dev)
    assert b.finish_reason == "length" and len(b.output_token_ids) == 5
    s = sched.stats()
    assert s["live_slots"] == 0 and s["kv_blocks_free"] == cfg.num_kv_blocks - 1


def _a_step_of_three_restores():
    """A finished request's checkpoints and cached blocks, then a step of three requests that restore from them (the
    step holds restore pins): (config, scheduler, device, the first request, the three, the step's plan)."""
    cfg = small_config(max_num_batched_tokens=32)
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    first = submit(sched, dev, make_seq(1, P[:20], max_tokens=3))
    run(sched, dev)
    seqs = [submit(sched, dev, make_seq(10 + i, P[:20] + [i, i], max_tokens=3)) for i in range(3)]
    plan = sched.schedule()
    assert sum(r.linear_op.is_warm_restore for r in plan.seqs) == 3
    return cfg, sched, dev, first, seqs, plan


def test_a_failed_step_finishes_its_rows_with_error_and_leaks_nothing():
    cfg, sched, dev, first, seqs, plan = _a_step_of_three_restores()
    failed = sched.fail_step(plan)
    assert failed == seqs and all(s.finish_reason == "error" and s.block_table == [] for s in seqs)
    sched.check_invariants()
    s = sched.stats()
    assert s["live_slots"] == 0 and s["kv_blocks_free"] == cfg.num_kv_blocks - 1
    assert s["failed_steps"] == 1 and s["failed_requests"] == 3
    after = submit(sched, dev, make_seq(20, P[:20] + [6], max_tokens=3))
    run(sched, dev)
    assert after.finish_reason == "length" and after.num_cached_tokens == 16 and first.is_finished


def test_dropping_the_device_state_recomputes_running_requests_exactly():
    cfg = small_config()
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    a = submit(sched, dev, make_seq(1, P[:20], max_tokens=6))
    for _ in range(4):  # prefill and a few decode steps
        plan = sched.schedule()
        sched.postprocess(plan, dev.execute(plan))
    sched.drop_device_state()
    dev.state.clear()
    dev.kv.clear()  # the simulated device lost everything too
    sched.check_invariants()
    assert sched.stats()["checkpoint_slots"] == 0 and sched.stats()["kv_blocks_cached"] == 0
    run(sched, dev)  # the fake device asserts every state and KV read is the sequence's own prefix
    assert a.finish_reason == "length" and a.num_preemptions == 1


def test_dropping_the_device_state_saves_no_pending_checkpoint_of_the_lost_state():
    """A running sequence with a deferred save pending holds, in its live slot, the state of a boundary; when the
    device state is lost that state is gone too. It used to be indexed on the way out (counted as saved) and evicted
    by the emptied cache at once (counted as evicted): counters of a checkpoint that never held a state."""
    cfg = small_config()
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    a = submit(sched, dev, make_seq(1, P[:20], max_tokens=12))
    for _ in range(12):  # until a decode step ends on a stride boundary (the save is deferred to the next step)
        plan = sched.schedule()
        sched.postprocess(plan, dev.execute(plan))
        if a.pending_save_hash is not None:
            break
    assert a.pending_save_hash is not None
    before = sched.stats()
    sched.drop_device_state()
    after = sched.stats()
    assert after["checkpoints_saved"] == before["checkpoints_saved"]
    assert after["checkpoints_evicted"] - before["checkpoints_evicted"] == before["checkpoint_slots"]
    assert a.pending_save_hash is None and after["checkpoint_slots"] == 0
    sched.check_invariants()
    dev.state.clear()
    dev.kv.clear()
    run(sched, dev)
    assert a.finish_reason == "length" and a.num_preemptions == 1


def test_a_redone_step_recomputes_its_rows_and_every_running_one_and_fails_none():
    """A step whose executable had to be compiled again (its state possibly consumed): the step's rows and the other
    running rows start over from scratch on an emptied cache, nothing of the step is indexed, and they end as they
    would have."""
    cfg, sched, dev, first, seqs, plan = _a_step_of_three_restores()
    sched.redo_step(plan)
    dev.state.clear()
    dev.kv.clear()  # the simulated device lost everything
    sched.check_invariants()
    s = sched.stats()
    assert s["redone_steps"] == 1 and s["failed_steps"] == 0 and s["kv_blocks_cached"] == 0
    assert all(q.status == SequenceStatus.WAITING and q.num_computed_tokens == 0 for q in seqs)
    run(sched, dev)  # the fake device asserts every state and KV read is the sequence's own prefix
    assert all(q.finish_reason == "length" and len(q.output_token_ids) == 3 for q in seqs) and first.is_finished
