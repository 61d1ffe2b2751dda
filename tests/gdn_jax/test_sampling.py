"""Sampling on device, logprobs, stop conditions and tokenizers."""

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn_jax import LLM, SamplingParams
from gdn_jax.sampling import MAX_LOGPROBS, sample
from gdn_jax.tokenizer import ByteTokenizer

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "hf_tiny"
sample_jit = jax.jit(sample)


def _keys(n, seed=0):
    return jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(seed), i))(jnp.arange(n))


def test_greedy_top_k_one_and_tiny_top_p_all_pick_the_argmax():
    logits = jax.random.normal(jax.random.PRNGKey(0), (6, 300)) * 3
    argmax = np.argmax(np.asarray(logits), -1)
    greedy, *_ = sample_jit(logits, jnp.zeros(6), jnp.zeros(6, jnp.int32), jnp.ones(6), _keys(6))
    topk1, *_ = sample_jit(logits, jnp.full(6, 2.0), jnp.ones(6, jnp.int32), jnp.ones(6), _keys(6))
    topp, *_ = sample_jit(logits, jnp.full(6, 2.0), jnp.zeros(6, jnp.int32), jnp.full(6, 1e-4), _keys(6))
    assert np.asarray(greedy).tolist() == np.asarray(topk1).tolist() == np.asarray(topp).tolist() == argmax.tolist()


def test_top_k_and_top_p_restrict_the_support():
    logits = jnp.tile(jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05])), (2000, 1))
    toks, *_ = sample_jit(logits, jnp.ones(2000), jnp.full(2000, 2, jnp.int32), jnp.ones(2000), _keys(2000))
    assert set(np.asarray(toks).tolist()) == {0, 1}
    toks, *_ = sample_jit(logits, jnp.ones(2000), jnp.zeros(2000, jnp.int32), jnp.full(2000, 0.85), _keys(2000, 1))
    assert set(np.asarray(toks).tolist()) == {0, 1, 2}  # 0.5 + 0.3 < 0.85 <= 0.95
    freq = np.bincount(np.asarray(toks), minlength=4) / 2000
    np.testing.assert_allclose(freq[:3], np.array([0.5, 0.3, 0.15]) / 0.95, atol=0.04)


def test_logprobs_are_log_softmax_and_sorted():
    logits = jax.random.normal(jax.random.PRNGKey(1), (3, 64))
    toks, chosen, top_ids, top_lp = sample_jit(logits, jnp.zeros(3), jnp.zeros(3, jnp.int32), jnp.ones(3), _keys(3))
    ref = jax.nn.log_softmax(logits, -1)
    np.testing.assert_allclose(np.asarray(chosen), np.asarray(ref.max(-1)), rtol=1e-6)
    assert top_ids.shape == (3, MAX_LOGPROBS) and np.all(np.diff(np.asarray(top_lp), axis=-1) <= 0)
    np.testing.assert_allclose(np.asarray(top_lp), np.take_along_axis(np.asarray(ref), np.asarray(top_ids), -1))


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-random", chunk_stride=32, max_num_seqs=4, max_model_len=128, verbose=False)


def test_engine_logprobs_max_tokens_and_stop_tokens(llm):
    prompt = list(range(10, 50))
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and entry[tok].rank == 1        # greedy: the chosen token is the top one
        assert len(entry) == 3 and sorted(e.rank for e in entry.values()) == [1, 2, 3]
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))
    stop = out.token_ids[2]
    again = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5, stop_token_ids=[stop],
                                                  ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert again.token_ids == out.token_ids[:3] and again.finish_reason == "stop"


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
