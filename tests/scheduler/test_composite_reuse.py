"""How much of a prompt is reused: min(kv_match, linear_reach) on an actual checkpoint."""
import dataclasses

import pytest

from scheduler import Scheduler
from scheduler.hashing import KV_DOMAIN, LINEAR_DOMAIN, chain_hashes, domain_seed
from tests.scheduler.sched_helpers import FakeDevice, make_seq, run, small_config, submit

P = [3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 0, 2, 6, 4, 3, 3, 2, 3, 0, 4, 6, 2, 6, 4, 3, 3, 0, 2, 5, 0]
BS, CS = 4, 8


def setup(**kw):
    cfg = small_config(**kw)
    return Scheduler(cfg), FakeDevice(cfg)


def serve(sched, dev, seq_id, tokens, max_tokens=1):
    seq = submit(sched, dev, make_seq(seq_id, tokens, max_tokens=max_tokens))
    run(sched, dev)
    return seq


def admit(sched, dev, seq_id, tokens):
    """Submit and schedule one step; returns (seq, its row)."""
    seq = submit(sched, dev, make_seq(seq_id, tokens))
    plan = sched.schedule()
    (row,) = [r for r in plan.seqs if r.seq_id == seq_id]
    return seq, row


def checkpoint_slot(sched, tokens):
    h = chain_hashes(tokens, CS, domain_seed(LINEAR_DOMAIN, CS))[-1]
    return sched.block_manager.linear.index.slot_of[h]


def kv_block(sched, tokens):
    h = chain_hashes(tokens, BS, domain_seed(KV_DOMAIN, BS))[-1]
    return sched.block_manager.kv.hash_to_block[h]


@pytest.mark.promote_only
def test_kv_hit_without_checkpoint_reuses_zero_tokens():
    sched, dev = setup()
    serve(sched, dev, 1, P[:7])  # block [0,4) cached, no chunk boundary reached
    seq, row = admit(sched, dev, 2, P[:7] + [1, 1, 1])
    assert (seq.kv_match, seq.linear_reach, seq.num_cached_tokens, seq.reuse_lost) == (4, 0, 0, 4)
    assert row.start_pos == 0 and row.token_ids == P[:7] + [1]
    op = row.linear_op
    assert (op.restore_requested, op.restore_src_slot_id) == (True, -1) and not seq.restored
    assert kv_block(sched, P[:4]) not in seq.block_table  # clamped away, still cached


def test_prompt_exactly_one_chunk_long_cannot_reuse_its_own_tail_boundary():
    sched, dev = setup()
    serve(sched, dev, 1, P[:16], max_tokens=2)
    assert sched.stats()["checkpoints_saved"] == 2  # boundaries 8 and 16
    seq, row = admit(sched, dev, 2, P[:8])
    assert (seq.kv_match, seq.linear_reach, seq.num_cached_tokens) == (4, 0, 0)
    assert row.start_pos == 0 and row.linear_op.restore_src_slot_id == -1


def test_prompt_one_token_past_a_checkpoint_reuses_the_boundary():
    sched, dev = setup()
    serve(sched, dev, 1, P[:16], max_tokens=2)
    seq, row = admit(sched, dev, 2, P[:9])
    assert (seq.kv_match, seq.linear_reach, seq.num_cached_tokens, seq.reuse_lost) == (8, 8, 8, 0)
    assert row.start_pos == 8 and row.token_ids == [P[8]] and row.sample
    assert row.linear_op.restore_requested and seq.restored
    assert row.linear_op.restore_src_slot_id == checkpoint_slot(sched, P[:8])
    assert row.block_table[:2] == [kv_block(sched, P[:4]), kv_block(sched, P[:8])]


def test_sparse_checkpoints_trim_shared_kv_blocks_to_the_deepest_checkpoint():
    sched, dev = setup()
    serve(sched, dev, 1, P[:13])  # KV blocks for [0,12) cached, checkpoint only at 8
    third = kv_block(sched, P[:12])
    seq, row = admit(sched, dev, 2, P[:13] + [0, 0])
    assert (seq.kv_match, seq.linear_reach, seq.num_cached_tokens, seq.reuse_lost) == (12, 8, 8, 4)
    assert seq.block_table[:2] == [kv_block(sched, P[:4]), kv_block(sched, P[:8])]
    assert third not in seq.block_table
    kv = sched.block_manager.kv
    assert kv.ref_counts[third] == 0 and third in kv.cached_lru
    assert row.start_pos == 8


def test_checkpoint_deeper_than_surviving_kv_is_never_the_restore_source():
    sched, dev = setup()
    serve(sched, dev, 1, P[:20])  # checkpoints at 8 and 16, KV for [0,20)
    sched.block_manager.kv.evict(kv_block(sched, P[:12]))  # KV now only matches [0,8)
    seq, row = admit(sched, dev, 2, P[:20] + [1])
    assert (seq.kv_match, seq.linear_reach, seq.num_cached_tokens) == (8, 16, 8)
    assert row.linear_op.restore_src_slot_id == checkpoint_slot(sched, P[:8])
    assert row.linear_op.restore_src_slot_id != checkpoint_slot(sched, P[:16])
    sched.postprocess(sched.inflight, dev.execute(sched.inflight))
    sched.check_invariants()


def test_reuse_never_exceeds_the_kv_match():
    sched, dev = setup()
    serve(sched, dev, 1, P[:20])
    sched.block_manager.kv.evict(kv_block(sched, P[:8]))  # KV matches only [0,4)
    seq, row = admit(sched, dev, 2, P[:20] + [1])
    assert (seq.kv_match, seq.linear_reach, seq.num_cached_tokens) == (4, 16, 0)
    assert row.linear_op.restore_src_slot_id == -1 and row.start_pos == 0
    assert not any(sched.block_manager.linear.index.pins.values())  # unused hits stay unpinned


def test_a_deeper_hit_passes_over_a_missing_middle_checkpoint():
    sched, dev = setup()
    serve(sched, dev, 1, P[:28])  # checkpoints at 8, 16, 24
    linear = sched.block_manager.linear
    linear.evict_checkpoint(checkpoint_slot(sched, P[:16]))
    seq, row = admit(sched, dev, 2, P[:28] + [1])
    assert (seq.kv_match, seq.linear_reach, seq.num_cached_tokens) == (28, 24, 24)
    assert row.linear_op.restore_src_slot_id == checkpoint_slot(sched, P[:24])
    assert row.start_pos == 24 and row.token_ids == P[24:28] + [1]


def test_no_prefix_caching_gives_every_new_sequence_a_cold_live_slot():
    sched, dev = setup(enable_prefix_caching=False)
    serve(sched, dev, 1, P[:20])
    seq, row = admit(sched, dev, 2, P[:20] + [1])
    op = row.linear_op
    assert (op.restore_requested, op.restore_src_slot_id) == (True, -1) and op.linear_state_id > 0
    assert seq.num_cached_tokens == 0 and row.start_pos == 0
    assert sched.block_manager.linear.index is None and sched.stats()["checkpoints_saved"] == 0
    assert sched.block_manager.kv.num_cached_blocks == 0


def test_admission_falls_back_to_cold_start_when_the_source_holds_the_last_free_slot():
    sched, dev = setup(max_num_seqs=1, num_linear_slots=2)  # one usable slot
    first = serve(sched, dev, 1, P[:7], max_tokens=2)  # finishes at boundary 8: slot 1 promoted
    assert sched.stats()["checkpoint_slots"] == 1 and sched.stats()["free_slots"] == 0
    seq, row = admit(sched, dev, 2, first.token_ids[:8] + [1])
    assert (seq.kv_match, seq.linear_reach, seq.num_cached_tokens, seq.reuse_lost) == (8, 8, 0, 8)
    op = row.linear_op
    assert (op.linear_state_id, op.restore_requested, op.restore_src_slot_id) == (1, True, -1)
    assert sched.stats()["checkpoints_evicted"] == 1 and row.start_pos == 0


def test_a_warm_admission_walks_each_index_once_and_its_op_is_built_complete(monkeypatch):
    sched, dev = setup()
    serve(sched, dev, 1, P[:20])  # checkpoints at 8 and 16
    bm = sched.block_manager
    walks = []
    for leaf in (bm.kv, bm.linear.index):
        monkeypatch.setattr(leaf, "match", lambda *a, _real=leaf.match, _leaf=leaf: walks.append(_leaf) or _real(*a))
    seq, row = admit(sched, dev, 2, P[:20] + [1])
    assert walks == [bm.kv, bm.linear.index]  # one walk of each index for the whole admission
    assert seq.num_cached_tokens == 16 and row.linear_op.restore_src_slot_id == checkpoint_slot(sched, P[:16])
    for frozen in (sched.inflight, row, row.linear_op):
        with pytest.raises(dataclasses.FrozenInstanceError):
            frozen.seq_id = 0
    sched.check_invariants()
