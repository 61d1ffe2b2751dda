"""checkpoint_mode="scan": a prefill row covers as many strides as the budget allows, and the plan lists a checkpoint
save for each boundary it crosses; the step writes them, postprocess indexes them, a failed step frees them."""
import random

import pytest

from scheduler import Scheduler, SchedulerConfig
from tests.scheduler.sched_helpers import FakeDevice, make_seq, run, small_config, submit

pytestmark = pytest.mark.own_mode  # each test sets checkpoint_mode itself

rng = random.Random(3)
LONG = [rng.randrange(7) for _ in range(2048)]


def big_config(**kw) -> SchedulerConfig:
    base = dict(block_size=16, chunk_stride=256, num_kv_blocks=300, num_linear_slots=24, max_num_seqs=4,
                max_model_len=4096, max_num_batched_tokens=2048, checkpoint_mode="scan")
    return SchedulerConfig(**{**base, **kw})


def one_step(sched, dev, plan=None):
    plan = plan or sched.schedule()
    sampled = dev.execute(plan)
    sched.check_invariants()
    sched.postprocess(plan, sampled)
    sched.check_invariants()
    dev.check_checkpoints(sched)
    return plan


@pytest.mark.parametrize("policy, boundaries", [("all", list(range(256, 2049, 256))), ("last", [2048])])
def test_a_cold_2048_token_prompt_prefills_in_one_step_with_the_policys_saves(policy, boundaries):
    cfg = big_config(checkpoint_policy=policy)
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    submit(sched, dev, make_seq(1, LONG, max_tokens=2))
    plan = one_step(sched, dev)
    assert plan.is_prefill and [(r.start_pos, len(r.token_ids)) for r in plan.seqs] == [(0, 2048)]
    assert [(s.row, s.offset, s.boundary) for s in plan.saves] == [(0, b, b) for b in boundaries]
    stats = sched.stats()
    assert stats["checkpoint_slots"] == stats["checkpoints_saved"] == len(boundaries)
    assert not sched.block_manager.linear.saving
    run(sched, dev)


def test_a_row_that_ends_on_a_boundary_defers_no_save_the_scan_wrote():
    """The step wrote the checkpoint of the boundary its row ends on: a deferred save of it as well would be skipped
    as cached next step (or, had the scan save found no slot, promote the live slot and pay a rotation copy)."""
    cfg = small_config(checkpoint_mode="scan")  # stride 8, budget 16
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    seq = submit(sched, dev, make_seq(1, LONG[:16], max_tokens=3))
    plan = one_step(sched, dev)
    assert [s.boundary for s in plan.saves] == [8, 16] and seq.num_computed_tokens == 16
    assert seq.pending_save_hash is None
    run(sched, dev)
    stats = sched.stats()
    assert (stats["checkpoints_saved"], stats["checkpoints_save_skipped"], stats["rotation_copies"]) == (2, 0, 0)


def test_a_request_sharing_1792_tokens_reuses_1792():
    cfg = big_config()
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    submit(sched, dev, make_seq(1, LONG, max_tokens=2))
    run(sched, dev)
    other = LONG[:1792] + [(t + 1) % 7 for t in LONG[1792:]]
    seq = submit(sched, dev, make_seq(2, other, max_tokens=2))
    plan = one_step(sched, dev)
    assert seq.num_cached_tokens == 1792 and seq.restored
    assert [(r.start_pos, len(r.token_ids)) for r in plan.seqs] == [(1792, 256)]
    assert [s.boundary for s in plan.saves] == [2048]  # its own, different, boundary 2048
    run(sched, dev)


def test_the_budget_cuts_a_row_at_a_stride_boundary_so_the_next_step_starts_on_one():
    cfg = big_config(max_num_batched_tokens=1000)
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    submit(sched, dev, make_seq(1, LONG[:1500], max_tokens=1))
    plans = run(sched, dev)
    rows = [(p.seqs[0].start_pos, len(p.seqs[0].token_ids)) for p in plans]
    assert rows == [(0, 768), (768, 732)]
    assert [s.boundary for p in plans for s in p.saves] == [256, 512, 768, 1024, 1280]


def test_saves_take_free_then_lru_checkpoint_slots_never_live_or_pinned_and_skip_when_none():
    # 6 slots: 1 live for the running request, the rest for checkpoints of boundaries 8, 16, 24, ...
    cfg = small_config(checkpoint_mode="scan", num_linear_slots=7, max_num_seqs=1, max_num_batched_tokens=64)
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    submit(sched, dev, make_seq(1, [1] * 60, max_tokens=1))   # boundaries 8..56: 7 saves wanted, 5 slots free
    plan = one_step(sched, dev)
    assert [s.boundary for s in plan.saves] == [8, 16, 24, 32, 40]
    assert sched.stats()["checkpoints_save_skipped"] == 2
    run(sched, dev)
    # the next request restores the deepest one (40, pinned for its step); its saves evict the LRU others
    seq = submit(sched, dev, make_seq(2, [1] * 44 + [2] * 12, max_tokens=1))
    plan = sched.schedule()
    src = plan.seqs[0].linear_op.restore_src_slot_id
    assert seq.num_cached_tokens == 40 and src > 0
    assert [s.boundary for s in plan.saves] == [48, 56]
    assert not {s.slot for s in plan.saves} & {src, seq.linear_state_id}
    assert sched.stats()["checkpoints_evicted"] == 2
    one_step(sched, dev, plan)
    run(sched, dev)


def test_a_failed_step_frees_its_save_slots_and_indexes_nothing():
    cfg = small_config(checkpoint_mode="scan", max_num_batched_tokens=64)
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    submit(sched, dev, make_seq(1, list(range(7)) * 4, max_tokens=1))
    plan = sched.schedule()
    assert len(plan.saves) == 3
    free_before = len(sched.block_manager.linear.free_slots)
    sched.fail_step(plan)
    sched.check_invariants()
    linear = sched.block_manager.linear
    assert not linear.saving and len(linear.index) == 0
    assert len(linear.free_slots) == free_before + 3 + 1  # the saves and the failed request's live slot


def test_an_abort_during_the_step_still_indexes_what_the_step_wrote():
    cfg = small_config(checkpoint_mode="scan", max_num_batched_tokens=64)
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    submit(sched, dev, make_seq(1, list(range(7)) * 4, max_tokens=5))
    plan = sched.schedule()
    sampled = dev.execute(plan)
    assert sched.abort(1)
    sched.postprocess(plan, sampled)
    sched.check_invariants()
    dev.check_checkpoints(sched)
    assert len(sched.block_manager.linear.index) == 3 and not sched.has_unfinished()


def test_a_step_checks_each_save_against_the_ones_it_has_planned_in_constant_time():
    """Whether a boundary's checkpoint is being saved already was a search of every save planned so far in the step,
    so a step crossing S boundaries did S**2 / 2 comparisons (a 32k-token prompt at a budget of 32768 and a stride of
    16: 34 ms for one schedule())."""
    scanned = [0]

    class Saving(dict):
        def values(self):
            scanned[0] += len(self)
            return super().values()

    cfg = big_config(chunk_stride=16, num_linear_slots=140)
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    sched.block_manager.linear.saving = Saving()
    submit(sched, dev, make_seq(1, LONG))
    plan = sched.schedule()
    assert len(plan.saves) == 2048 // 16
    assert scanned[0] <= len(plan.saves)
    sched.postprocess(plan, dev.execute(plan))
    dev.check_checkpoints(sched)
