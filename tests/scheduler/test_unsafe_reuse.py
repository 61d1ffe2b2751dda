"""The unsafe ablation modes reuse exactly the lengths the exact path refuses, and the fake device sees the error."""
import pytest

from scheduler import Scheduler
from tests.scheduler.sched_helpers import FakeDevice, make_seq, run, small_config, submit
from tests.scheduler.test_composite_reuse import P, checkpoint_slot

# served first: P[:20] leaves checkpoints at 8 and 16 and KV blocks [0, 20)
# then P[:14] + tail: KV matches 12 tokens (3 blocks), the checkpoint index reaches 8
TAIL = [1, 1, 2, 2, 0, 0, 1, 2, 3, 4, 5, 6]


def _second_admission(mode):
    cfg = small_config(unsafe_reuse=mode)
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    submit(sched, dev, make_seq(1, P[:20], max_tokens=1))
    run(sched, dev)
    seq = submit(sched, dev, make_seq(2, P[:14] + TAIL))
    plan = sched.schedule()
    return sched, dev, seq, plan, plan.seqs[0]


@pytest.mark.parametrize("mode, reuse, restores_from", [(None, 8, 8), ("cold", 12, None), ("stale", 12, 8)])
def test_each_mode_reuses_exactly(mode, reuse, restores_from):
    sched, dev, seq, plan, row = _second_admission(mode)
    assert (seq.kv_match, seq.linear_reach, seq.num_cached_tokens) == (12, 8, reuse)
    assert row.start_pos == reuse and len(row.block_table) >= 3
    op = row.linear_op
    assert op.restore_requested
    if restores_from is None:
        assert op.restore_src_slot_id == -1 and not seq.restored     # a zero state at position 12
    else:
        assert op.restore_src_slot_id == checkpoint_slot(sched, P[:restores_from]) and seq.restored
    if mode is None:
        dev.execute(plan)  # the exact path: the fake device checks the state is the prefix's own
    else:
        with pytest.raises(AssertionError, match="recurrent state is not its prefix at 12"):
            dev.execute(plan)


def test_unsafe_reuse_is_validated():
    with pytest.raises(ValueError, match="unsafe_reuse must be one of"):
        small_config(unsafe_reuse="warm")
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        small_config(unsafe_reuse="cold", enable_prefix_caching=False)
