"""Checkpoint eviction policies: LRU, and Marconi's FLOP-aware utility (recency + alpha x FLOPs saved, each
min-max normalised over the candidates), on hand-made traces where the two must differ."""
from collections import OrderedDict

import pytest

from scheduler import Scheduler
from scheduler.eviction import FlopAwareEviction, LRUEviction, PrefillCost, eviction_policy
from tests.scheduler.sched_helpers import FakeDevice, make_seq, run, small_config, submit

LONG = [3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 0, 2, 6, 4, 3, 3, 2, 3, 0, 4, 6, 2, 6, 4, 3, 3, 0, 2, 5, 0, 1, 6, 2, 4, 4, 5, 1]


def _serve(sched, dev, seq_id, tokens):
    seq = submit(sched, dev, make_seq(seq_id, tokens, max_tokens=1))
    run(sched, dev)
    return seq


@pytest.mark.parametrize("policy, reused", [("lru", 0), ("flop_aware", 32)])
def test_a_deep_checkpoint_outlives_shallow_newer_ones_only_under_flop_aware_eviction(policy, reused):
    """Room for one live slot and two checkpoints. A 37-token prompt leaves its checkpoint at 32 (8-token stride;
    with "promote" also 24); two short prompts then each save one at 8. LRU evicts the old deep ones for them, so the
    long prompt's second visit recomputes everything; the FLOP-aware score keeps the 32-token one (its hit saves 4x
    the FLOPs of an 8-token one) and the second visit reuses 32 tokens. Alpha 2: between two candidates, the newer
    shallow and the older deep, both normalised terms are 0 or 1, so alpha 1 would be a tie (broken by LRU)."""
    cfg = small_config(max_num_seqs=1, num_linear_slots=4, checkpoint_eviction=policy, eviction_alpha=2.0,
                       prefill_cost=PrefillCost(linear=1.0), max_num_batched_tokens=40, checkpoint_policy="last")
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    _serve(sched, dev, 1, LONG)
    _serve(sched, dev, 2, [6, 6, 5, 4, 3, 2, 1, 0, 2, 2])
    _serve(sched, dev, 3, [5, 5, 5, 4, 4, 4, 1, 1, 0, 0])
    again = _serve(sched, dev, 4, LONG)
    assert again.num_cached_tokens == reused


def test_the_utility_is_normalised_recency_plus_alpha_times_normalised_flops():
    """Three candidates, oldest first, at depths 64, 8, 32 with last uses 1, 5, 9 and FLOPs 2L + L(L+1)/2:
    recency (0, 0.5, 1), efficiency (1, 0, (592 - 52) / (2208 - 52)); alpha 0.5."""
    cost = PrefillCost(linear=2.0, quadratic=1.0)
    candidates, depth, used = OrderedDict.fromkeys([7, 3, 5]), {7: 64, 3: 8, 5: 32}, {7: 1, 3: 5, 5: 9}
    u = FlopAwareEviction(cost, alpha=0.5).utilities(candidates, depth, used)
    assert u == pytest.approx({7: 0.5, 3: 0.5, 5: 1 + 0.5 * 540 / 2156})
    assert FlopAwareEviction(cost, alpha=0.5).victim(candidates, depth, used) == 7  # a tie: the least recent goes
    assert FlopAwareEviction(cost, alpha=0.6).victim(candidates, depth, used) == 3
    assert FlopAwareEviction(cost, alpha=0.0).victim(candidates, depth, used) == LRUEviction().victim(
        candidates, depth, used) == 7


def test_policy_names_and_alpha_are_checked():
    with pytest.raises(ValueError, match="checkpoint_eviction must be one of"):
        eviction_policy("lfu")
    with pytest.raises(ValueError, match="alpha must be >= 0"):
        eviction_policy("flop_aware", alpha=-1.0)
    with pytest.raises(ValueError, match="checkpoint_eviction must be one of"):
        small_config(checkpoint_eviction="random")
