"""Async scheduling (`async_scheduling=True`): each step is planned and launched while the one before runs, its
pending tokens taken from that step's results on the device. The outputs are those of step-by-step planning: tokens,
logprobs, finish reasons and text, with stops, seeds, penalties, n > 1, aborts and a failing step. (Cache on against
cache off with it, and under memory pressure: test_engine_cache_equivalence.py.)"""

import numpy as np
import pytest

from gdn_jax import LLM, EngineStepError, LLMEngine, SamplingParams

pytestmark = pytest.mark.engine

# the geometry of test_engine.py's engines: their step shapes are compiled already in the engine lane
KW = dict(block_size=16, chunk_stride=32, max_num_seqs=4, max_model_len=128, verbose=False)


@pytest.fixture(scope="module")
def pair():
    return LLM("tiny", async_scheduling=True, **KW), LLM("tiny", **KW)


def _assert_same(got, want):
    """Each sample's tokens, finish reason and text, and its logprobs to 1e-5: a step planned ahead may hold a row
    more than the same step planned step by step (one for a request that has just ended), and the products' float32
    rounding follows the rows (the deterministic mode's does not)."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        for a, b in zip(g.outputs, w.outputs, strict=True):
            assert (a.token_ids, a.finish_reason, a.text) == (b.token_ids, b.finish_reason, b.text)
            if b.logprobs is not None:
                np.testing.assert_allclose([lp[t].logprob for t, lp in zip(a.token_ids, a.logprobs)],
                                           [lp[t].logprob for t, lp in zip(b.token_ids, b.logprobs)], atol=1e-5)


def _ids(rng, n):
    return rng.integers(4, 250, n).tolist()  # (tiny's vocabulary: 288)


def test_outputs_equal_step_by_step_planning(pair):
    """Text prompts ending at EOS or a stop string or max_tokens, seeded sampling, n = 2 (its forks plan step by
    step until they have forked), and a penalty (its rows plan step by step): the same outputs."""
    ahead, plain = pair
    questions = ["What is a checkpoint?", "The prefix cache", "Explain the GDN state.", "Once upon a time"]
    params = [SamplingParams(temperature=0.0, max_tokens=40, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=30, stop=["the"]),
              SamplingParams(temperature=0.9, seed=7, max_tokens=24, n=2),
              SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.3)]
    want = plain.generate(questions, params, use_tqdm=False)
    got = ahead.generate(questions, params, use_tqdm=False)
    _assert_same(got, want)
    assert {c.finish_reason for o in want for c in o.outputs} >= {"stop", "length"}
    stats = ahead.cache_stats()
    assert stats["planned_ahead"] > 20 and plain.cache_stats()["planned_ahead"] == 0
    assert stats["live_slots"] == 0 and stats["num_running"] == 0 and not ahead.engine.has_unfinished_requests()


def test_an_abort_between_steps_leaves_the_others_as_they_were(pair):
    ahead, plain = pair
    rng = np.random.default_rng(3)
    prompts = [_ids(rng, n) for n in (12, 40, 7)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True)
    want = plain.generate(prompts, greedy, use_tqdm=False)
    engine: LLMEngine = ahead.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy)
    finals, steps = {}, 0
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        steps += 1
        if steps == 4:
            engine.abort_request("r1")  # its row in the step planned ahead is computed for nothing
        engine.scheduler.check_invariants()
    assert "r1" not in finals
    _assert_same([finals["r0"], finals["r2"]], [want[0], want[2]])
    assert engine.cache_stats()["live_slots"] == 0


def test_a_failing_step_with_one_planned_ahead_fails_its_requests_and_the_engine_goes_on(pair, monkeypatch):
    """The step's results raise when read, while the next step runs: the requests of both end with "error", the pools
    and the prefix cache are rebuilt (its checkpoints were indexed before it ran), and the engine serves again."""
    ahead, plain = pair
    engine: LLMEngine = ahead.engine
    rng = np.random.default_rng(5)
    prompts = [_ids(rng, 30), _ids(rng, 9)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1, ignore_eos=True)
    want = plain.generate(prompts, greedy, use_tqdm=False)
    real, calls = engine.worker.collect, []

    def fail_third(launched):
        calls.append(launched)
        if len(calls) == 3:
            raise RuntimeError("injected device failure")
        return real(launched)

    monkeypatch.setattr(engine.worker, "collect", fail_third)
    for i, p in enumerate(prompts):
        engine.add_request(f"f{i}", p, greedy)
    with pytest.raises(EngineStepError, match="injected device failure") as err:
        while engine.has_unfinished_requests():
            engine.step()
    assert sorted(err.value.request_ids) == ["f0", "f1"] and engine._ahead is None
    assert all(c.finish_reason == "error" for o in err.value.outputs for c in o.outputs)
    monkeypatch.undo()
    engine.scheduler.check_invariants()
    s = engine.cache_stats()
    assert s["live_slots"] == 0 and s["num_running"] == 0 and s["failed_steps"] == 1 and s["kv_blocks_cached"] == 0
    _assert_same(ahead.generate(prompts, greedy, use_tqdm=False), want)


def test_refused_with_speculation():
    with pytest.raises(ValueError, match="async_scheduling runs without speculative_config"):
        LLMEngine("tiny", async_scheduling=True, speculative_config={"method": "mtp", "num_speculative_tokens": 1},
                  **KW)


@pytest.mark.mesh
def test_on_a_mesh_outputs_equal_one_device_step_by_step():
    """Tensor parallelism over 2 devices, planned ahead: the samples a feed gathers are replicated over the mesh, and
    warm-up compiles the feeds for that placement."""
    from gdn_jax import jax_compat
    from gdn_jax.worker import step

    rng = np.random.default_rng(6)
    prompts = [_ids(rng, int(n)) for n in rng.integers(5, 80, 6)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1, ignore_eos=True)
    mesh = LLM("tiny-random", async_scheduling=True, tensor_parallel_size=2, **KW)
    mesh.engine.worker._warm_up_feeds()
    before = jax_compat.compilations((step.token_column, step.fed_tokens))
    got = mesh.generate(prompts, greedy, use_tqdm=False)
    want = LLM("tiny-random", **KW).generate(prompts, greedy, use_tqdm=False)
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        np.testing.assert_allclose([lp[t].logprob for t, lp in zip(a.outputs[0].token_ids, a.outputs[0].logprobs)],
                                   [lp[t].logprob for t, lp in zip(b.outputs[0].token_ids, b.outputs[0].logprobs)],
                                   atol=1e-4)
    assert mesh.cache_stats()["planned_ahead"] > 5
    assert jax_compat.compilations((step.token_column, step.fed_tokens)) == before


def test_the_feeds_compile_in_warm_up_not_while_serving(pair):
    """What a feed calls (`token_column`, `fed_tokens`) compiles per rows bucket in warm-up; mixed steps, prefills
    and decodes of any batch then compile nothing more."""
    from gdn_jax import jax_compat
    from gdn_jax.worker import step

    ahead, _ = pair
    ahead.engine.worker._warm_up_feeds()
    before = jax_compat.compilations((step.token_column, step.fed_tokens))
    rng = np.random.default_rng(9)
    for n in (1, 3, 6):
        ahead.generate([{"prompt_token_ids": _ids(rng, int(k))} for k in rng.integers(3, 70, n)],
                       SamplingParams(temperature=0.0, max_tokens=int(rng.integers(3, 20)), ignore_eos=True),
                       use_tqdm=False)
    assert jax_compat.compilations((step.token_column, step.fed_tokens)) == before
