"""Checkpoint placement: "overlap" saves the boundaries that the observed shared-prefix lengths make most useful."""
import numpy as np
import pytest

from scheduler import Scheduler
from scheduler.eviction import PrefillCost
from scheduler.placement import OverlapPlacement
from tests.scheduler.sched_helpers import FakeDevice, make_seq, run, small_config, submit

CS = 8


def _placement(shared_strides, per_sequence, cost=PrefillCost(linear=1.0)):
    p = OverlapPlacement(CS, cost, per_sequence, warm=1)
    for s in shared_strides:
        p.observe(s * CS + 3)  # a KV match ending inside a stride counts the whole strides below it
    return p


def test_the_dynamic_program_places_where_requests_share():
    # every request shared 2 strides: one checkpoint at 2 serves them all
    assert _placement([2, 2, 2], 1).boundaries(5) == {2}
    # half share 1 stride, half 4: with room for two, both; with one, 4 (4 x 8 FLOPs x 1/2 > 1 x 8 x 1)
    assert _placement([1, 4, 1, 4], 2).boundaries(5) == {1, 4}
    assert _placement([1, 4, 1, 4], 1).boundaries(5) == {4}
    # a share past the sequence's end counts as its deepest boundary
    assert _placement([9, 9], 1).boundaries(3) == {3}
    # nothing shared: nothing is worth a slot
    assert _placement([0, 0, 0], 2).boundaries(4) == set()


def test_the_expected_flops_saved_is_what_the_choice_maximises():
    """Shares of 1 stride (x3) and 3 strides (x1), linear cost, one checkpoint: at 1 it serves all four (8 x 4/4),
    at 3 only one (24 x 1/4) -> 1; with a quadratic cost the deep one's FLOPs win."""
    assert _placement([1, 1, 1, 3], 1).boundaries(4) == {1}
    assert _placement([1, 1, 1, 3], 1, PrefillCost(linear=0.0, quadratic=1.0)).boundaries(4) == {3}


def test_before_enough_admissions_it_places_every_boundary():
    p = OverlapPlacement(CS, PrefillCost(), 1, warm=3)
    p.observe(16)
    p.observe(16)
    assert p.boundaries(4) is None


@pytest.mark.own_mode
def test_overlap_saves_fewer_checkpoints_than_stride_for_the_same_reuse():
    """Requests share a 16-token system prompt (2 strides) and then differ for 40 tokens: "stride" saves every
    boundary of every prompt, "overlap" (after 8 admissions) only the one at 16, which every later request reuses."""
    system = [3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 0, 2, 6, 4, 3, 3]
    results = {}
    for placement in ("stride", "overlap"):
        cfg = small_config(checkpoint_mode="scan", checkpoint_placement=placement, max_num_seqs=1,
                           num_linear_slots=8, max_num_batched_tokens=64)
        sched, dev = Scheduler(cfg), FakeDevice(cfg)
        for i in range(16):
            tail = np.random.default_rng(i).integers(0, 7, 40).tolist()
            submit(sched, dev, make_seq(i, system + tail, max_tokens=1))
            run(sched, dev)
        results[placement] = (sched.counters["reused_tokens"], sched.block_manager.linear.num_saved)
    (reused_stride, saved_stride), (reused_overlap, saved_overlap) = results["stride"], results["overlap"]
    assert reused_overlap == reused_stride == 15 * 16
    assert saved_overlap < saved_stride / 2, results


def test_overlap_needs_scan_saves_of_every_boundary():
    with pytest.raises(ValueError, match="checkpoint_placement 'overlap'.*checkpoint_mode 'scan'"):
        small_config(checkpoint_mode="promote", checkpoint_placement="overlap")
    with pytest.raises(ValueError, match="checkpoint_placement must be one of"):
        small_config(checkpoint_placement="sparse")


@pytest.mark.parametrize("placement, reuse", [("stride", (16, 32)), ("end_of_turn", (20, 36))])
def test_end_of_turn_keeps_the_end_of_the_prompt_and_of_the_output(placement, reuse):
    """bs 4, stride 8. A first turn: a prompt of 22 tokens and 15 tokens of output (36 computed). "end_of_turn" keeps
    the state at 20 (the prompt's end, at a block boundary) and at 36 (the output's), the one it kept at 28 on the
    way dropped; a later prompt that keeps the first prompt but rewrites the reply restores 20, and the next turn,
    all of the first plus a new message, restores 36 (the grid alone: 16 and 32)."""
    cfg = small_config(checkpoint_placement=placement)
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    prompt = [3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 0, 2, 6, 4, 3, 3, 2, 3, 0, 4, 6, 2]
    first = submit(sched, dev, make_seq(1, prompt, max_tokens=15))
    run(sched, dev)
    index = sched.block_manager.linear.index
    off_grid = sorted(d for d in index.depth_of.values() if d % 8)
    assert off_grid == ([20, 36] if placement == "end_of_turn" else [])
    edited = submit(sched, dev, make_seq(2, prompt + [6, 6, 6, 6, 6, 6], max_tokens=1))
    next_turn = submit(sched, dev, make_seq(3, first.token_ids + [5, 5, 5], max_tokens=1))
    run(sched, dev)
    assert (edited.num_cached_tokens, next_turn.num_cached_tokens) == reuse
