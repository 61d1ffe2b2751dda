"""restore_linear_state_slots: copy semantics, cold start, continuing rows, fail-closed validation."""

import jax.numpy as jnp
import numpy as np
import pytest

from gdn_jax.config import get_preset
from gdn_jax.model.state import DeviceState, init_state
from gdn_jax.model.state import restore_ops, validate_cache_ops
from scheduler import LinearStateCacheOp

pytestmark = pytest.mark.model

NUM_SLOTS = 8


@pytest.fixture
def pools():
    """Every slot of every GDN layer holds distinct values (slot s, layer j -> values around 100 j + s)."""
    cfg = get_preset("tiny-random")
    st = init_state(cfg, 2, 16, NUM_SLOTS)
    rng = np.random.default_rng(0)

    def fill(pool):  # [layers, slots, ...]
        j = np.arange(pool.shape[0]).reshape((-1,) + (1,) * (pool.ndim - 1))
        s = np.arange(NUM_SLOTS).reshape((1, -1) + (1,) * (pool.ndim - 2))
        return jnp.asarray(100 * j + s + rng.random(pool.shape), pool.dtype)

    return DeviceState(st.k, st.v, fill(st.conv), fill(st.ssm))


def _snapshot(state):
    """Every GDN layer's conv and SSM pool, slot axis first."""
    return [np.asarray(layer) for pool in (state.conv, state.ssm) for layer in pool]


def test_restore_copies_source_into_live_in_every_layer(pools):
    before = _snapshot(pools)
    ops = [LinearStateCacheOp(3, True, 5),    # warm restore 5 -> 3
           LinearStateCacheOp(4, True, -1),   # forced cold start
           LinearStateCacheOp(6, False, -1)]  # continuing sequence
    state, warm = restore_ops(pools, ops, NUM_SLOTS)
    after = _snapshot(state)
    assert np.asarray(warm).tolist() == [True, False, True]
    for b, a in zip(before, after):
        np.testing.assert_array_equal(a[3], b[5])           # restored slot equals its source
        np.testing.assert_array_equal(a[5], b[5])           # the source is untouched (copy, not move)
        for s in (0, 1, 2, 4, 6, 7):                         # nothing else changed, cold slot included
            np.testing.assert_array_equal(a[s], b[s])


def test_two_rows_may_restore_from_the_same_checkpoint(pools):
    before = _snapshot(pools)
    state, warm = restore_ops(pools, [LinearStateCacheOp(1, True, 7), LinearStateCacheOp(2, True, 7)], NUM_SLOTS)
    for b, a in zip(before, _snapshot(state)):
        np.testing.assert_array_equal(a[1], b[7])
        np.testing.assert_array_equal(a[2], b[7])
    assert np.asarray(warm).all()


@pytest.mark.parametrize("op, message", [
    (LinearStateCacheOp(0, True, 3), "linear_state_id 0"),
    (LinearStateCacheOp(NUM_SLOTS, False, -1), f"linear_state_id {NUM_SLOTS}"),
    (LinearStateCacheOp(2, True, 0), "restore_src_slot_id 0"),
    (LinearStateCacheOp(2, True, NUM_SLOTS + 3), f"restore_src_slot_id {NUM_SLOTS + 3}"),
    (LinearStateCacheOp(2, True, -7), "restore_src_slot_id -7"),
    (LinearStateCacheOp(2, True, 2), "both 2"),
])
def test_invalid_ids_are_rejected_before_dispatch(pools, op, message):
    before = _snapshot(pools)
    with pytest.raises(ValueError, match=message):
        restore_ops(pools, [LinearStateCacheOp(1, True, 5), op], NUM_SLOTS)
    for b, a in zip(before, _snapshot(pools)):  # nothing ran: the buffers were not donated or touched
        np.testing.assert_array_equal(a, b)


def test_duplicate_live_slots_are_rejected():
    with pytest.raises(ValueError, match="same live slot"):
        validate_cache_ops([LinearStateCacheOp(2, False, -1), LinearStateCacheOp(2, True, 3)], NUM_SLOTS)


def test_restore_from_a_slot_advanced_in_the_same_step_is_rejected():
    ops = [LinearStateCacheOp(2, False, -1), LinearStateCacheOp(3, True, 2)]
    with pytest.raises(ValueError, match="restore_src_slot_id 2 is a live slot"):
        validate_cache_ops(ops, NUM_SLOTS, in_place=True)
    validate_cache_ops(ops, NUM_SLOTS)  # a prefill step reads every state before writing any: a fork
    validate_cache_ops([LinearStateCacheOp(2, False, -1), LinearStateCacheOp(3, True, 4)], NUM_SLOTS, in_place=True)


def test_op_round_trip_keeps_forced_cold_start():
    op = LinearStateCacheOp(4, True, -1)
    back = LinearStateCacheOp.from_dict(op.to_dict())
    assert back == op and back.restore_requested and back.restore_src_slot_id == -1


def test_worker_cold_start_ignores_garbage_and_warm_restore_continues_exactly():
    """Through the worker's jitted step: prefill 32 tokens into slot 1, restore them into slot 2 and continue;
    the result equals one uninterrupted prefill, and a cold start on a garbage-filled slot equals a clean one."""
    from gdn_jax.model.qwen35 import init_model
    from gdn_jax.worker.worker import Worker
    from gdn_jax.config import EngineConfig
    from gdn_jax.worker.memory import plan_memory
    from scheduler import SamplingParams, ScheduledSequence, StepPlan
    from scheduler.sampling_params import MAX_LOGPROBS

    cfg = get_preset("tiny-random")
    graphdef, params = init_model(cfg)
    settings = EngineConfig.create(block_size=16, max_num_seqs=2, max_model_len=64, chunk_stride=32,
                                   checkpoint_mode="promote", num_kv_blocks=9, num_linear_slots=4)
    mem = plan_memory(cfg, settings)

    def worker(chunk=32):
        return Worker(cfg, graphdef, params, mem, settings.replace(chunk_stride=chunk))

    def row(tokens, start, table, op):
        slots = [table[p // 16] * 16 + p % 16 for p in range(start, start + len(tokens))]
        return ScheduledSequence(1, tokens, start, table, slots, op, True,
                                 SamplingParams(temperature=0.0, logprobs=MAX_LOGPROBS), 0)  # top logprobs compared

    toks = np.random.default_rng(0).integers(4, 500, 48).tolist()
    one_pass = worker(64).execute(StepPlan(True, [row(toks, 0, [1, 2, 3], LinearStateCacheOp(1, True, -1))]))

    w = worker()
    w.state = DeviceState(w.state.k, w.state.v, w.state.conv + 9.0, w.state.ssm - 5.0)  # garbage in every slot
    w.execute(StepPlan(True, [row(toks[:32], 0, [1, 2, 3], LinearStateCacheOp(1, True, -1))]))  # cold
    resumed = w.execute(StepPlan(True, [row(toks[32:], 32, [1, 2, 3], LinearStateCacheOp(2, True, 1))]))
    np.testing.assert_allclose(resumed.top_logprobs, one_pass.top_logprobs, atol=1e-5)
    assert resumed.tokens.tolist() == one_pass.tokens.tolist()
    # without the restore (slot 2 warm with garbage) the continuation is wrong: the copy is what makes it exact
    wrong = w.execute(StepPlan(True, [row(toks[32:], 32, [1, 2, 3], LinearStateCacheOp(3, False, -1))]))
    assert np.abs(wrong.top_logprobs - one_pass.top_logprobs).max() > 1e-2


class _CountedSlot(int):
    """A slot id that counts the comparisons made with it."""
    comparisons = 0

    def __eq__(self, other):
        type(self).comparisons += 1
        return int(self) == int(other)

    __hash__ = int.__hash__


def test_one_token_check_looks_each_source_up_once():
    """The one-token check finds a row's restore source among the step's live slots by a set lookup: it compared
    the source with every live slot, rows**2 comparisons when many rows restore (4096 rows: 129 ms)."""
    rows = 512
    ops = [LinearStateCacheOp(_CountedSlot(1 + i), True, _CountedSlot(1 + rows + i)) for i in range(rows)]
    _CountedSlot.comparisons = 0
    validate_cache_ops(ops, 3 * rows, in_place=True)
    assert _CountedSlot.comparisons <= 4 * rows
    reads_a_live_slot = [LinearStateCacheOp(3 * rows, False, -1), LinearStateCacheOp(3 * rows + 1, True, 3 * rows)]
    with pytest.raises(ValueError, match=f"restore_src_slot_id {3 * rows} is a live slot"):
        validate_cache_ops(ops + reads_a_live_slot, 3 * rows + 2, in_place=True)
