"""Worker-level behaviour of the decode path: the float32 copy of the bfloat16 weights for single-row decode."""

import jax.numpy as jnp
import numpy as np

from gdn_jax.config import get_preset
from gdn_jax.model import init_model
from gdn_jax.worker import Worker, plan_memory
from scheduler import LinearStateCacheOp, SamplingParams, ScheduledSequence, StepPlan


def _row(tokens, start, op):
    table = [1, 2, 3, 4]
    slots = [table[p // 16] * 16 + p % 16 for p in range(start, start + len(tokens))]
    return ScheduledSequence(1, tokens, start, table, slots, op, True, SamplingParams(temperature=0.0), 0)


def test_float32_decode_weights_decode_like_the_bfloat16_weights():
    cfg = get_preset("tiny")
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
