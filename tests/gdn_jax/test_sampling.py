"""The sampler against small numpy references: statistics of every filter, penalties, the min_tokens ban, ties and
boundaries; then logprobs, stop conditions and tokenizers through the engine.

The statistical tests are deterministic (fixed seeds): 20k draws of one row of logits, each draw at its own output
position of one seed, compared with the renormalised softmax over the allowed support by a chi-square test."""

import dataclasses
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from gdn_jax import LLM, SamplingParams
from gdn_jax.sampling import MAX_LOGPROBS, SamplingMetadata, _keys, first_argmax, process_logits, sample
from gdn_jax.tokenizer import ByteTokenizer
from scheduler import ScheduledSequence
from scheduler.sampling_params import MAX_TEMPERATURE

pytestmark = pytest.mark.model

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "hf_tiny"
N = 20_000
sample_jit = jax.jit(sample)
process_jit = jax.jit(process_logits)


def metadata(rows: int, width: int = 1, **fields) -> SamplingMetadata:
    """Padding metadata (greedy, no filters) with `fields` broadcast over the rows; sampling rows draw from seed
    1234 at output positions 0..rows-1 unless given."""
    md = SamplingMetadata.padding(rows, np.shape(fields["history"])[-1] if "history" in fields else width)
    base = dict(seeds=np.full(rows, 1234, np.uint32), positions=np.arange(rows, dtype=np.int32))
    base.update(fields)
    out = {}
    for name, value in base.items():
        like = getattr(md, name)
        out[name] = np.broadcast_to(np.asarray(value, like.dtype), like.shape).copy()
    return dataclasses.replace(md, **out)


# ---- numpy references -----------------------------------------------------------------------------------------
def ref_penalties(logits, history, prompt_lens, presence, frequency, repetition):
    x = np.array(logits, np.float64)
    for b in range(x.shape[0]):
        toks = [t for t in history[b] if t >= 0]
        out = toks[prompt_lens[b]:]
        seen = sorted(set(toks))
        x[b, seen] = np.where(x[b, seen] > 0, x[b, seen] / repetition[b], x[b, seen] * repetition[b])
        for t in set(out):
            x[b, t] -= frequency[b] * out.count(t) + presence[b]
    return x


def ref_distribution(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, probs=None):
    """The renormalised distribution over the allowed support (float64). `probs` overrides softmax(logits / T)
    with exact values, for boundaries that must fall exactly on a cumulative sum."""
    x = np.asarray(logits, np.float64) / temperature
    p = np.exp(x - x.max()) / np.exp(x - x.max()).sum() if probs is None else np.asarray(probs, np.float64)
    keep = p >= min_p * p.max()
    if top_k > 0:
        keep &= p >= np.sort(p)[::-1][top_k - 1]                       # ties at the k-th value stay
    if top_p < 1.0:
        q = np.where(keep, p, 0.0) / np.where(keep, p, 0.0).sum()
        desc = np.sort(q)[::-1]
        above = np.concatenate([[0.0], np.cumsum(desc)[:-1]])
        bar = desc[above < top_p][-1]                                  # least likely token still needed
        keep &= q >= bar                                               # ties with it stay
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def draw(logits, **fields) -> np.ndarray:
    """N draws from one row of logits: counts per token."""
    logits = jnp.tile(jnp.asarray(logits, jnp.float32), (N, 1))
    toks, *_ = sample_jit(logits, metadata(N, **fields))
    return np.bincount(np.asarray(toks), minlength=logits.shape[1])


def assert_matches(counts, expected):
    """No draw outside the support; chi-square p > 1e-3 with bins of expected count < 5 pooled."""
    support = expected > 0
    assert counts[~support].sum() == 0, f"tokens outside the support drawn: {np.nonzero(counts * ~support)[0]}"
    exp = expected[support] * counts.sum()
    obs = counts[support]
    small = exp < 5
    if small.any():
        exp = np.append(exp[~small], exp[small].sum())
        obs = np.append(obs[~small], obs[small].sum())
    if len(exp) < 2:
        return
    p = stats.chisquare(obs, exp).pvalue
    assert p > 1e-3, f"chi-square p = {p:.2e}: observed {obs.tolist()} expected {np.round(exp, 1).tolist()}"


LOGITS = np.array([2.0, 1.6, 1.3, 1.1, 0.9, 0.5, 0.2, 0.0, -0.4, -0.9, -1.5, -2.5], np.float32)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("knob", [{}, dict(top_k=4), dict(top_p=0.7), dict(min_p=0.2),
                                  dict(top_k=6, top_p=0.8, min_p=0.05)])
def test_frequencies_follow_the_renormalised_softmax(temperature, knob):
    expected = ref_distribution(LOGITS, temperature, **knob)
    if "top_p" in knob:  # the chosen top_p is no boundary case: the support is the same a little either side
        for eps in (-1e-3, 1e-3):
            assert (ref_distribution(LOGITS, temperature, **{**knob, "top_p": knob["top_p"] + eps}) > 0).tolist() \
                == (expected > 0).tolist()
    if knob:
        assert 0 < (expected > 0).sum() < len(LOGITS)  # the filter really cuts
    assert_matches(draw(LOGITS, temperature=temperature, **knob), expected)


def test_each_row_follows_its_own_settings_in_a_mixed_batch():
    """Four settings share one step (one row in four each): the sort-based filters of some rows must not leak
    into the others."""
    groups = [dict(temperature=0.5), dict(temperature=2.0, top_k=3), dict(temperature=1.0, top_p=0.6, min_p=0.1),
              dict(temperature=0.0)]
    fields = {name: np.array([g.get(name, default) for _ in range(N // 4) for g in groups])
              for name, default in (("temperature", 0.0), ("top_k", 0), ("top_p", 1.0), ("min_p", 0.0))}
    toks, *_ = sample_jit(jnp.tile(jnp.asarray(LOGITS), (N, 1)), metadata(N, **fields))
    toks = np.asarray(toks).reshape(-1, 4)
    for g, group in enumerate(groups):
        counts = np.bincount(toks[:, g], minlength=len(LOGITS))
        if group["temperature"] == 0.0:
            assert counts[0] == N // 4
        else:
            assert_matches(counts, ref_distribution(LOGITS, **group))


def test_ties_at_the_kth_value_are_all_kept():
    logits = np.array([3.0, 2.0, 1.0, 1.0, 1.0, 0.5, 0.0, -1.0], np.float32)
    expected = ref_distribution(logits, top_k=3)
    assert np.nonzero(expected)[0].tolist() == [0, 1, 2, 3, 4]      # k = 3, but the 3rd value is shared by three
    counts = draw(logits, temperature=1.0, top_k=3)
    assert (counts[2:5] > 0).all()
    assert_matches(counts, expected)


@pytest.mark.parametrize("top_p, support", [(0.75, [0, 1]), (0.875, [0, 1, 2]), (0.751, [0, 1, 2]),
                                            (0.5, [0]), (0.9375, [0, 1, 2, 3]), (0.97, [0, 1, 2, 3, 4, 5])])
def test_top_p_boundary_exactly_on_a_cumulative_sum(top_p, support):
    """Mass 1/2, 1/4, 1/8, ...: top_p = 0.75 is reached exactly by the first two tokens, so the third is out."""
    probs = np.array([1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 32])
    expected = ref_distribution(None, top_p=top_p, probs=probs)
    assert np.nonzero(expected)[0].tolist() == support
    assert_matches(draw(np.log(probs).astype(np.float32), temperature=1.0, top_p=top_p), expected)


def test_ties_at_the_top_p_cut_are_kept_together():
    probs = np.array([1 / 2, 1 / 8, 1 / 8, 1 / 8, 1 / 8])
    expected = ref_distribution(None, top_p=0.55, probs=probs)        # needs one 1/8 token; all four tie
    assert (expected > 0).all()
    assert_matches(draw(np.log(probs).astype(np.float32), temperature=1.0, top_p=0.55), expected)


def test_penalties_and_min_tokens_ban_match_the_numpy_reference():
    rng = np.random.default_rng(3)
    B, V, W = 6, 40, 24
    logits = rng.normal(0, 2, (B, V)).astype(np.float32)
    history = np.full((B, W), -1, np.int32)
    prompt_lens = rng.integers(0, 10, B).astype(np.int32)
    for b in range(B):
        n = int(rng.integers(prompt_lens[b], W + 1))
        history[b, :n] = rng.integers(0, 12, n)                         # few distinct ids: many repeats
    presence, frequency = rng.uniform(-2, 2, B).astype(np.float32), rng.uniform(-2, 2, B).astype(np.float32)
    repetition = rng.uniform(0.5, 2.0, B).astype(np.float32)
    presence[0], frequency[0], repetition[0] = 0.0, 0.0, 1.0           # a row without penalties
    banned = np.full((B, SamplingMetadata.padding(1, 1).banned.shape[1]), -1, np.int32)
    banned[2, :3] = [5, 39, 0]
    md = metadata(B, W, history=history, prompt_lens=prompt_lens, presence_penalty=presence,
                  frequency_penalty=frequency, repetition_penalty=repetition, banned=banned)
    got = np.asarray(process_jit(jnp.asarray(logits), md))
    ref = ref_penalties(logits, history, prompt_lens, presence, frequency, repetition)
    ref[2, [5, 39, 0]] = -np.inf
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[0], logits[0])
    # greedy follows the processed logits, not the raw ones
    toks, *_ = sample_jit(jnp.asarray(logits), md)
    assert np.asarray(toks).tolist() == np.argmax(ref, -1).tolist()


def test_sampling_with_penalties_follows_the_penalised_softmax():
    logits = LOGITS[:8]
    history = np.array([0, 1, 1, 2, 0, 0, 3, -1, -1, -1], np.int32)     # prompt [0, 1, 1], output [2, 0, 0, 3]
    kw = dict(presence_penalty=0.3, frequency_penalty=0.2, repetition_penalty=1.4)
    ref = ref_penalties(logits[None], history[None], [3], *([v] for v in kw.values()))[0]
    counts = draw(logits, temperature=1.0, history=history, prompt_lens=3, **kw)
    assert_matches(counts, ref_distribution(ref))


def test_min_tokens_ban_holds_under_sampling_and_greedy():
    banned = np.full(SamplingMetadata.padding(1, 1).banned.shape[1], -1, np.int32)
    banned[:2] = [0, 3]
    counts = draw(LOGITS, temperature=2.0, banned=banned)
    expected = ref_distribution(np.where(np.isin(np.arange(12), [0, 3]), -np.inf, LOGITS), 2.0)
    assert_matches(counts, expected)
    toks, *_ = sample_jit(jnp.asarray(LOGITS)[None], metadata(1, banned=banned))
    assert int(toks[0]) == 1


def test_greedy_top_k_one_tiny_top_p_and_tiny_temperature_all_pick_the_argmax():
    logits = jax.random.normal(jax.random.PRNGKey(0), (6, 300)) * 3
    argmax = np.argmax(np.asarray(logits), -1).tolist()
    # a top_p whose product with the total mass underflows float32 (1e-38, 1e-45) keeps the top token too; the
    # largest temperature SamplingParams takes keeps the tokens' order for top-k
    for fields in (dict(temperature=0.0), dict(temperature=2.0, top_k=1), dict(temperature=2.0, top_p=1e-4),
                   dict(temperature=2.0, top_p=1e-38), dict(temperature=2.0, top_p=1e-45),
                   dict(temperature=MAX_TEMPERATURE, top_k=1), dict(temperature=1e-6),
                   dict(temperature=1.0, min_p=1.0)):
        toks, *_ = sample_jit(logits, metadata(6, **fields))
        assert np.asarray(toks).tolist() == argmax, fields


def test_first_argmax_is_jnp_argmax_with_ties_infinities_and_nans():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((9, 300)).astype(np.float32)
    x[0, [17, 5, 250]] = 9.0                     # ties: the first index wins
    x[1, [40, 41]] = np.nan                      # NaN counts as the largest, first NaN wins
    x[2] = -np.inf                               # all -inf: index 0
    x[3, 299] = np.inf
    x[4, [0, 299]] = 7.0
    x[5] = 0.0                                   # all equal
    x[6, 123] = np.nan
    x[6, 12] = np.inf
    got = np.asarray(jax.jit(first_argmax)(x))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    assert got.dtype == np.int32 and got[:7].tolist() == [5, 40, 0, 299, 0, 0, 123]
    # rows as wide as a vocabulary: there XLA's CPU library reduces the maximum without propagating NaN (the max of
    # a row holding one comes back finite), so a NaN must be looked for on its own
    wide = rng.standard_normal((3, 65536)).astype(np.float32)
    wide[0, 40000] = np.nan
    wide[1, [5, 7]] = [np.nan, np.inf]
    assert np.asarray(jax.jit(first_argmax)(wide)).tolist()[:2] == [40000, 5]


def test_draws_are_jax_random_categorical_token_for_token():
    """The draw's Gumbel-max form keeps the tokens of `jax.random.categorical` with the same keys: a seeded request
    samples what it sampled before the form changed."""
    rng = np.random.default_rng(4)
    logits = (rng.standard_normal((64, 257)) * 3).astype(np.float32)
    md = metadata(64, temperature=0.8, seeds=rng.integers(0, 2**31, 64), positions=rng.integers(0, 500, 64))
    toks = np.asarray(sample_jit(jnp.asarray(logits), md)[0])
    keys = _keys(jnp.asarray(md.seeds), jnp.asarray(md.positions))
    want = np.asarray(jax.vmap(jax.random.categorical)(keys, jnp.asarray(logits) / 0.8))
    np.testing.assert_array_equal(toks, want)
    assert len(set(toks.tolist())) > 20            # real draws, not one token


def test_top_k_above_the_vocabulary_is_off():
    logits = jnp.tile(jnp.asarray(LOGITS), (64, 1))
    wide = sample_jit(logits, metadata(64, temperature=1.0, top_k=10 ** 6))[0]
    off = sample_jit(logits, metadata(64, temperature=1.0))[0]
    assert np.asarray(wide).tolist() == np.asarray(off).tolist() and len(set(np.asarray(off).tolist())) > 4


def test_logprobs_are_log_softmax_and_sorted():
    logits = jax.random.normal(jax.random.PRNGKey(1), (3, 64))
    toks, chosen, top_ids, top_lp, rank = sample_jit(logits, metadata(3, num_logprobs=MAX_LOGPROBS))
    ref = jax.nn.log_softmax(logits, -1)
    np.testing.assert_allclose(np.asarray(chosen), np.asarray(ref.max(-1)), rtol=1e-6)
    assert np.asarray(rank).tolist() == [1, 1, 1]  # greedy: the likeliest token
    assert top_ids.shape == (3, MAX_LOGPROBS) and np.all(np.diff(np.asarray(top_lp), axis=-1) <= 0)
    np.testing.assert_allclose(np.asarray(top_lp), np.take_along_axis(np.asarray(ref), np.asarray(top_ids), -1))


def test_a_drawn_token_is_ranked_over_the_whole_vocabulary():
    """The rank of a sampled token counts every likelier token, not only those of the top MAX_LOGPROBS."""
    logits = jax.random.normal(jax.random.PRNGKey(2), (64, 400)) * 0.1  # nearly flat: draws land far down
    toks, chosen, _, _, rank = sample_jit(logits, metadata(64, temperature=1.0, num_logprobs=0))
    ref = np.asarray(jax.nn.log_softmax(logits, -1))
    toks, rank = np.asarray(toks), np.asarray(rank)
    want = 1 + (ref > ref[np.arange(64), toks][:, None]).sum(-1)
    assert rank.tolist() == want.tolist() and rank.max() > 100


def test_top_entries_and_ranks_are_computed_only_when_a_row_asks_for_logprobs():
    """A step in which no row asks for logprobs skips the top-k and the ranks (zeros); the tokens and the chosen
    logprobs are those of the same step with a row that asks, and one row asking (even for 0 top entries) gives every
    row its top entries and rank."""
    logits = jax.random.normal(jax.random.PRNGKey(3), (4, 300))
    ref = np.asarray(jax.nn.log_softmax(logits, -1))
    fields = dict(temperature=np.array([0.0, 1.0, 0.7, 0.0], np.float32))
    none = sample_jit(logits, metadata(4, **fields))
    assert not np.asarray(none[2]).any() and not np.asarray(none[3]).any() and not np.asarray(none[4]).any()
    for asked in ([-1, 0, -1, -1], [-1, -1, -1, 5]):
        some = sample_jit(logits, metadata(4, num_logprobs=np.array(asked, np.int32), **fields))
        for a, b in zip(none[:2], some[:2]):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        toks, chosen, top_ids, top_lp, rank = map(np.asarray, some)
        assert rank.tolist() == (1 + (ref > ref[np.arange(4), toks][:, None]).sum(-1)).tolist()
        assert (top_ids == np.argsort(-ref, axis=-1, kind="stable")[:, :MAX_LOGPROBS]).all()
        np.testing.assert_allclose(top_lp, np.take_along_axis(ref, top_ids, -1), rtol=1e-6)
    rows = [ScheduledSequence(seq_id=i, token_ids=[5], start_pos=0, block_table=[1], slot_mapping=[16],
                              linear_op=None, sample=True, sampling_params=SamplingParams(logprobs=k), num_generated=0)
            for i, k in enumerate((None, 3, 0))]
    md = SamplingMetadata.from_rows(rows, 4, 8, 300, (1,), 0)
    assert md.num_logprobs.tolist() == [-1, 3, 0, -1]


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-random", chunk_stride=32, max_num_seqs=4, max_model_len=128, verbose=False)


def test_max_tokens_none_generates_until_max_model_len(llm):
    """vLLM's max_tokens=None: the output runs until prompt + output fill max_model_len (128)."""
    out = llm.generate([list(range(10, 110))], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 28 and out.finish_reason == "length"


def test_engine_logprobs_max_tokens_and_stop_tokens(llm):
    prompt = list(range(10, 50))
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and entry[tok].rank == 1        # greedy: the chosen token is the top one
        assert len(entry) == 3 and sorted(e.rank for e in entry.values()) == [1, 2, 3]
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))
    # without logprobs neither (vLLM's CompletionOutput)
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert plain.token_ids == out.token_ids and plain.logprobs is None and plain.cumulative_logprob is None
    stop = out.token_ids[2]
    again = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5, stop_token_ids=[stop],
                                                  ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert again.token_ids == out.token_ids[:3] and again.finish_reason == "stop"
    # the stop token's text is left out (vLLM's way) and it is the stop_reason; its logprob stays in `logprobs`
    assert again.text == llm.engine.tokenizer.decode(out.token_ids[:2]) and again.stop_reason == stop


def test_engine_ranks_drawn_tokens_as_scoring_them_does(llm):
    """A drawn token's rank in `logprobs` is its rank in the whole distribution: the same as scoring the output as a
    prompt gives (whole rows), also far below the top 20."""
    prompt = list(range(10, 50))
    out = llm.generate([prompt], SamplingParams(temperature=50.0, seed=3, max_tokens=8, logprobs=1, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    scored = llm.generate([prompt + out.token_ids], SamplingParams(max_tokens=1, prompt_logprobs=-1),
                          use_tqdm=False)[0].prompt_logprobs[len(prompt):]
    ranks = [entry[t].rank for t, entry in zip(out.token_ids, out.logprobs)]
    assert ranks == [row[t].rank for t, row in zip(out.token_ids, scored)] and max(ranks) > 21


def test_byte_tokenizer_round_trips_text_and_engine_accepts_text(llm):
    tok = ByteTokenizer(512)
    text = "prefix caching, état récurrent ✓"
    assert tok.decode(tok.encode(text)) == text
    out = llm.generate("hello world", SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)[0]
    assert out.prompt == "hello world" and out.prompt_token_ids == tok.encode("hello world")
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)


def test_model_folder_tokenizer_json_is_used(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>", "the", "cache", "restores", "state"])}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path / "m"
    shutil.copytree(FIXTURE, folder)
    t.save(str(folder / "tokenizer.json"))
    llm = LLM(str(folder), max_model_len=64, max_num_seqs=2, verbose=False)
    out = llm.generate("the cache restores state", SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[0]
    assert out.prompt_token_ids == [2, 3, 4, 5]


def test_text_shown_before_the_end_is_never_taken_back_with_byte_fallback_tokens(tmp_path, monkeypatch):
    """A SentencePiece tokenizer reads a run of byte-fallback tokens whole, so a character it read (the emoji) turns
    into replacement characters when a further byte leaves the run invalid. The text of an unfinished output shows
    only what later tokens cannot change: every output's text begins the final one, so streamed deltas join to it."""
    from tests.gdn_jax.test_text_stream import _sentencepiece_tokenizer

    folder = tmp_path / "m"
    shutil.copytree(FIXTURE, folder)
    tok = _sentencepiece_tokenizer(folder)
    e = tok.encode("é")[-1]
    script = [e, *(3 + b for b in "😀".encode()), 3 + 0xF0, e]
    llm = LLM(str(folder), max_model_len=64, max_num_seqs=2, verbose=False)
    real = llm.engine.worker.execute

    def scripted(plan, *args, **kwargs):  # the model's tokens replaced by the script's, in order
        result = real(plan, *args, **kwargs)
        tokens = result.tokens.copy()
        for row, s in enumerate(plan.seqs):
            if s.sample:
                tokens[row] = script[llm.engine._by_seq[s.seq_id].seq.num_generated]
        return dataclasses.replace(result, tokens=tokens)

    monkeypatch.setattr(llm.engine.worker, "execute", scripted)
    llm.engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=len(script), ignore_eos=True))
    texts = [o.outputs[0].text for _ in range(20) for o in llm.engine.step()]
    assert texts[-1] == tok.decode(script) == "é" + "\ufffd" * 5 + "é"
    assert all(texts[-1].startswith(t) for t in texts), texts


def test_logprobs_show_a_special_tokens_text_as_vllm_does(tmp_path):
    """A logprob's decoded_token is the id's text alone with special tokens kept (vLLM decodes each id with the
    tokenizer's default, skip_special_tokens=False): "</s>", not "" (two special tokens in the completions API's
    top_logprobs, keyed by that text, were one entry). The output text still leaves special tokens out."""
    from tests.gdn_jax.test_text_stream import _sentencepiece_tokenizer

    folder = tmp_path / "m"
    shutil.copytree(FIXTURE, folder)
    tok = _sentencepiece_tokenizer(folder)
    llm = LLM(str(folder), max_model_len=64, max_num_seqs=2, verbose=False)
    prompt = [5, 2, 1, 3 + ord("A"), 1]
    for k in (0, -1):  # the prompt token's entry; whole rows
        out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=k), use_tqdm=False)[0]
        assert [entry[t].decoded_token for t, entry in zip(prompt[1:], out.prompt_logprobs[1:])] == [
            "</s>", "<s>", "A", "<s>"]
    assert tok.decode(prompt) == "\x02A" and tok.token_bytes(2) == b"</s>"


@pytest.mark.parametrize("listed_in", ["generation_config.json", "config.json"])
def test_every_end_of_sequence_id_a_model_lists_ends_a_request(tmp_path, listed_in):
    """A chat model's config.json may name one EOS (Qwen3.5: <|endoftext|>) while its generation_config.json lists the
    end-of-turn token too (<|im_end|>), and some models list several in config.json: every id listed ends a request,
    as with transformers' generate and vLLM (the others as stop tokens: the stop_reason, their text left out), unless
    ignore_eos; with min_tokens not before (and not during min_tokens under ignore_eos either)."""
    import json
    folder = tmp_path / "m"
    shutil.copytree(FIXTURE, folder)
    kw = dict(max_model_len=64, max_num_seqs=2, verbose=False)
    greedy = dict(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompt = list(range(40, 60))
    ids = LLM(str(folder), **kw).generate([prompt], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0].token_ids
    j = next(j for j in range(2, 16) if ids[j] not in ids[:j] and ids[j] != 1)
    if listed_in == "config.json":
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": [1, ids[j]]}))
    else:
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, ids[j]], "temperature": 0.7}))
    llm = LLM(str(folder), **kw)
    assert llm.engine.cfg.eos_token_id == 1
    out = llm.generate([prompt], SamplingParams(**{**greedy, "ignore_eos": False}), use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (ids[:j + 1], "stop", ids[j])
    assert out.text == llm.get_tokenizer().decode(ids[:j])
    again = llm.generate([prompt], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    assert again.token_ids == ids and again.finish_reason == "length"
    held = SamplingParams(**{**greedy, "ignore_eos": False, "min_tokens": j + 1})  # banned as EOS is, until then
    assert llm.generate([prompt], held, use_tqdm=False)[0].outputs[0].token_ids[j] != ids[j]
    # under ignore_eos too (vLLM bans every end-of-sequence id during min_tokens whatever ignore_eos says)
    ignoring = llm.generate([prompt], SamplingParams(**greedy, min_tokens=j + 1), use_tqdm=False)[0].outputs[0]
    assert ignoring.token_ids[:j] == ids[:j] and ignoring.token_ids[j] != ids[j]
    assert len(ignoring.token_ids) == 16 and ignoring.finish_reason == "length"


def test_a_models_recommended_sampling_is_what_a_request_given_none_gets(tmp_path):
    """vLLM's generation_config="auto": a request without SamplingParams takes the sampling fields of the folder's
    generation_config.json (those that differ from transformers' defaults; max_new_tokens as max_tokens)."""
    import json

    from gdn_jax.engine.input_processor import model_sampling_defaults
    folder = tmp_path / "m"
    shutil.copytree(FIXTURE, folder)
    assert model_sampling_defaults(folder) == {}
    (folder / "generation_config.json").write_text(json.dumps({
        "do_sample": True, "temperature": 0.0, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.0,
        "max_new_tokens": 5, "eos_token_id": 1}))
    assert model_sampling_defaults(folder) == {"temperature": 0.0, "top_k": 20, "top_p": 0.95, "max_tokens": 5}
    kw = dict(max_model_len=64, max_num_seqs=2, verbose=False)
    llm = LLM(str(folder), **kw)
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.top_k, d.top_p, d.max_tokens, d.repetition_penalty) == (0.0, 20, 0.95, 5, 1.0)
    prompt = list(range(40, 60))
    explicit = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    want = llm.generate([prompt], explicit, use_tqdm=False)[0].outputs[0].token_ids
    got = llm.generate([prompt], use_tqdm=False)[0].outputs[0].token_ids  # greedy, 5 tokens (unless EOS: the same)
    assert got == want[:len(got)] and (len(got) == 5 or got[-1] == 1)
    assert LLM(str(folder), generation_config="vllm", **kw).get_default_sampling_params() == SamplingParams()
    (folder / "generation_config.json").write_text(json.dumps({"top_p": 2}))
    with pytest.raises(ValueError, match=r"generation_config.json: top_p"):
        model_sampling_defaults(folder)
    with pytest.raises(ValueError, match="generation_config must be one of"):
        LLM(str(folder), generation_config="model", **kw)


def test_end_of_sequence_ids_are_read_from_every_place_a_folder_lists_them(tmp_path):
    import json

    from gdn_jax.engine.input_processor import model_eos_ids
    assert model_eos_ids(None) == [] and model_eos_ids(tmp_path) == []
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": {"eos_token_id": [5, 6]},
                                                      "eos_token_id": 7}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [6, 8]}))
    assert model_eos_ids(tmp_path) == [5, 6, 7, 8]
    assert model_eos_ids(tmp_path, vocab_size=9) == [5, 6, 7, 8]
    with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id \[6, 8\] is outside the vocabulary "
                                         r"\[0, 8\)"):
        model_eos_ids(tmp_path, vocab_size=8)  # the model could never end on 8
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [6, "9"]}))
    with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id must be a token id.*'9'"):
        model_eos_ids(tmp_path)


def test_min_tokens_holds_off_stop_strings_as_it_does_stop_tokens(llm):
    """vLLM's rule: no stop string is looked for in the text of the first min_tokens tokens. The stop string here
    occurs in that text and again after it."""
    prompt, greedy = list(range(140, 180)), dict(temperature=0.0, max_tokens=60, ignore_eos=True)
    base = llm.generate([prompt], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    protected = len(llm.engine.tokenizer.decode(base.token_ids[:12]))
    stop = next(c for c in base.text[1:protected] if c != "\ufffd" and base.text.find(c, protected) >= 0)
    early = llm.generate([prompt], SamplingParams(**greedy, stop=stop), use_tqdm=False)[0].outputs[0]
    assert early.text == base.text[:base.text.find(stop)] and len(early.token_ids) < 12
    held = llm.generate([prompt], SamplingParams(**greedy, stop=stop, min_tokens=12), use_tqdm=False)[0].outputs[0]
    assert held.text == base.text[:base.text.find(stop, protected)] and held.finish_reason == "stop"
    assert held.stop_reason == stop and len(held.token_ids) > 12


def test_an_interrupted_generate_leaves_nothing_running(llm, monkeypatch):
    real, calls = llm.engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real()

    monkeypatch.setattr(llm.engine, "step", step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([list(range(10, 50))] * 3, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                     use_tqdm=False)
    monkeypatch.undo()
    stats = llm.cache_stats()
    assert not llm.engine.has_unfinished_requests() and stats["live_slots"] == 0
    assert stats["kv_blocks_free"] == llm.engine.memory.num_kv_blocks - 1
    out = llm.generate([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 2


def test_generate_skips_ids_the_caller_gave_its_own_requests(llm):
    taken = str(next(llm._ids) + 1)  # the id generate would give its first prompt
    llm.engine.add_request(taken, [5, 6, 7], SamplingParams(max_tokens=1), arrival_time=0.0)
    outs = llm.generate([[8, 9], [10, 11]], (SamplingParams(max_tokens=1), SamplingParams(max_tokens=2)),
                        use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [[8, 9], [10, 11]] and taken not in [o.request_id for o in outs]
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2] and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("prompts, message", [(None, "prompts must be"), (5, "prompts must be"),
                                              (b"abc", "prompts must be"), ([[True, False]], "must be ints"),
                                              ([np.array([5.0, 6.0])], "must be ints")])
def test_prompts_of_the_wrong_type_are_named(llm, prompts, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)


@pytest.mark.parametrize("fields", [dict(temperature=1.0), dict(temperature=1.0, top_p=0.9, top_k=5),
                                    dict(temperature=2e-5), dict()])
def test_an_extreme_repetition_penalty_keeps_the_draw_among_the_seen_tokens(fields):
    """The smallest penalty SamplingParams accepts divides a positive logit past float32's range: the seen tokens
    with positive logits are then the only candidates (the limit of the penalty), never the padding id 0 that a NaN
    in the filters used to give."""
    logits = np.full((4, 40), -1.0, np.float32)
    logits[:, [7, 9, 11]] = [0.5, 10.0, 1.0]
    history = np.full((4, 6), -1, np.int32)
    history[:, :3] = [7, 9, 20]                                       # 11 is likelier than 7 but never seen
    rep = SamplingParams(repetition_penalty=1.2e-38).repetition_penalty
    md = metadata(4, 6, history=history, prompt_lens=np.full(4, 3, np.int32), repetition_penalty=rep, **fields)
    toks = np.asarray(sample_jit(jnp.asarray(logits), md)[0])
    assert set(toks.tolist()) <= {7, 9}


@pytest.fixture(scope="module")
def tiny():
    """The trained byte-level model: its greedy text is ASCII, one character per token."""
    return LLM("tiny", chunk_stride=32, max_num_seqs=4, max_model_len=128, verbose=False)


def test_min_tokens_stop_strings_follow_vllms_window(tiny):
    """vLLM looks for stop strings once more than min_tokens tokens are out, and a stop counts when it ends after the
    text of the first min_tokens tokens (it may begin inside it). So a stop in the text of token min_tokens - 1 is
    not found there, while a stop that straddles the end of the protected text is."""
    prompt, greedy = "The with statement", dict(temperature=0.0, max_tokens=40, ignore_eos=True)
    base = tiny.generate(prompt, SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    text = base.text
    assert len(text) == len(base.token_ids) == 40  # one character per token
    m = next(m for m in range(3, 30) if text[m - 1] not in text[:m - 1] and text.find(text[m - 1], m) >= 0)
    inside = tiny.generate(prompt, SamplingParams(**greedy, stop=text[m - 1], min_tokens=m),
                           use_tqdm=False)[0].outputs[0]
    cut = text.find(text[m - 1], m)
    assert (inside.text, inside.finish_reason, len(inside.token_ids)) == (text[:cut], "stop", cut + 1)
    for m in (5, 12):
        stop = text[m - 2:m + 1]  # the last two characters of the protected text and the next one
        across = tiny.generate(prompt, SamplingParams(**greedy, stop=stop, min_tokens=m),
                               use_tqdm=False)[0].outputs[0]
        assert (across.text, across.stop_reason, len(across.token_ids)) == (text[:m - 2], stop, m + 1)


def test_include_stop_str_in_output_keeps_the_stop_string_and_the_stop_tokens_text(tiny):
    """vLLM's include_stop_str_in_output: the text is cut after the stop string instead of before it, and a stop
    token's text stays; the tokens generated are the same either way."""
    prompt, greedy = "The with statement", dict(temperature=0.0, max_tokens=40, ignore_eos=True)
    base = tiny.generate(prompt, SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    text, ids = base.text, base.token_ids
    stop = text[6:9]
    cut = text.find(stop)
    outs = [tiny.generate(prompt, SamplingParams(**greedy, stop=stop, include_stop_str_in_output=include),
                          use_tqdm=False)[0].outputs[0] for include in (False, True)]
    assert [o.text for o in outs] == [text[:cut], text[:cut + len(stop)]]
    assert [o.stop_reason for o in outs] == [stop, stop] and outs[0].token_ids == outs[1].token_ids
    j = next(j for j in range(2, 40) if ids[j] not in ids[:j])
    outs = [tiny.generate(prompt, SamplingParams(**greedy, stop_token_ids=[ids[j]], include_stop_str_in_output=inc),
                          use_tqdm=False)[0].outputs[0] for inc in (False, True)]
    assert [o.text for o in outs] == [text[:j], text[:j + 1]] and outs[1].token_ids == ids[:j + 1]
    assert outs[1].stop_reason == ids[j] and outs[1].finish_reason == "stop"
    with pytest.raises(ValueError, match="include_stop_str_in_output"):
        SamplingParams(include_stop_str_in_output=1)
