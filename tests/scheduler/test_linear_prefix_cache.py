import dataclasses

import pytest

from scheduler import (LinearStateBlockManager, LinearStateCacheOp, LinearStatePrefixCache, Sequence,
                       deepest_hit_at_or_below)

CS = 8


def manager(num_slots: int) -> LinearStateBlockManager:
    return LinearStateBlockManager(num_slots, CS)


def checkpoint(m: LinearStateBlockManager, h: int) -> int:
    """Make one checkpoint keyed by h (acquire a live slot, promote it)."""
    slot = m.acquire_live_slot()
    assert m.insert_with_recorded_hash(slot, h)
    return slot


def seq_with_pending_save(m: LinearStateBlockManager, h: int) -> Sequence:
    seq = Sequence(h, [1, 2, 3])
    seq.linear_state_id = m.acquire_live_slot()
    seq.pending_save_hash = h
    return seq


def test_slot_zero_is_never_handed_out_and_n_slots_give_n_minus_1():
    m = manager(5)
    got = [m.acquire_live_slot() for _ in range(4)]
    assert sorted(got) == [1, 2, 3, 4]
    assert m.acquire_live_slot() is None


def test_releasing_the_last_reference_frees_a_live_slot():
    m = manager(3)
    a, _ = m.acquire_live_slot(), m.acquire_live_slot()
    assert m.acquire_live_slot() is None
    m.free_live_slot(a)
    assert m.acquire_live_slot() == a


def test_reinserting_an_existing_hash_is_idempotent_and_frees_the_duplicate():
    m = manager(4)
    first = checkpoint(m, 7)
    dup = m.acquire_live_slot()
    assert not m.insert_with_recorded_hash(dup, 7)
    assert m.index.slot_of == {7: first} and dup in m.free_slots and dup not in m.live_slots
    assert m.num_saved == 1


def test_prefix_cache_insert_of_existing_hash_takes_nothing():
    idx = LinearStatePrefixCache(CS)
    assert idx.insert_with_recorded_hash(3, 11)
    assert not idx.insert_with_recorded_hash(4, 11)
    assert idx.slot_of == {11: 3} and idx.hash_of == {3: 11}


def test_save_evicts_the_lru_unpinned_checkpoint_for_its_fresh_slot():
    m = manager(5)
    old, _ = checkpoint(m, 1), checkpoint(m, 2)
    seq = seq_with_pending_save(m, 3)
    m.acquire_live_slot()  # pool now full: 2 checkpoints + 2 live
    live = seq.linear_state_id
    op = m.allocate_for_sequence(seq, 1)
    assert m.num_evicted == 1 and not m.index.contains(1) and m.index.contains(2)
    assert seq.linear_state_id == old  # the evicted slot became the fresh live slot
    assert op.linear_state_id == old and op.restore_requested and op.restore_src_slot_id == live
    assert m.index.slot_of[3] == live and m.index.is_pinned(live)


def test_find_refreshes_lru_order_but_contains_does_not():
    idx = LinearStatePrefixCache(CS)
    for slot, h in [(1, 10), (2, 20)]:
        idx.insert_with_recorded_hash(slot, h)
    assert idx.contains(10)
    assert list(idx.lru) == [1, 2]
    idx.release(idx.find(10))
    assert list(idx.lru) == [2, 1]
    assert idx.evict_victim() == 2


def test_acquiring_a_live_slot_reclaims_an_unpinned_checkpoint_never_a_pinned_one():
    m = manager(4)
    pinned, unpinned = checkpoint(m, 1), checkpoint(m, 2)
    m.index.find(1)
    m.acquire_live_slot()
    got = m.acquire_live_slot()
    assert got == unpinned and m.num_evicted == 1
    assert m.acquire_live_slot() is None
    assert m.index.slot_of == {1: pinned}


def test_an_insert_never_reclaims_a_live_slot():
    m = manager(4)
    seqs = [seq_with_pending_save(m, h) for h in (1, 2, 3)]  # every slot is live
    lives = [s.linear_state_id for s in seqs]
    op = m.allocate_for_sequence(seqs[0], 1)
    assert op.restore_requested is False and op.linear_state_id == lives[0]
    assert [s.linear_state_id for s in seqs] == lives and m.live_slots == set(lives)
    assert len(m.index) == 0 and m.num_save_skipped == 1


def test_an_insert_fails_cleanly_when_every_checkpoint_is_pinned():
    m = manager(4)
    for h in (1, 2):
        checkpoint(m, h)
        m.index.find(h)
    seq = seq_with_pending_save(m, 3)
    live = seq.linear_state_id
    op = m.allocate_for_sequence(seq, 1)
    assert (op.linear_state_id, op.restore_requested, op.restore_src_slot_id) == (live, False, -1)
    assert seq.linear_state_id == live and seq.pending_save_hash is None
    assert set(m.index.slot_of) == {1, 2} and not m.free_slots
    m.check_invariants([seq], pins_allowed=True)


def test_a_released_pin_makes_the_checkpoint_reclaimable():
    m = manager(3)
    slot = checkpoint(m, 1)
    m.acquire_live_slot()
    assert m.index.find(1) == slot
    assert m.acquire_live_slot() is None
    m.release_source(slot)
    assert m.acquire_live_slot() == slot and not m.index.contains(1)


def test_match_walks_whole_chunks_strictly_below_the_final_token():
    idx = LinearStatePrefixCache(CS)
    hashes = [100, 200, 300]
    idx.insert_with_recorded_hash(1, 100)
    idx.insert_with_recorded_hash(2, 200)
    assert idx.match(list(range(16)), hashes) == ([(8, 1)], 8)  # chunk 1 ends at the last token
    assert idx.match(list(range(17)), hashes) == ([(8, 1), (16, 2)], 16)
    assert idx.match(list(range(8)), hashes) == ([], 0)
    assert list(idx.lru) == [1, 2] and not any(idx.pins.values())  # a probe pins nothing


def test_match_skips_gaps_and_pins_nothing():
    m = manager(6)
    shallow = checkpoint(m, 100)
    deep = checkpoint(m, 300)  # chunk 1 (hash 200) missing
    hits, reach = m.match(list(range(30)), [100, 200, 300])
    assert (hits, reach) == ([(8, shallow), (24, deep)], 24)
    assert deepest_hit_at_or_below(hits, 23) == (8, shallow) and deepest_hit_at_or_below(hits, 7) == (0, -1)
    assert m.index.pins == {shallow: 0, deep: 0} and list(m.index.lru) == [shallow, deep]
    assert LinearStateBlockManager(6, CS, enable_prefix_caching=False).match(list(range(30)), [100]) == ([], 0)


def test_admit_pins_the_source_before_taking_the_live_slot_and_builds_the_op_once():
    m = manager(3)  # slots 1, 2: both checkpoints, so the live slot must come from evicting one
    src, other = checkpoint(m, 100), checkpoint(m, 200)
    seq = Sequence(1, list(range(20)))
    op = m.admit(seq, src)
    assert op == LinearStateCacheOp(other, True, src) and seq.linear_state_id == other  # never the source itself
    assert m.index.pins == {src: 1} and m.num_evicted == 1
    m.check_invariants([seq], pins_allowed=True, sources={src: 1})
    with pytest.raises(dataclasses.FrozenInstanceError):
        op.restore_src_slot_id = -1


def test_admit_with_no_slot_to_take_returns_none_and_leaves_the_source_unpinned():
    m = manager(3)
    src = checkpoint(m, 100)
    m.acquire_live_slot()
    seq = Sequence(1, list(range(20)))
    assert m.admit(seq, src) is None
    assert seq.linear_state_id == -1 and not m.index.is_pinned(src) and list(m.index.lru) == [src]
    with pytest.raises(AssertionError, match="not a checkpoint"):
        m.admit(seq, 2)  # a live slot is no restore source


def test_finish_with_pending_save_promotes_live_slot_else_frees_it():
    m = manager(4)
    saving = seq_with_pending_save(m, 5)
    plain = Sequence(9, [1])
    plain.linear_state_id = m.acquire_live_slot()
    a, b = saving.linear_state_id, plain.linear_state_id
    m.deallocate(saving)
    m.deallocate(plain)
    assert m.index.slot_of == {5: a} and b in m.free_slots and not m.live_slots
    assert saving.linear_state_id == plain.linear_state_id == -1


def test_a_pending_save_a_finished_sequence_cannot_make_counts_as_skipped():
    """A sequence that finishes with a deferred save pending gives its live slot to that checkpoint; when the hash is
    cached already (another sequence saved it first), the slot is freed and the save counted as skipped, as every
    other save that finds its hash cached is. It went uncounted, so `checkpoints_save_skipped` (a column of the
    checkpoint trade-off study) undercounted."""
    m = manager(5)
    checkpoint(m, 7)
    seq = seq_with_pending_save(m, 7)
    live = seq.linear_state_id
    m.deallocate(seq)
    assert (m.num_saved, m.num_save_skipped) == (1, 1) and live in m.free_slots and m.index.slot_of[7] != live
    fresh = seq_with_pending_save(m, 8)  # a hash not cached: its slot becomes the checkpoint, nothing skipped
    slot = fresh.linear_state_id
    m.deallocate(fresh)
    assert (m.num_saved, m.num_save_skipped) == (2, 1) and m.index.slot_of[8] == slot
