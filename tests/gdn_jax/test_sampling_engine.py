"""Sampling through the engine: bad values rejected at add time without harm, reproducibility whatever the batch,
bucket or preemption, fresh noise at every position, and the knobs checked against references built from the
engine's own raw logprobs."""

import numpy as np
import pytest

from gdn_jax import LLM, LLMEngine, SamplingParams
from gdn_jax.sampling import SamplingMetadata
from scheduler import Scheduler, SchedulerConfig, Sequence
from tests.gdn_jax.helpers import random_ids

pytestmark = pytest.mark.model

KW = dict(block_size=16, chunk_stride=32, max_num_seqs=4, max_model_len=128, verbose=False)


def _drain(engine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return done


@pytest.fixture(scope="module")
def engine():
    return LLMEngine("tiny-random", **KW)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-random", **KW)


@pytest.mark.parametrize("bad, field", [
    ("seed=-1", "seed"), ("seed=2**32", "seed"), ("seed=True", "seed"),
    ("temperature=float('inf')", "temperature"), ("temperature=float('nan')", "temperature"),
    ("top_p=float('nan')", "top_p"), ("top_k=-5", "top_k"), ("min_p=2.0", "min_p"),
    ("max_tokens=0", "max_tokens"), ("max_tokens=2**31", "max_tokens"), ("min_tokens=20", "min_tokens"),
    ("stop_token_ids=[512]", "stop_token_ids"), ("stop_token_ids=[-3]", "stop_token_ids"),
    ("logprobs=21", "logprobs"), ("presence_penalty=3.0", "presence_penalty"), ("n=0", "n"),
    ("frequency_penalty=float('nan')", "frequency_penalty"), ("repetition_penalty=-1.0", "repetition_penalty"),
])
def test_bad_sampling_value_is_rejected_at_add_time_and_the_engine_keeps_serving(engine, bad, field):
    rng = np.random.default_rng(2)
    good = random_ids(rng, 40)
    engine.add_request("good", good, SamplingParams(temperature=1.0, seed=5, max_tokens=4))
    engine.step()  # the good request is in flight when the bad one arrives
    try:
        sp = eval(f"SamplingParams({bad})")  # only the vocabulary-dependent values pass construction
        assert field == "stop_token_ids"
    except ValueError as e:
        assert field in str(e)
        sp = SamplingParams()
        name, value = bad.split("=", 1)
        setattr(sp, name, eval(value))  # mutated after construction: add_request re-validates
    with pytest.raises(ValueError, match=field):
        engine.add_request("bad", good, sp)
    engine.add_request("after", random_ids(rng, 20), SamplingParams(temperature=0.0, max_tokens=3))
    done = _drain(engine)
    assert sorted(done) == ["after", "good"]
    assert len(done["good"].outputs[0].token_ids) == 4 and len(done["after"].outputs[0].token_ids) == 3
    engine.scheduler.check_invariants()
    assert engine.cache_stats()["live_slots"] == 0


def test_extreme_but_valid_values_run(engine):
    """The values that used to overflow inside the step: top_k far above the vocabulary is clamped (= off), and
    the largest seed is a valid uint32."""
    prompt = list(range(20, 60))
    engine.add_request("wide", prompt, SamplingParams(top_k=2 ** 31, seed=2 ** 32 - 1, max_tokens=6, ignore_eos=True))
    engine.add_request("off", prompt, SamplingParams(top_k=-1, seed=2 ** 32 - 1, max_tokens=6, ignore_eos=True))
    engine.add_request("hot", prompt, SamplingParams(temperature=1e6, seed=0, max_tokens=6, ignore_eos=True))
    done = _drain(engine)
    assert done["wide"].outputs[0].token_ids == done["off"].outputs[0].token_ids
    assert len(done["hot"].outputs[0].token_ids) == 6


def _prompts():
    rng = np.random.default_rng(11)
    system = random_ids(rng, 40)
    return [system + random_ids(rng, int(n)) for n in (5, 30, 50)] + [random_ids(rng, 70), random_ids(rng, 9)]


def test_seeded_output_is_the_same_whatever_the_batch_bucket_and_preemption():
    prompts = _prompts()
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=100 + i, max_tokens=24, ignore_eos=True)
              for i in range(len(prompts))]
    roomy = LLM("tiny-random", enable_prefix_caching=False, **KW)
    alone = [roomy.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    # 9 usable KV blocks for up to 4 sequences of up to 94 tokens: they preempt each other
    tight = LLM("tiny-random", enable_prefix_caching=True, num_kv_blocks=10, num_linear_slots=7, **KW)
    together = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    reversed_order = [o.outputs[0].token_ids for o in tight.generate(prompts[::-1], params[::-1], use_tqdm=False)]
    assert tight.cache_stats()["preemptions"] > 0
    assert together == alone and reversed_order[::-1] == alone
    assert len({tuple(t) for t in alone}) == len(alone)


def test_consecutive_positions_draw_fresh_noise(llm):
    """On a flat distribution (temperature 1e4 over 512 ids), a long sample is not constant and looks uniform:
    drawing the same noise at every position (a key without the position, or a position stuck at 0) fails."""
    params = [SamplingParams(temperature=1e4, seed=7 + i, max_tokens=110, ignore_eos=True) for i in range(4)]
    outs = [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7, 8]] * 4, params, use_tqdm=False)]
    for toks in outs:
        assert len(toks) == 110 and len(set(toks)) >= 80  # uniform: about 99 distinct of 110 expected
    counts = np.bincount(np.concatenate(outs) // 64, minlength=8)  # 440 draws in 8 bins of 64 ids
    chi2 = ((counts - 55.0) ** 2 / 55.0).sum()
    assert chi2 < 24.3, counts  # chi-square with 7 degrees of freedom: p > 1e-3


def test_penalties_match_a_numpy_reference_on_the_models_own_logits(llm):
    """Greedy with all three penalties through the engine; then one plain forward over prompt + output gives the
    logits of every position, the numpy reference applies the penalties (repetition over prompt and output,
    frequency and presence over the output) and the engine's token must be its argmax at every step."""
    import jax

    from gdn_jax.model.qwen35 import forward, init_model
    from gdn_jax.model.state import init_state
    from tests.gdn_jax.helpers import BLOCK_SIZE, single_row_batch
    from tests.gdn_jax.test_sampling import ref_penalties

    prompt = random_ids(np.random.default_rng(4), 30)
    kw = dict(presence_penalty=0.5, frequency_penalty=0.4, repetition_penalty=1.8)
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True), use_tqdm=False)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, **kw),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert out != plain[0].outputs[0].token_ids
    cfg = llm.engine.cfg
    graphdef, params = init_model(cfg)
    seq = prompt + out[:-1]
    logits, _ = jax.jit(forward, static_argnums=(0, 4))(graphdef, params, single_row_batch(seq, 0, 8, slot=1),
                                                        init_state(cfg, 9, BLOCK_SIZE, 2), True)
    logits = np.asarray(logits[0, len(prompt) - 1:])
    history = np.full((len(out), len(seq)), -1)
    for i in range(len(out)):
        history[i, :len(prompt) + i] = seq[:len(prompt) + i]
    n = len(out)
    ref = ref_penalties(logits, history, [len(prompt)] * n, [kw["presence_penalty"]] * n,
                        [kw["frequency_penalty"]] * n, [kw["repetition_penalty"]] * n)
    chosen = ref[np.arange(n), out]
    assert (chosen >= ref.max(-1) - 1e-3).all(), np.nonzero(chosen < ref.max(-1) - 1e-3)
    assert (np.argmax(ref, -1) != np.argmax(logits, -1)).sum() >= 5  # the penalties decide many steps


def test_min_tokens_bans_a_stop_token_and_greedy_takes_the_runner_up(llm):
    prompt = list(range(30, 70))
    ref = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    j = next(i for i in range(1, 8) if ref.token_ids[i] not in ref.token_ids[:i])
    stop = ref.token_ids[j]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True,
                                                stop_token_ids=[stop], min_tokens=j + 1),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:j] == ref.token_ids[:j]
    runner_up = next(t for t, lp in ref.logprobs[j].items() if lp.rank == 2)
    assert out.token_ids[j] == runner_up and stop not in out.token_ids[:j + 1]
    stops = [i for i, t in enumerate(out.token_ids) if t == stop]
    assert out.finish_reason == ("stop" if stops else "length") and (not stops or stops[0] == len(out.token_ids) - 1)


def test_metadata_carries_history_and_ban_of_the_scheduled_rows():
    """The host side of the knobs: penalties get prompt + output with the prompt length; the ban holds the stop ids
    and the end-of-sequence ids (also under ignore_eos, as in vLLM) only while fewer than min_tokens tokens were
    generated."""
    cfg = SchedulerConfig(num_kv_blocks=20, num_linear_slots=6, block_size=4, chunk_stride=8, max_num_seqs=4,
                          max_model_len=32, eos_token_id=1)
    sched = Scheduler(cfg)
    a = Sequence(1, [5, 6, 7], SamplingParams(repetition_penalty=1.2, min_tokens=2, stop_token_ids=[9]))
    b = Sequence(2, [5, 6], SamplingParams(min_tokens=1, ignore_eos=True, stop_token_ids=[4], seed=3))
    c = Sequence(3, [8], SamplingParams(temperature=0.0, top_k=10 ** 9))
    for s in (a, b, c):
        sched.add(s)
    for step in range(3):
        plan = sched.schedule()
        md = SamplingMetadata.from_rows(plan.seqs, 4, 16, vocab_size=512, eos_token_ids=(1,), default_seed=0)
        rows = {r.seq_id: i for i, r in enumerate(plan.seqs)}
        assert md.history[rows[1]].tolist() == a.token_ids + [-1] * (16 - len(a.token_ids))
        assert md.prompt_lens[rows[1]] == 3 and (md.history[rows[2]] == -1).all()
        assert sorted(md.banned[rows[1]][md.banned[rows[1]] >= 0]) == ([1, 9] if step < 2 else [])
        assert sorted(md.banned[rows[2]][md.banned[rows[2]] >= 0]) == ([1, 4] if step == 0 else [])
        several = SamplingMetadata.from_rows(plan.seqs, 4, 16, vocab_size=512, eos_token_ids=(1, 9, 6),
                                             default_seed=0)  # the model's EOS and further end-of-sequence ids
        assert sorted(several.banned[rows[1]][several.banned[rows[1]] >= 0]) == ([1, 6, 9] if step < 2 else [])
        assert sorted(several.banned[rows[2]][several.banned[rows[2]] >= 0]) == ([1, 4, 6, 9] if step == 0 else [])
        assert md.positions[rows[1]] == step and md.seeds[rows[2]] == 3 and md.seeds[rows[1]] == 1
        assert md.temperature[rows[3]] == 0 and md.top_k[rows[3]] == 512
        sched.postprocess(plan, [2 + step] * len(plan.seqs))
