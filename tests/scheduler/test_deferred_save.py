"""Checkpoints are saved one step late, under the hash recorded at their boundary."""
import json

import pytest

from scheduler import LinearStateCacheOp, Scheduler
from scheduler.hashing import LINEAR_DOMAIN, chain_hashes, domain_seed
from tests.scheduler.sched_helpers import FakeDevice, make_seq, run, small_config, submit

pytestmark = pytest.mark.promote_only  # the deferred save by promotion is the "promote" design

P = [3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 0, 2, 6, 4, 3, 3, 2, 3, 0, 4]
CS = 8


def linear_hash(tokens):
    return chain_hashes(tokens, CS, domain_seed(LINEAR_DOMAIN, CS))[-1]


def step(sched, dev):
    plan = sched.schedule()
    sched.postprocess(plan, dev.execute(plan))
    sched.check_invariants()
    dev.check_checkpoints(sched)
    return plan


def test_deferred_save_promotes_live_slot_under_recorded_hash_and_restores_from_it():
    cfg = small_config()
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    seq = submit(sched, dev, make_seq(1, P, max_tokens=1))
    first = step(sched, dev).seqs[0]
    live = first.linear_op.linear_state_id
    assert (first.start_pos, len(first.token_ids)) == (0, 8)
    assert seq.pending_save_hash == linear_hash(P[:8]) and seq.pending_save_len == 8

    plan = sched.schedule()
    op = plan.seqs[0].linear_op
    index = sched.block_manager.linear.index
    assert len(seq.linear_state_hashes) == 2  # the current tokens reach further ...
    assert index.slot_of == {linear_hash(P[:8]): live}  # ... but the key is the recorded one
    assert op.linear_state_id == seq.linear_state_id != live
    assert (op.restore_requested, op.restore_src_slot_id) == (True, live)
    assert index.pins[live] == 1
    sched.postprocess(plan, dev.execute(plan))
    assert index.pins[live] == 0 and seq.pending_save_hash == linear_hash(P[:16])


def test_pending_save_is_skipped_when_the_hash_is_already_cached_without_leaking():
    cfg = small_config()
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    a = submit(sched, dev, make_seq(1, P[:12], max_tokens=1))
    b = submit(sched, dev, make_seq(2, P[:12], max_tokens=1))
    step(sched, dev)  # both cold, both reach boundary 8 with the same hash
    assert a.pending_save_hash == b.pending_save_hash
    b_live = b.linear_state_id
    plan = sched.schedule()
    ops = {r.seq_id: r.linear_op for r in plan.seqs}
    assert ops[1].restore_requested and ops[1].restore_src_slot_id > 0
    assert (ops[2].linear_state_id, ops[2].restore_requested) == (b_live, False)
    stats = sched.stats()
    assert (stats["checkpoints_saved"], stats["checkpoints_save_skipped"]) == (1, 1)
    assert stats["live_slots"] == 2 and stats["checkpoint_slots"] == 1
    assert stats["free_slots"] == cfg.num_linear_slots - 1 - 3
    sched.postprocess(plan, dev.execute(plan))
    run(sched, dev)
    stats = sched.stats()
    assert stats["live_slots"] == 0
    assert stats["free_slots"] + stats["checkpoint_slots"] == cfg.num_linear_slots - 1


def test_decode_reaching_a_boundary_saves_and_rotates_next_step():
    cfg = small_config()
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    seq = submit(sched, dev, make_seq(1, P[:6], max_tokens=5))
    step(sched, dev)  # prefill [0,6), samples token 6
    step(sched, dev)  # decode position 6
    step(sched, dev)  # decode position 7 -> 8 computed
    assert seq.num_computed_tokens == 8 and seq.pending_save_hash == linear_hash(seq.token_ids[:8])
    old = seq.linear_state_id
    op = step(sched, dev).seqs[0].linear_op
    assert (op.restore_requested, op.restore_src_slot_id) == (True, old) and op.linear_state_id != old


def test_finishing_at_a_boundary_promotes_the_live_slot():
    cfg = small_config()
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    seq = submit(sched, dev, make_seq(1, P[:7], max_tokens=2))
    run(sched, dev)
    assert seq.num_computed_tokens == 8 and seq.finish_reason == "length"
    index = sched.block_manager.linear.index
    assert linear_hash(seq.token_ids[:8]) in index.slot_of
    assert sched.stats()["live_slots"] == 0


def test_op_round_trips_through_json_including_forced_cold_start():
    for op in [LinearStateCacheOp(), LinearStateCacheOp(3, True, 7), LinearStateCacheOp(5, True, -1),
               LinearStateCacheOp(2, False, -1)]:
        back = LinearStateCacheOp.from_dict(json.loads(json.dumps(op.to_dict())))
        assert back == op
    cold = LinearStateCacheOp.from_dict(json.loads(json.dumps(LinearStateCacheOp(5, True, -1).to_dict())))
    assert cold.restore_requested is True and cold.restore_src_slot_id == -1 and not cold.is_warm_restore


def test_restore_source_stays_pinned_for_the_step_and_is_unpinned_after():
    cfg = small_config()
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    submit(sched, dev, make_seq(1, P[:16], max_tokens=2))
    run(sched, dev)
    submit(sched, dev, make_seq(2, P[:16] + [1]))
    plan = sched.schedule()
    src = plan.seqs[0].linear_op.restore_src_slot_id
    index = sched.block_manager.linear.index
    assert src == index.slot_of[linear_hash(P[:16])]
    assert index.pins[src] == 1 and src not in index.lru
    sched.check_invariants()  # pins match the in-flight sources
    sched.postprocess(plan, dev.execute(plan))
    assert index.pins[src] == 0 and list(index.lru)[-1] == src
    sched.check_invariants()
