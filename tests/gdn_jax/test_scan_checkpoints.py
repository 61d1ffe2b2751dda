"""checkpoint_mode="scan": the checkpoints a prefill step writes from its chunked scan are the states a separate cold
prefill reaches at those boundaries, in every GDN layer; a long prompt prefills in one step; reuse stays exact."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn_jax import LLM, LLMEngine, SamplingParams
from gdn_jax.model import forward, init_state
from tests.gdn_jax.helpers import BLOCK_SIZE, random_ids, single_row_batch

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True)


def cold_states(worker, tokens):
    """Per GDN layer, (conv, ssm) after a cold prefill of `tokens` alone, through the plain forward."""
    nb = math.ceil(len(tokens) / BLOCK_SIZE)
    state = init_state(worker.cfg, nb + 1, BLOCK_SIZE, 2, worker.dtype)
    _, state = forward(worker.graphdef, worker.params, single_row_batch(tokens, 0, nb), state)
    return [(np.asarray(c[1], np.float32), np.asarray(s[1])) for c, s in zip(state.conv, state.ssm)]


def saved_checkpoints(engine, tokens):
    """{boundary: slot} of the prompt's boundaries that are in the checkpoint index."""
    cfg = engine.scheduler_config
    from scheduler import Sequence, SamplingParams as SP
    probe = Sequence(-1, list(tokens), SP())
    probe.update_linear_state_hashes(cfg.chunk_stride, cfg.state_fingerprint)
    index = engine.scheduler.block_manager.linear.index
    return {(i + 1) * cfg.chunk_stride: index.slot_of[h] for i, h in enumerate(probe.linear_state_hashes)
            if h in index.slot_of}


@pytest.mark.parametrize("stride, budget, length, seed", [(16, 256, 150, 0), (32, 96, 200, 1), (64, 256, 233, 2)])
def test_every_saved_checkpoint_equals_a_cold_prefill_to_its_boundary(stride, budget, length, seed):
    engine = LLMEngine("tiny-random", block_size=BLOCK_SIZE, chunk_stride=stride, max_num_seqs=2, max_model_len=256,
                       max_num_batched_tokens=budget, verbose=False)
    prompt = random_ids(np.random.default_rng(seed), length)
    engine.add_request("a", prompt, SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    saved = saved_checkpoints(engine, prompt)
    assert sorted(saved) == list(range(stride, length + 1, stride))  # policy "all": every boundary crossed
    pools = engine.worker.state
    for b, slot in saved.items():
        for layer, (conv, ssm) in enumerate(cold_states(engine.worker, prompt[:b])):
            np.testing.assert_allclose(np.asarray(pools.conv[layer][slot], np.float32), conv, atol=1e-5, rtol=0,
                                       err_msg=f"conv state, boundary {b}, GDN layer {layer}")
            np.testing.assert_allclose(np.asarray(pools.ssm[layer][slot]), ssm, atol=1e-5, rtol=0,
                                       err_msg=f"ssm state, boundary {b}, GDN layer {layer}")


@pytest.fixture(scope="module")
def long_engines():
    kw = dict(block_size=BLOCK_SIZE, chunk_stride=256, max_num_seqs=2, max_model_len=2304,
              max_num_batched_tokens=2048, verbose=False)
    return LLM("tiny-random", **kw), LLM("tiny-random", enable_prefix_caching=False, **kw)


def test_a_2048_token_prompt_prefills_in_one_step_and_a_1792_token_share_is_reused_exactly(long_engines):
    cached, plain = long_engines
    rng = np.random.default_rng(5)
    first = random_ids(rng, 2048)
    second = first[:1792] + random_ids(rng, 256)
    steps = []
    real = cached.engine.worker.execute
    cached.engine.worker.execute = lambda plan, *a, **kw: (steps.append(
        (plan.is_prefill, len(plan.seqs), len(plan.saves))), real(plan, *a, **kw))[1]
    try:
        a = cached.generate([first], GREEDY, use_tqdm=False)[0]
        assert steps[0] == (True, 1, 8) and not any(p for p, _, _ in steps[1:])  # one prefill step, 8 saves
        b = cached.generate([second], GREEDY, use_tqdm=False)[0]
    finally:
        cached.engine.worker.execute = real
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 1792)
    for got, prompt in ((a, first), (b, second)):
        want = plain.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
        assert got.outputs[0].token_ids == want.token_ids
        np.testing.assert_allclose([lp[t].logprob for t, lp in zip(got.outputs[0].token_ids, got.outputs[0].logprobs)],
                                   [lp[t].logprob for t, lp in zip(want.token_ids, want.logprobs)], atol=1e-5, rtol=0)


def test_policy_last_saves_only_the_deepest_boundary_and_a_next_turn_reuses_it():
    kw = dict(block_size=BLOCK_SIZE, chunk_stride=32, max_num_seqs=2, max_model_len=256, verbose=False)
    last = LLM("tiny-random", checkpoint_policy="last", **kw)
    plain = LLM("tiny-random", enable_prefix_caching=False, **kw)
    rng = np.random.default_rng(9)
    turn1 = random_ids(rng, 100)
    out1 = last.generate([turn1], GREEDY, use_tqdm=False)[0]
    assert sorted(saved_checkpoints(last.engine, turn1)) == [96]
    turn2 = turn1 + list(out1.outputs[0].token_ids) + random_ids(rng, 20)
    out2 = last.generate([turn2], GREEDY, use_tqdm=False)[0]
    assert out2.num_cached_tokens == 96
    assert out2.outputs[0].token_ids == plain.generate([turn2], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
