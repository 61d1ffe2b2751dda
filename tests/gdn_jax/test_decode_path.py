"""The decode step's CPU-specific paths compute what the plain ones do: rows a few at a time (attention, GDN state
advanced in its pool, the restore read from the source slot) and the float32 copy of bfloat16 decode weights."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdn_jax.model as model
from gdn_jax.config import get_preset
from gdn_jax.model import Batch, DeviceState, forward, init_model, init_state
from gdn_jax.restore import restore_linear_state_slots
from gdn_jax.worker import Worker, plan_memory
from scheduler import LinearStateCacheOp, SamplingParams, ScheduledSequence, StepPlan

BS, NB, SLOTS = 16, 3, 8


def _random_state(cfg, seed):
    """Pools full of distinct values, so a row that reads the wrong slot or position shows."""
    st = init_state(cfg, 1 + 4 * NB, BS, SLOTS)
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 64))
    fill = lambda p: jax.random.normal(next(keys), p.shape, p.dtype)  # noqa: E731
    return DeviceState(*(fill(pool) for pool in (st.k, st.v, st.conv, st.ssm)))


def _per_layer(state):
    """Every layer's pools, each with its slot (GDN) or block (KV) axis first: [KV k..., KV v..., conv..., ssm...]."""
    return ([state.k[:, j].swapaxes(0, 1) for j in range(state.k.shape[1])]
            + [state.v[:, j].swapaxes(0, 1) for j in range(state.v.shape[1])] + list(state.conv) + list(state.ssm))


@pytest.mark.parametrize("T", [1, 16])
def test_rows_a_few_at_a_time_equal_all_rows_at_once(monkeypatch, T):
    """Four rows (one restoring from slot 6, two continuing, one padding row), decode and prefill: one row per loop
    iteration gives the logits and pools of one iteration for all rows, and both equal the previous design, a
    separate copy of the source into the live slot followed by a forward that reads the live slots."""
    cfg = get_preset("tiny-random")
    graphdef, params = init_model(cfg)
    rng = np.random.default_rng(T)
    start = np.array([20, 9, 30, 0], np.int32)
    lengths = np.array([T, T, T // 2 + 1, 0], np.int32)
    tables = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9], [0, 0, 0]], np.int32)
    pos = start[:, None] + np.arange(T)[None, :]
    slots = np.where(np.arange(T)[None, :] < lengths[:, None],
                     np.take_along_axis(tables, np.minimum(pos // BS, NB - 1), 1) * BS + pos % BS, 0)
    batch = Batch(tokens=jnp.asarray(rng.integers(4, 500, (4, T)), jnp.int32), start_pos=jnp.asarray(start),
                  lengths=jnp.asarray(lengths), block_tables=jnp.asarray(tables),
                  slot_mapping=jnp.asarray(slots, jnp.int32), linear_state_ids=jnp.asarray([1, 2, 3, 0], jnp.int32),
                  has_initial_state=jnp.asarray([True, True, True, False]),
                  initial_state_ids=jnp.asarray([6, 2, 3, 0], jnp.int32))
    results = []
    for budget in (1 << 30, 1):  # all rows in one iteration; one row per iteration
        monkeypatch.setitem(model.CPU_ROWS_BYTES, "attention", budget)
        monkeypatch.setitem(model.CPU_ROWS_BYTES, "gdn_decode", budget)
        step = jax.jit(lambda p, b, s: forward(graphdef, p, b, s))  # a fresh trace under this budget
        results.append(jax.device_get(step(params, batch, _random_state(cfg, 0))))
    (l1, s1), (l2, s2) = results
    np.testing.assert_allclose(l1[:3], l2[:3], atol=1e-5)
    for a, b in zip(_per_layer(s1), _per_layer(s2)):
        np.testing.assert_allclose(a[1:], b[1:], atol=1e-5)  # slot / block 0 is the padding sink
    before = _random_state(cfg, 0)
    copied, warm = restore_linear_state_slots(before, batch.linear_state_ids, jnp.asarray([True, False, False, True]),
                                              jnp.asarray([6, -1, -1, -1], jnp.int32))
    assert np.asarray(warm).tolist() == np.asarray(batch.has_initial_state).tolist()
    plain = dataclasses.replace(batch, initial_state_ids=None)  # reads the live slots, as before the fold
    l3, s3 = jax.device_get(jax.jit(lambda p, b, s: forward(graphdef, p, b, s))(params, plain, copied))
    np.testing.assert_allclose(l1[:3], l3[:3], atol=1e-5)
    for x, y in zip((s1.conv, s1.ssm), (s3.conv, s3.ssm)):
        np.testing.assert_allclose(x[:, 1:4], y[:, 1:4], atol=1e-5)
    for x, y in zip((s1.conv, s1.ssm), jax.device_get((before.conv, before.ssm))):
        np.testing.assert_array_equal(x[:, 6], y[:, 6])  # the restore source is read, never written


def _row(tokens, start, op):
    table = [1, 2, 3, 4]
    slots = [table[p // 16] * 16 + p % 16 for p in range(start, start + len(tokens))]
    return ScheduledSequence(1, tokens, start, table, slots, op, True, SamplingParams(temperature=0.0), 0)


def test_float32_decode_weights_decode_like_the_bfloat16_weights():
    cfg = get_preset("tiny-random")
    graphdef, params = init_model(cfg, dtype=jnp.bfloat16)
    mem = plan_memory(cfg, jnp.bfloat16, 16, 2, 64, num_kv_blocks=9, num_linear_slots=4, memory_budget_bytes=1 << 24)
    prompt = np.random.default_rng(0).integers(4, 500, 20).tolist()
    results = {}
    for copy in (True, False):
        w = Worker(cfg, graphdef, params, mem, 16, max_num_seqs=2, max_model_len=64, chunk_stride=32,
                   dtype=jnp.bfloat16, float32_decode_weights=copy)
        kernels = [a for a, b in zip(w._decode_leaves, w._param_leaves) if a is not b]
        assert (len(kernels) > 0 and all(k.dtype == jnp.float32 for k in kernels)) == copy
        out = w.execute(StepPlan(True, [_row(prompt, 0, LinearStateCacheOp(1, True, -1))]))
        steps = [out]
        for i in range(6):  # greedy decode, one row: the single-row bucket that uses the copy
            steps.append(w.execute(StepPlan(False, [_row([int(steps[-1].tokens[0])], len(prompt) + i,
                                                         LinearStateCacheOp(1, False, -1))])))
        results[copy] = steps
    for a, b in zip(results[True], results[False]):
        assert a.tokens.tolist() == b.tokens.tolist()
        np.testing.assert_allclose(a.top_logprobs, b.top_logprobs, atol=2e-2)  # bf16 activations either way
