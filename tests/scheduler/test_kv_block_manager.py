from scheduler import BlockManagerImpl, Sequence

BS = 4


def computed_seq(kv: BlockManagerImpl, seq_id: int, tokens: list[int]) -> Sequence:
    """A sequence whose tokens are all allocated, computed and hashed."""
    seq = Sequence(seq_id, tokens)
    seq.update_block_hashes(BS)
    kv.allocate(seq, len(tokens))
    seq.num_computed_tokens = len(tokens)
    kv.hash_computed_blocks(seq)
    return seq


def test_block_zero_is_never_allocated():
    kv = BlockManagerImpl(5, BS)
    seq = Sequence(1, list(range(16)))
    kv.allocate(seq, 16)
    assert sorted(seq.block_table) == [1, 2, 3, 4]
    assert not kv.can_allocate(Sequence(2, [1]), 1)


def test_releasing_last_reference_frees_an_unhashed_block():
    kv = BlockManagerImpl(3, BS)
    seq = Sequence(1, [1, 2])
    kv.allocate(seq, 2)
    (block,) = seq.block_table
    kv.deallocate(seq)
    assert kv.ref_counts[block] == 0 and block in kv.free_blocks and not kv.cached_lru


def test_full_computed_blocks_stay_cached_after_deallocate_and_are_shared_zero_copy():
    kv = BlockManagerImpl(10, BS)
    a = computed_seq(kv, 1, list(range(10)))  # blocks [0,4) and [4,8) full; [8,10) partial
    a_blocks = list(a.block_table)
    assert kv.num_cached_blocks == 2
    kv.deallocate(a)
    assert list(kv.cached_lru) == a_blocks[1::-1]  # the deeper block is evicted first
    b = Sequence(2, list(range(10)) + [99])
    b.update_block_hashes(BS)
    matched = kv.match(b.token_ids, b.block_hashes)
    assert len(matched) == 2
    assert kv.allocate_shared(b, matched) == 8
    assert [kv.ref_counts[x] for x in matched] == [1, 1] and not kv.cached_lru


def test_match_never_covers_the_last_token():
    kv = BlockManagerImpl(10, BS)
    computed_seq(kv, 1, list(range(8)))
    probe = Sequence(2, list(range(8)))  # exactly two full blocks
    probe.update_block_hashes(BS)
    assert len(kv.match(probe.token_ids, probe.block_hashes)) == 1


def test_match_stops_at_the_first_missing_block():
    kv = BlockManagerImpl(10, BS)
    a = computed_seq(kv, 1, list(range(13)))  # three full blocks hashed
    head, middle, _ = a.block_table[:3]
    kv.deallocate(a)
    kv.cached_lru.move_to_end(middle, last=False)  # make the middle block the LRU victim
    kv.allocate(Sequence(2, [0]), (kv.num_free_blocks - 2) * BS)  # every free block + 1 eviction
    assert kv.num_evictions == 1 and kv.block_hash[middle] is None
    assert kv.match(list(range(14)), a.block_hashes) == [head]


def test_eviction_takes_free_blocks_before_cached_ones_and_counts():
    kv = BlockManagerImpl(5, BS)
    a = computed_seq(kv, 1, list(range(8)))
    kv.deallocate(a)
    assert kv.num_free_blocks == 4 and kv.num_cached_blocks == 2
    b = Sequence(2, list(range(100, 108)))
    kv.allocate(b, 8)
    assert kv.num_evictions == 0 and kv.num_cached_blocks == 2
    c = Sequence(3, [5])
    kv.allocate(c, 1)
    assert kv.num_evictions == 1 and kv.num_cached_blocks == 1


def test_decode_appends_a_block_only_at_a_block_boundary():
    kv = BlockManagerImpl(10, BS)
    seq = Sequence(1, list(range(5)))
    kv.allocate(seq, 4)
    seq.num_computed_tokens = 3
    kv.may_append(seq)
    assert len(seq.block_table) == 1
    seq.num_computed_tokens = 4
    assert kv.can_append(seq)
    kv.may_append(seq)
    assert len(seq.block_table) == 2


def test_duplicate_content_in_two_blocks_keeps_the_first_registration():
    kv = BlockManagerImpl(10, BS)
    a = computed_seq(kv, 1, list(range(4)))
    b = computed_seq(kv, 2, list(range(4)))
    assert kv.num_cached_blocks == 1 and kv.block_hash[b.block_table[0]] is None
    kv.deallocate(b)
    assert b.block_table == [] and kv.free_blocks[-1] not in kv.hash_to_block.values()
    kv.check_invariants([a])


def test_a_block_full_of_known_tokens_is_not_hashed_until_its_last_token_is_computed():
    """A block is registered once it is full *and computed*. After a prefill of 7 tokens samples the 8th, the second
    block is full of known tokens but its last KV entry is written only by the next decode: registered now, a prompt
    admitted before that decode runs would mount it and read an unwritten entry. The hybrid path hides such a bug
    (reuse stops at a checkpoint, and checkpoints lie at computed boundaries); an attention-only model would not."""
    kv = BlockManagerImpl(10, BS)
    seq = Sequence(1, list(range(8)))  # 7 prompt tokens + 1 sampled
    seq.update_block_hashes(BS)
    kv.allocate(seq, 8)
    seq.num_computed_tokens = 7
    kv.hash_computed_blocks(seq)
    assert kv.num_cached_blocks == 1 and kv.block_hash[seq.block_table[1]] is None
    probe = Sequence(2, list(range(8)) + [99])
    probe.update_block_hashes(BS)
    assert kv.match(probe.token_ids, probe.block_hashes) == seq.block_table[:1]
    seq.num_computed_tokens = 8  # the decode wrote position 7
    kv.hash_computed_blocks(seq)
    assert kv.match(probe.token_ids, probe.block_hashes) == seq.block_table[:2]
