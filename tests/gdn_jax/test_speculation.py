"""Speculative decoding with the MTP block, end to end: outputs are those of plain decoding (greedy token for token,
seeded sampling token for token and in distribution), with the prefix cache, mixed steps, forks and preemption; a
rejected draft never reaches a checkpoint."""

import dataclasses
import json
import shutil

import numpy as np
import pytest

from gdn_jax import LLM, LLMEngine, SamplingParams
from gdn_jax.model.weights import hf_tensors, load_model
from tests.gdn_jax.helpers import FIXTURE, random_ids

pytestmark = pytest.mark.compiled

SPEC = {"method": "mtp", "num_speculative_tokens": 2}
# (two rows and a budget of 32 tokens: few step shapes to compile)
KW = dict(block_size=16, chunk_stride=32, max_num_seqs=2, max_model_len=256, max_num_batched_tokens=32,
          verbose=False)


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def _workload(vocab: int):
    """Prompts sharing a 70-token prefix (prefix-cache hits), more prompts than rows (mixed steps), and two long ones
    of their own (two of them outgrow a small KV pool: preemption)."""
    rng = np.random.default_rng(5)
    system = [int(t) for t in rng.integers(3, vocab, 70)]
    return [{"prompt_token_ids": ([] if n > 100 else system) + [int(t) for t in rng.integers(3, vocab, n)]}
            for n in (9, 40, 3, 77, 20, 101, 102)]


@pytest.fixture(scope="module")
def tiny():
    """`tiny` without speculation or the prefix cache, and with both (its trained MTP block drafts well, so its
    verify rows both accept and reject) and so few KV blocks that decodes preempt each other: cache on with
    speculation against cache off without."""
    return (LLM("tiny", enable_prefix_caching=False, **KW),
            LLM("tiny", speculative_config=SPEC, num_kv_blocks=17, **KW))


def test_outputs_are_those_of_plain_decoding_greedy_seeded_and_forked(tiny):
    prompts = _workload(280)  # (tiny: byte ids below 288)
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=1)
    seeded = SamplingParams(temperature=0.9, top_k=40, seed=3, max_tokens=12, ignore_eos=True)
    forked = SamplingParams(temperature=0.9, n=3, seed=8, max_tokens=10, ignore_eos=True)
    runs, plans = [], []
    schedule = tiny[1].engine.scheduler.schedule
    tiny[1].engine.scheduler.schedule = lambda: (plans.append(plan := schedule()), plan)[1]
    for llm in tiny:
        f = _tokens(llm.generate(prompts[:1], forked, use_tqdm=False))  # (first: its fork point is not cached)
        g = llm.generate(prompts, greedy, use_tqdm=False)
        runs.append((g, _tokens(g), _tokens(llm.generate(prompts, seeded, use_tqdm=False)), f))
    (g0, *plain), (g1, *spec) = runs
    assert spec == plain
    for a, b in zip(g0, g1):  # the logprobs of the verify rows' positions are those of one-token steps
        np.testing.assert_allclose([lp[t].logprob for t, lp in zip(a.outputs[0].token_ids, a.outputs[0].logprobs)],
                                   [lp[t].logprob for t, lp in zip(b.outputs[0].token_ids, b.outputs[0].logprobs)],
                                   atol=1e-4)
    stats = tiny[1].cache_stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    assert sum(o.metrics.spec_draft_tokens for o in g1) > 0
    assert min(stats["hits"], stats["forks"], stats["preemptions"]) > 0, stats
    # mixed steps: prefill rows beside verify rows with drafts
    assert any(p is not None and p.is_mixed and any(r.draft_token_ids for r in p.decode_seqs) for p in plans)
    tiny[1].engine.scheduler.schedule = schedule


def test_every_other_sampling_setting_gives_what_plain_decoding_gives(tiny):
    """Prompt logprobs (their rows run the plain prefill step and draft nothing), a stop string (the text is cut
    where plain decoding cuts it), min_tokens (the ban at each verified position's own output index), penalties
    (their rows verify no drafts), logprobs at every kept position, and max_tokens inside a verify row's reach."""
    prompt = "The \"with\" statement is used to"
    cases = [SamplingParams(temperature=0.0, max_tokens=12, prompt_logprobs=2, logprobs=2),
             SamplingParams(temperature=0.0, max_tokens=40, stop=["the"]),
             SamplingParams(temperature=0.0, max_tokens=20, min_tokens=15, stop_token_ids=[32, 101]),
             SamplingParams(temperature=0.7, seed=4, max_tokens=16, repetition_penalty=1.3, presence_penalty=0.5),
             SamplingParams(temperature=0.0, max_tokens=5)]
    got = [[llm.generate([prompt], sp, use_tqdm=False)[0] for sp in cases] for llm in tiny]
    for (a, b), sp in zip(zip(*got), cases):
        assert (a.outputs[0].text, a.outputs[0].finish_reason) == (b.outputs[0].text, b.outputs[0].finish_reason), sp
        n = len(b.outputs[0].token_ids) if not sp.stop else len(a.outputs[0].token_ids)
        assert a.outputs[0].token_ids[:n] == b.outputs[0].token_ids[:n], sp
        if sp.logprobs:
            np.testing.assert_allclose([lp[t].logprob for t, lp in zip(a.outputs[0].token_ids, a.outputs[0].logprobs)],
                                       [lp[t].logprob for t, lp in zip(b.outputs[0].token_ids, b.outputs[0].logprobs)],
                                       atol=1e-4)
            assert [list(lp) for lp in a.outputs[0].logprobs] == [list(lp) for lp in b.outputs[0].logprobs]
        if sp.prompt_logprobs:
            np.testing.assert_allclose([lp[t].logprob for t, lp in zip(a.prompt_token_ids[1:], a.prompt_logprobs[1:])],
                                       [lp[t].logprob for t, lp in zip(b.prompt_token_ids[1:], b.prompt_logprobs[1:])],
                                       atol=1e-4)
    assert got[1][3].metrics.spec_draft_tokens == 0  # (penalties)
    assert got[1][1].metrics.spec_accepted_tokens > 0


def test_the_worker_refuses_a_draft_slot_that_the_step_reads_or_advances(tiny):
    engine = tiny[1].engine
    engine.add_request("r", "The \"import\" statement", SamplingParams(temperature=0.0, max_tokens=8))
    engine.step()
    engine.add_request("s", "A function definition defines", SamplingParams(temperature=0.0, max_tokens=8))
    plan = engine.scheduler.schedule()  # the new request's prefill beside the first one's verify row
    assert plan.is_mixed and len(plan.decode_seqs[0].draft_slots) == 2
    verify, prefill = plan.decode_seqs[0], plan.prefill_seqs[0]
    rest = verify.draft_slots[1:]
    try:
        for slots, culprit in (((verify.linear_op.linear_state_id, *rest), "read or advanced by this step"),
                               ((prefill.linear_op.linear_state_id, *rest), "by a prefill row of this mixed step"),
                               ((rest[0], *rest), "are the same")):
            bad = dataclasses.replace(plan, seqs=[prefill, dataclasses.replace(verify, draft_slots=slots)])
            with pytest.raises(ValueError, match=culprit):
                engine.worker.execute(bad)
    finally:
        engine.scheduler.redo_step(plan, pools_kept=True)  # (nothing ran)
        engine.abort_request(["r", "s"])


def _oracle(engine, want: dict[int, list[int]], step: list[int]):
    """Drafts the true continuation (`want`: seq_id -> the plain run's tokens), with the first draft wrong every
    third step and the second wrong every third step after it: every acceptance length happens."""
    sched, k = engine.scheduler, engine.config.num_speculative_tokens
    postprocess = sched.postprocess

    def with_oracle(plan, sampled, drafts=None):
        finished = postprocess(plan, sampled, drafts)
        step[0] += 1
        for seq in sched.running:
            done = len(seq.token_ids)
            d = list(want[seq.seq_id][done:done + k])
            if d and step[0] % 3 < len(d):
                d[step[0] % 3] = (d[step[0] % 3] + 1) % engine.cfg.vocab_size
            seq.draft_token_ids = d
        return finished

    sched.postprocess = with_oracle


def test_forced_rejections_never_leave_a_rejected_state_in_a_checkpoint():
    """tiny-random's random MTP block accepts almost nothing, so here the drafts come from the plain run (some made
    wrong). Every checkpoint left in the index holds the state of a committed prefix."""
    # the cache-equivalence fixtures' settings (tests/gdn_jax/test_engine_cache_equivalence.py): the same steps
    kw = dict(block_size=16, chunk_stride=32, max_num_seqs=4, max_model_len=256, verbose=False)
    prompts = [p["prompt_token_ids"][:n] for p, n in zip(_workload(500), (20, 33, 45))]  # (shared first 20)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = LLMEngine("tiny-random", **kw)
    spec = LLMEngine("tiny-random", speculative_config=SPEC, **kw)
    want, ids, step = {}, [], [0]
    _oracle(spec, want, step)
    for i, p in enumerate(prompts):
        plain.add_request(str(i), p, greedy)
        spec.add_request(str(i), p, greedy)
        ids.append(spec.seq_id_of(str(i)))
        want[ids[-1]] = p + _generate_alone(plain, str(i))
    got = {}
    while spec.has_unfinished_requests():
        got.update({o.request_id: o.outputs[0].token_ids for o in spec.step() if o.finished})
        spec.scheduler.check_invariants()
    assert [got[str(i)] for i in range(3)] == [want[ids[i]][len(p):] for i, p in enumerate(prompts)]
    stats = spec.cache_stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    # every checkpoint left in the index is one the plain engine keeps too (same hash: the same committed prefix),
    # with the same state
    mine, theirs = spec.scheduler.block_manager.linear.index.slot_of, plain.scheduler.block_manager.linear.index.slot_of
    assert len(mine) > 3
    for h, slot in mine.items():
        assert h in theirs, "a checkpoint of no prefix the plain run computed"
        for pool in ("ssm", "conv"):
            np.testing.assert_allclose(np.asarray(getattr(spec.worker.state, pool)[:, slot]),
                                       np.asarray(getattr(plain.worker.state, pool)[:, theirs[h]]), atol=2e-4,
                                       rtol=0, err_msg=f"checkpoint slot {slot}, {pool}")


def _generate_alone(engine, rid: str) -> list[int]:
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished and o.request_id == rid:
                return o.outputs[0].token_ids
    raise AssertionError(rid)


def test_sampling_keeps_the_distribution_and_each_seeds_tokens(tiny):
    """1,000 seeds of the first k + 1 = 3 tokens (top-k 3: 27 outcomes), with and without speculation on other seeds:
    a chi-square test of the two joint distributions; and each seed's tokens the same with speculation, batched
    and alone."""
    prompt = "The \"while\" statement is used for"
    n = 1000
    params = [SamplingParams(temperature=1.0, top_k=3, seed=s, max_tokens=3, ignore_eos=True) for s in range(2 * n)]
    plain, spec = tiny
    a = [tuple(o.outputs[0].token_ids) for o in plain.generate([prompt] * n, params[:n], use_tqdm=False)]
    b = [tuple(o.outputs[0].token_ids) for o in spec.generate([prompt] * n, params[n:], use_tqdm=False)]
    assert spec.cache_stats()["spec_accepted_tokens"] > 0
    cells = sorted(set(a) | set(b))
    table = np.array([[x.count(c) for c in cells] for x in (a, b)], float)
    table = table[:, table.sum(0) >= 10]  # (cells with few counts pooled out)
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    chi2, dof = ((table - expected) ** 2 / expected).sum(), table.shape[1] - 1
    assert 3 <= dof and chi2 < dof + 4.5 * np.sqrt(2 * dof), (chi2, dof)  # far beyond p = 0.001
    same = [tuple(o.outputs[0].token_ids) for o in spec.generate([prompt] * 8, params[:8], use_tqdm=False)]
    alone = [tuple(spec.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids) for p in params[:3]]
    assert same == a[:8] and alone == a[:3]


def test_a_transformers_checkpoint_given_an_mtp_layer_decodes_as_without_it(tmp_path):
    """tests/fixtures/hf_tiny (saved by transformers) with random `mtp.*` tensors added and the config's
    mtp_num_hidden_layers set: greedy tokens with speculation equal those without."""
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "with_mtp"
    shutil.copytree(FIXTURE, folder)
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config", config)
    text["mtp_num_hidden_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    cfg, _, params = load_model(str(folder), mtp=False)
    mtp_cfg = dataclasses.replace(cfg, mtp_num_hidden_layers=1)
    from gdn_jax.model.qwen35 import init_model
    _, random_params = init_model(mtp_cfg)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors.update({k: v for k, v in hf_tensors(mtp_cfg, random_params).items() if k.startswith("mtp.")})
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    rng = np.random.default_rng(2)
    prompts = [random_ids(rng, 9)]  # (one step shape of each kind: this model compiles its own)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = _tokens(LLM(str(folder), **KW).generate(prompts, greedy, use_tqdm=False))
    llm = LLM(str(folder), speculative_config=SPEC, **KW)
    assert _tokens(llm.generate(prompts, greedy, use_tqdm=False)) == want
    assert llm.cache_stats()["spec_draft_tokens"] > 0


def test_speculation_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="declares no MTP layers"):
        LLM(str(FIXTURE), speculative_config=SPEC, verbose=False)
    with pytest.raises(ValueError, match="not with deterministic=True"):
        LLM("tiny", speculative_config=SPEC, deterministic=True, verbose=False)
    with pytest.raises(ValueError, match="num_speculative_tokens must be an int in"):
        LLM("tiny", speculative_config={"method": "mtp", "num_speculative_tokens": 9}, verbose=False)
