from scheduler import Sequence, chain_hashes, domain_seed
from scheduler.hashing import KV_DOMAIN, LINEAR_DOMAIN

TOKENS = list(range(100, 164))


def test_kv_and_linear_chains_differ_for_same_tokens_and_stride():
    kv = chain_hashes(TOKENS, 16, domain_seed(KV_DOMAIN, 16))
    linear = chain_hashes(TOKENS, 16, domain_seed(LINEAR_DOMAIN, 16))
    assert len(kv) == len(linear) == 4
    assert not set(kv) & set(linear)


def test_fingerprint_changes_every_hash():
    a = chain_hashes(TOKENS, 16, domain_seed(LINEAR_DOMAIN, 16, "model-a"))
    b = chain_hashes(TOKENS, 16, domain_seed(LINEAR_DOMAIN, 16, "model-b"))
    assert not set(a) & set(b)


def test_stride_changes_every_hash():
    by16 = chain_hashes(TOKENS, 16, domain_seed(LINEAR_DOMAIN, 16))
    by32 = chain_hashes(TOKENS, 32, domain_seed(LINEAR_DOMAIN, 32))
    assert len(by32) == 2 and not set(by16) & set(by32)


def test_chain_hash_depends_on_every_earlier_token():
    a = chain_hashes(TOKENS, 16, domain_seed(KV_DOMAIN, 16))
    b = chain_hashes([0] + TOKENS[1:], 16, domain_seed(KV_DOMAIN, 16))
    assert all(x != y for x, y in zip(a, b))


def test_sequence_extends_chains_incrementally_over_whole_units():
    seq = Sequence(1, TOKENS[:20])
    seq.update_linear_state_hashes(8, "fp")
    seq.update_block_hashes(4, "fp")
    assert len(seq.linear_state_hashes) == 2 and len(seq.block_hashes) == 5
    first = list(seq.linear_state_hashes)
    for t in TOKENS[20:24]:
        seq.append_token(t)
    seq.update_linear_state_hashes(8, "fp")
    assert seq.linear_state_hashes[:2] == first and len(seq.linear_state_hashes) == 3
    assert seq.linear_state_hashes == chain_hashes(TOKENS[:24], 8, domain_seed(LINEAR_DOMAIN, 8, "fp"))
