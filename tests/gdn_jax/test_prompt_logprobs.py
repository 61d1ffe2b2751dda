"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`) and text stop sequences (`SamplingParams.stop`)."""

import numpy as np
import pytest

from gdn_jax import LLM, LLMEngine, ModelConfig, SamplingParams
from gdn_jax.engine.outputs import LogprobRow
from tests.gdn_jax.helpers import FIXTURE, random_ids

pytestmark = pytest.mark.model


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def ref():
    return np.load(FIXTURE / "reference.npz")


@pytest.fixture(scope="module")
def hf_llm():
    return LLM(str(FIXTURE), max_model_len=256, max_num_seqs=2, chunk_stride=32, verbose=False)


def test_prompt_logprobs_match_transformers_at_every_position(ref, hf_llm):
    ids = ref["prompt_ids"].tolist()
    out = hf_llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=5),
                          use_tqdm=False)[0]
    expect = _log_softmax(ref["logits_full_f64"])  # row p - 1 scores the token at p
    plp = out.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None and out.num_cached_tokens == 0
    for p in range(1, len(ids)):
        entry, want = plp[p], expect[p - 1]
        assert ids[p] in entry
        np.testing.assert_allclose(entry[ids[p]].logprob, want[ids[p]], atol=1e-3, rtol=0)
        assert entry[ids[p]].rank == 1 + int((want > want[ids[p]]).sum())
        top = sorted((lp for t, lp in entry.items() if lp.rank <= 5), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top] == [1, 2, 3, 4, 5]
        np.testing.assert_allclose([lp.logprob for lp in top], np.sort(want)[::-1][:5], atol=1e-3, rtol=0)
    # the continuation after a scored prompt is the one transformers generates
    assert out.outputs[0].token_ids == [int(np.argmax(ref["logits_full"][-1]))]


def test_whole_rows_match_transformers_and_are_bounded_by_vocabulary(ref, hf_llm):
    ids = ref["prompt_ids"][:40].tolist()
    # the previous test cached this prefix: skip reading the cache so that every position is computed
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=-1, skip_reading_prefix_cache=True)
    rows = hf_llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)[0].prompt_logprobs
    assert rows[0] is None and all(isinstance(r, LogprobRow) and len(r) == 512 for r in rows[1:])
    np.testing.assert_allclose(np.stack([r.array for r in rows[1:]]), _log_softmax(ref["logits_full_f64"][:39]),
                               atol=1e-3, rtol=0)
    best = int(np.argmax(rows[7].array))
    assert rows[7][best].rank == 1 and 512 not in rows[7] and sum(1 for _ in rows[7]) == 512
    big = LLMEngine(ModelConfig(vocab_size=70_000), max_model_len=64, max_num_seqs=1, verbose=False)
    with pytest.raises(ValueError, match="prompt_logprobs=-1.*65536"):
        big.validate_request([5, 6, 7], SamplingParams(prompt_logprobs=-1))
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


@pytest.fixture(scope="module")
def tiny_pair():
    kw = dict(block_size=16, chunk_stride=32, max_num_seqs=4, max_model_len=256, verbose=False)
    return LLM("tiny-random", enable_prefix_caching=True, **kw), LLM("tiny-random", enable_prefix_caching=False, **kw)


def test_cached_positions_are_none_and_computed_ones_equal_cache_off(tiny_pair):
    on, off = tiny_pair
    rng = np.random.default_rng(3)
    system = random_ids(rng, 100)
    prompts = [system + random_ids(rng, 30), system + random_ids(rng, 45)]
    sp = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2, logprobs=1, skip_reading_prefix_cache=False)
    ref = off.generate(prompts, sp, use_tqdm=False)
    on.generate(prompts[:1], sp, use_tqdm=False)                      # caches the system prompt
    hit = on.generate(prompts[1:], sp, use_tqdm=False)[0]
    # by default (vLLM's) a request with prompt logprobs reads no cache: every position has them
    skip = on.generate(prompts[1:], SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2, logprobs=1),
                       use_tqdm=False)[0]
    c = hit.num_cached_tokens
    assert c == 96 and skip.num_cached_tokens == 0
    assert all(e is None for e in hit.prompt_logprobs[:c + 1])
    for out, first in ((hit, c + 1), (skip, 1)):
        assert out.outputs[0].token_ids == ref[1].outputs[0].token_ids
        for p in range(first, len(prompts[1])):
            got, want = out.prompt_logprobs[p], ref[1].prompt_logprobs[p]
            assert got.keys() == want.keys()
            for t in want:
                assert abs(got[t].logprob - want[t].logprob) <= 1e-5 and got[t].rank == want[t].rank
    s = on.cache_stats()
    assert s["queries"] == 2 and s["hits"] == 1  # the skipping request is not a query
    assert s["live_slots"] == 0 and s["kv_blocks_free"] == on.engine.memory.num_kv_blocks - 1


def test_a_prompt_preempted_while_it_prefills_is_scored_at_every_position(tiny_pair):
    """A request preempted between two chunks of its prompt prefills it again; the positions after the preemption are
    scored then (they used to be left None), and every position equals a cache-off run of the prompt alone."""
    llm = LLM("tiny-random", block_size=16, chunk_stride=32, max_num_seqs=2, max_model_len=224, num_kv_blocks=15,
              max_num_batched_tokens=128, verbose=False)
    rng = np.random.default_rng(7)
    decoding, prompt = random_ids(rng, 31), random_ids(rng, 192)
    sp = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1, ignore_eos=True)
    out = llm.generate([decoding, prompt], [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), sp],
                       use_tqdm=False)[1]
    assert out.metrics.num_preemptions >= 1 and out.num_cached_tokens == 0
    ref = tiny_pair[1].generate([prompt], sp, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert out.prompt_logprobs[0] is None and all(e is not None for e in out.prompt_logprobs[1:])
    for got, want in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:]):  # prefilled in other chunks: float32
        assert got.keys() == want.keys()                                      # sums in another order (2e-6 seen)
        for t in want:
            assert abs(got[t].logprob - want[t].logprob) <= 1e-4 and got[t].rank == want[t].rank


def test_a_preempted_prompt_re_admitted_on_a_prefix_cached_since_is_scored_past_its_first_reuse(tiny_pair):
    """A request that reads the cache (skip_reading_prefix_cache=False) is preempted after one chunk of its prompt,
    while an older request has computed and cached more of that prompt. Re-admitted, it reuses no more than it had
    computed, so every position is scored and equals a cache-off run (it used to reuse the longer prefix, leaving the
    positions between its chunk and that prefix None, past its num_cached_tokens of 0)."""
    engine = LLMEngine("tiny-random", block_size=16, chunk_stride=32, max_num_seqs=3, max_model_len=160,
                       num_kv_blocks=15, num_linear_slots=7, max_num_batched_tokens=128, verbose=False)
    rng = np.random.default_rng(11)
    prompt = random_ids(rng, 130)
    greedy = dict(temperature=0.0, ignore_eos=True)
    sp = SamplingParams(max_tokens=1, prompt_logprobs=1, skip_reading_prefix_cache=False, **greedy)
    engine.add_request("decoding", random_ids(rng, 15), SamplingParams(max_tokens=30, **greedy))
    engine.step()
    # next step: the shorter request computes prompt[:64] (4 blocks), the scored one its first 32 tokens; the step
    # after, the decoding request needs a block and preempts the newest, the scored one, which is re-admitted at
    # once on the cached 64 tokens
    engine.add_request("shorter", prompt[:64], SamplingParams(max_tokens=30, **greedy))
    engine.add_request("scored", prompt, sp)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    out = done["scored"]
    assert out.metrics.num_preemptions == 1 and out.num_cached_tokens == 0
    ref = tiny_pair[1].generate([prompt], sp, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert out.prompt_logprobs[0] is None and all(e is not None for e in out.prompt_logprobs[1:])
    for got, want in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
        assert got.keys() == want.keys()
        for t in want:
            assert abs(got[t].logprob - want[t].logprob) <= 1e-4 and got[t].rank == want[t].rank


def test_prompt_logprobs_compile_only_their_own_variant():
    llm = LLM("tiny-random", block_size=16, chunk_stride=32, max_num_seqs=2, max_model_len=32, verbose=False)
    plain = 2 * 3 * 1                           # rows {1,2} x tokens {1,16,32} (up to max_model_len) x blocks {2}
    assert llm.engine.warm_up(prompt_logprobs=True) == plain + 2 * 2
    warm = llm.cache_stats()["compilations"]
    rng = np.random.default_rng(1)
    prompts = [random_ids(rng, n) for n in (5, 27, 17)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=1), use_tqdm=False)
    assert llm.cache_stats()["compilations"] == warm


def test_stop_strings_cut_the_text_and_free_the_request(tiny_pair):
    llm = tiny_pair[1]
    prompt = "The cache copies a checkpoint"
    base = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    text = base.outputs[0].text
    # a stop of ASCII characters from the middle of the text: random weights emit arbitrary bytes, and a replacement
    # character of an invalid byte sequence may only be final once the text ends (a stop holding one may match only
    # at the last token)
    start = next(i for i in range(3, len(text) - 4) if text[i].isascii())
    stop = text[start:start + 3]
    stop = stop[:next((j for j, c in enumerate(stop) if not c.isascii()), len(stop))]
    cut = text.find(stop)
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop, "\x00zz"]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    assert base.outputs[0].token_ids[:len(out.token_ids)] == out.token_ids and len(out.token_ids) < 24
    assert llm.cache_stats()["live_slots"] == 0 and llm.cache_stats()["num_running"] == 0
    # streamed through the step API, the visible text only grows and never shows what the stop takes back
    eng = llm.engine
    eng.add_request("s", prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=stop))
    seen = ""
    for _ in range(100):
        for o in eng.step():
            assert o.outputs[0].text.startswith(seen)
            seen = o.outputs[0].text
        if not eng.has_unfinished_requests():
            break
    assert seen == text[:cut]
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=[""])



def test_stop_strings_are_searched_for_in_the_new_text_only(tiny_pair):
    """Each step searches for the stop strings in the text its tokens added (and the few characters before it that a
    stop string may begin in), not in the whole text again: that made the search quadratic in the output length."""
    eng = tiny_pair[1].engine
    searched = []

    class Text(str):  # the text the stream returns, counting the characters each search covers
        def find(self, sub, start=0, *args):
            searched.append(len(self) - start)
            return super().find(sub, start, *args)

    stops = ["\x00\x01\x02", "\x03\x04"]
    eng.add_request("long", "The cache", SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, stop=stops))
    stream = eng._requests["long"].streams[0]
    add = stream.add
    stream.add = lambda ids: Text(add(ids))
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    out = outs[-1].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 200
    # per step and stop string: the new characters, a stop string's length before them, and a held-back character
    assert sum(searched) <= len(stops) * (len(out.text) + 200 * 4)


def test_a_whole_row_ranks_every_token_as_a_count_of_likelier_ones():
    """Ties share a rank; the rank is 1 + how many tokens are strictly likelier (what a top-k entry reports)."""
    rng = np.random.default_rng(5)
    row = np.log(rng.dirichlet(np.ones(300))).astype(np.float32)
    row[[7, 8, 9]] = row[3]  # a tie
    entries = dict(LogprobRow(row, lambda i: f"<{i}>"))
    assert len(entries) == 300 and entries[42].decoded_token == "<42>"
    for t, e in entries.items():
        assert e.rank == 1 + int((row > row[t]).sum()) and e.logprob == float(row[t])
    assert entries[7].rank == entries[3].rank == entries[9].rank
