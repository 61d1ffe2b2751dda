"""SamplingParams range checks (every field, by name) and the min_tokens / ignore_eos stop rules."""
import dataclasses

import numpy as np
import pytest

from scheduler import SamplingParams, Scheduler, Sequence
from scheduler.sampling_params import (MAX_LOGPROBS, MAX_N, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TEMPERATURE,
                                       MAX_TOKENS, SEED_BOUND)
from tests.scheduler.sched_helpers import small_config

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("kw, field", [
    (dict(seed=-1), "seed"), (dict(seed=SEED_BOUND), "seed"), (dict(seed=1.5), "seed"), (dict(seed=True), "seed"),
    (dict(seed="7"), "seed"),
    (dict(temperature=-0.1), "temperature"), (dict(temperature=NAN), "temperature"),
    (dict(temperature=INF), "temperature"), (dict(temperature="1"), "temperature"),
    (dict(temperature=MAX_TEMPERATURE * 1.01), "temperature"), (dict(temperature=1e39), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_p=NAN), "top_p"), (dict(top_p=INF), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(top_k=2.0), "top_k"), (dict(top_k=True), "top_k"),
    (dict(min_p=-0.1), "min_p"), (dict(min_p=1.1), "min_p"), (dict(min_p=NAN), "min_p"),
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=MAX_TOKENS + 1), "max_tokens"),
    (dict(max_tokens=2.0), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=17), "min_tokens"),  # > max_tokens (16)
    (dict(n=0), "n"), (dict(n=MAX_N + 1), "n"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(presence_penalty=NAN), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"), (dict(frequency_penalty=INF), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=INF), "repetition_penalty"),
    (dict(repetition_penalty=1e-40), "repetition_penalty"), (dict(repetition_penalty=1e300), "repetition_penalty"),
    (dict(stop_token_ids=[3, -1]), "stop_token_ids"), (dict(stop_token_ids=[3, 2.0]), "stop_token_ids"),
    (dict(stop_token_ids="ab"), "stop_token_ids"), (dict(stop_token_ids=[1 << 31]), "stop_token_ids"),
    (dict(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))), "stop_token_ids"),
    (dict(logprobs=-1), "logprobs"), (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"), (dict(logprobs=1.0), "logprobs"),
    (dict(ignore_eos=1), "ignore_eos"),
    (dict(stop=["a"] * (MAX_STOP_STRINGS + 1)), "stop"),
    (dict(prompt_logprobs=np.int64(MAX_LOGPROBS + 1)), "prompt_logprobs"),
])
def test_every_field_is_range_checked_by_name(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_a_mutated_object_is_caught_on_revalidation():
    sp = SamplingParams(seed=3)
    sp.seed = -1
    with pytest.raises(ValueError, match="seed"):
        sp.__post_init__()


def test_accepted_values_are_normalised():
    sp = SamplingParams(seed=np.uint32(SEED_BOUND - 1), top_k=np.int64(1 << 40), temperature=np.float32(0.5),
                        stop_token_ids=(np.int64(3), 4), n=4, min_tokens=16, max_tokens=16, logprobs=0)
    assert type(sp.seed) is int and sp.seed == SEED_BOUND - 1
    assert sp.top_k == 1 << 40  # clamped to the vocabulary on the device side
    assert type(sp.temperature) is float and sp.stop_token_ids == [3, 4]
    assert SamplingParams(temperature=1e-6).is_greedy and not SamplingParams(temperature=1e-5).is_greedy
    assert not SamplingParams().uses_penalties and SamplingParams(repetition_penalty=1.1).uses_penalties
    assert dataclasses.replace(sp, seed=0).seed == 0
    # the bounds themselves are taken; numpy integers as any other int
    assert SamplingParams(temperature=MAX_TEMPERATURE).temperature == MAX_TEMPERATURE
    assert len(SamplingParams(stop=["a"] * MAX_STOP_STRINGS).stop) == MAX_STOP_STRINGS
    lp = SamplingParams(prompt_logprobs=np.int64(3)).prompt_logprobs
    assert type(lp) is int and lp == 3


def _serve(sp: SamplingParams, feed: list[int], eos: int = 5):
    """Runs one request whose 'model' emits `feed` in order; returns (output, finish reason)."""
    sched = Scheduler(small_config(eos_token_id=eos))
    seq = Sequence(1, [1, 2], sp)
    sched.add(seq)
    feed = list(feed)
    while sched.has_unfinished():
        plan = sched.schedule()
        sched.postprocess(plan, [feed.pop(0) if r.sample else None for r in plan.seqs])
    return seq.output_token_ids, seq.finish_reason


def ref_stop(tokens, max_tokens, min_tokens=0, eos=5, ignore_eos=False, stop_ids=()):
    """Reference stop rule: token i ends the output with 'stop' iff it is EOS (unless ignored) or a stop id and
    i >= min_tokens; the output ends with 'length' at max_tokens."""
    for i, t in enumerate(tokens):
        if i >= min_tokens and ((t == eos and not ignore_eos) or t in stop_ids):
            return tokens[:i + 1], "stop"
        if i + 1 == max_tokens:
            return tokens[:i + 1], "length"
    raise AssertionError("feed too short")


@pytest.mark.parametrize("min_tokens, ignore_eos, stop_ids", [
    (0, False, ()), (2, False, ()), (3, False, (4,)), (0, True, (4,)), (4, True, ()), (6, False, (4,)),
])
def test_min_tokens_and_ignore_eos_stop_rules_match_the_reference(min_tokens, ignore_eos, stop_ids):
    feed = [0, 5, 4, 5, 2, 3, 5, 4, 1, 1]
    sp = SamplingParams(max_tokens=8, min_tokens=min_tokens, ignore_eos=ignore_eos, stop_token_ids=list(stop_ids))
    expected = ref_stop(feed, 8, min_tokens, ignore_eos=ignore_eos, stop_ids=stop_ids)
    assert _serve(sp, feed) == (list(expected[0]), expected[1])


def test_max_tokens_none_generates_until_the_context_is_full():
    """vLLM's `max_tokens=None`: no cap of its own; the output ends with 'length' when prompt + output reach
    max_model_len (64 here; a 2-token prompt), or with a stop token before. min_tokens stays bounded."""
    assert _serve(SamplingParams(max_tokens=None, ignore_eos=True), [7] * 70) == ([7] * 62, "length")
    assert _serve(SamplingParams(max_tokens=None, min_tokens=3), [5, 7, 7, 7, 5, 7]) == ([5, 7, 7, 7, 5], "stop")
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=None, min_tokens=MAX_TOKENS + 1)


def test_prompt_logprobs_skip_reading_the_prefix_cache_by_default():
    """vLLM's default: a request asking for prompt logprobs computes every position unless told to reuse."""
    assert SamplingParams().skip_reading_prefix_cache is False
    assert SamplingParams(prompt_logprobs=2).skip_reading_prefix_cache is True
    assert SamplingParams(prompt_logprobs=-1, skip_reading_prefix_cache=False).skip_reading_prefix_cache is False
    with pytest.raises(ValueError, match="skip_reading_prefix_cache"):
        SamplingParams(skip_reading_prefix_cache=1)
