"""Cache on == cache off: identical greedy tokens and logprobs, serial and concurrent, with real reuse."""

import dataclasses
import functools

import numpy as np
import pytest

import gdn_jax.worker.worker as worker_mod
from gdn_jax import LLM, LLMEngine, SamplingParams
from gdn_jax.backends.cpu import kernels as cpu_kernels, tuning
from gdn_jax.model import dense, qwen35
from gdn_jax.config import FULL, LINEAR, get_preset
from tests.gdn_jax.helpers import random_ids

pytestmark = pytest.mark.engine

STRIDE = 32
ENGINE_KW = dict(block_size=16, chunk_stride=STRIDE, max_num_seqs=4, max_model_len=256, verbose=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1, ignore_eos=True)


def _workload():
    rng = np.random.default_rng(7)
    system = random_ids(rng, 70)
    p1 = system + random_ids(rng, 10)                # 80: shares 70 with the next ones
    return {
        "p1": p1,
        "p2_sys_other": system + random_ids(rng, 30),  # checkpoints at 32, 64 below the shared 70
        "p3_repeat": list(p1),                   # identical repeat
        "p4_unrelated": random_ids(rng, 50),
        "p5_one_past": system[:64] + random_ids(rng, 1),  # one token past the 64 checkpoint
        "p6_exact": system[:64],                 # exactly two chunks: cannot reuse its own tail boundary
        "p7_continue": p1 + random_ids(rng, 45),       # continuation past the end of p1 (reaches 96, 128 later)
    }


def _expected_reuse(prompt, earlier_computed):
    """Deepest multiple of STRIDE <= min(common prefix with an earlier sequence's computed tokens, len - 1)."""
    best = 0
    for toks in earlier_computed:
        lcp = 0
        for a, b in zip(prompt, toks):
            if a != b:
                break
            lcp += 1
        best = max(best, min(lcp, len(prompt) - 1) // STRIDE * STRIDE)
    return best


def _summary(out):
    c = out.outputs[0]
    return c.token_ids, np.array([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])


# the cache-on engine split over 2 and 4 devices (tensor parallelism; the "mesh" group of `make test` runs these
# with 8 host devices), against the same one-device cache-off engine
MESH = [pytest.param("scan-auto-2", marks=pytest.mark.mesh)]  # (the serial and random-workload tests)


@pytest.fixture(scope="module", params=["scan", "promote", "scan-parallel", "scan-async"])
def engines(request):
    """Cache on (in both checkpoint modes) and cache off. "scan-parallel": the cache-on engine computes the chunked
    GDN rule with the accelerators' "parallel" schedule, the cache-off one with the CPU's "fused" one, so the
    equivalence also holds across schedules. A third part: the cache-on engine's tensor_parallel_size (TxE: and its
    expert_parallel_size); a fourth, "moe": both engines run tiny-random-moe (sparse-MoE layers and a dense one).
    (Expert parallelism against one device: test_tensor_parallel.py.) "scan-spec": the cache-on engine decodes with
    speculation (its random MTP block's drafts are rejected: every verify row rolls back to a draft slot).
    "scan-async": the cache-on engine plans each step while the one before runs (`async_scheduling`)."""
    parts = request.param.split("-")
    spec = {"method": "mtp", "num_speculative_tokens": 2} if parts[1:] == ["spec"] else None
    ahead = parts[1:] == ["async"]
    parts = parts[:1] if spec or ahead else parts
    mode, schedule, tp = parts[0], (parts[1:] or ["auto"])[0], (parts[2:] or ["1"])[0]
    tp, _, ep = tp.partition("x")
    model = "tiny-random-moe" if parts[3:] == ["moe"] else "tiny-random"
    return (LLM(model, enable_prefix_caching=True, checkpoint_mode=mode, gdn_schedule=schedule,
                tensor_parallel_size=int(tp), expert_parallel_size=int(ep or 1), speculative_config=spec,
                async_scheduling=ahead, **ENGINE_KW),
            LLM(model, enable_prefix_caching=False, gdn_schedule="fused", **ENGINE_KW))


# (the sparse-MoE and the TP engines run this test and the random workloads only: what they change is their steps'
# output, the cache's bookkeeping is the same)
@pytest.mark.parametrize("engines", ["scan", "promote", "scan-parallel", "scan-auto-1-moe", "scan-async", *MESH],
                         indirect=True)
def test_serial_cached_equals_uncached_and_reuses_deepest_checkpoint(engines):
    cached, plain = engines
    computed = []
    for name, prompt in _workload().items():
        a = cached.generate([prompt], GREEDY, use_tqdm=False)[0]
        b = plain.generate([prompt], GREEDY, use_tqdm=False)[0]
        ta, la = _summary(a)
        tb, lb = _summary(b)
        assert ta == tb, name
        np.testing.assert_allclose(la, lb, atol=1e-4, err_msg=name)
        assert b.num_cached_tokens == 0
        assert a.num_cached_tokens == _expected_reuse(prompt, computed), name
        assert a.metrics.restored == (a.num_cached_tokens > 0)
        computed.append(prompt + ta[:-1])  # the last sampled token is never fed back
    # multi-turn: the first turn's decode crosses the 64 boundary (60 prompt + 8 generated tokens), so the
    # checkpoint there was saved during decode and covers generated tokens; the second turn restores it
    rng = np.random.default_rng(8)
    turn1 = random_ids(rng, 60)
    first = cached.generate([turn1], GREEDY, use_tqdm=False)[0]
    computed.append(turn1 + first.outputs[0].token_ids[:-1])
    turn2 = turn1 + first.outputs[0].token_ids + random_ids(rng, 10)
    a = cached.generate([turn2], GREEDY, use_tqdm=False)[0]
    b = plain.generate([turn2], GREEDY, use_tqdm=False)[0]
    assert _summary(a)[0] == _summary(b)[0]
    np.testing.assert_allclose(_summary(a)[1], _summary(b)[1], atol=1e-4)
    assert a.num_cached_tokens == _expected_reuse(turn2, computed) == 64
    stats = cached.cache_stats()
    assert stats["hits"] >= 4 and stats["reused_tokens"] > 0 and stats["checkpoints_restored"] >= stats["hits"]
    assert (stats["planned_ahead"] > 0) == cached.engine.config.scheduling.async_scheduling


def test_concurrent_cached_equals_uncached(engines):
    cached, plain = engines
    rng = np.random.default_rng(11)
    system = random_ids(rng, 90)
    warm = [system + random_ids(rng, 5), random_ids(rng, 40)]
    batch = [system + random_ids(rng, 12), system[:40] + random_ids(rng, 30), list(warm[0]), system + random_ids(rng, 60),
             random_ids(rng, 33), warm[1] + random_ids(rng, 3)]
    warm_a = cached.generate(warm, GREEDY, use_tqdm=False)
    plain.generate(warm, GREEDY, use_tqdm=False)
    earlier = [w + _summary(o)[0][:-1] for w, o in zip(warm, warm_a)]
    outs_a = cached.generate(batch, GREEDY, use_tqdm=False)
    outs_b = plain.generate(batch, GREEDY, use_tqdm=False)
    for prompt, a, b in zip(batch, outs_a, outs_b):
        ta, la = _summary(a)
        tb, lb = _summary(b)
        assert ta == tb
        np.testing.assert_allclose(la, lb, atol=1e-4)
        # requests batched together may also hit each other's checkpoints; never less than the earlier batch gives
        assert a.num_cached_tokens >= _expected_reuse(prompt, earlier)
        assert a.num_cached_tokens % STRIDE == 0 and a.num_cached_tokens < len(prompt)
    assert sum(o.num_cached_tokens for o in outs_a) >= 3 * 64


# (speculation: here only, the cheapest of the three; its greedy outputs against a cache-off engine's, with hits,
# forks and preemption: test_speculation.py)
@pytest.mark.parametrize("engines", ["scan", "promote", "scan-parallel", "scan-spec", "scan-async"], indirect=True)
def test_generation_is_reproducible_with_seeds(engines):
    cached, plain = engines
    rng = np.random.default_rng(3)
    prompts = [random_ids(rng, 40), random_ids(rng, 70)]
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=123, max_tokens=6, ignore_eos=True)
    a = [o.outputs[0].token_ids for o in cached.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in plain.generate(prompts[::-1], params, use_tqdm=False)][::-1]
    assert a == b  # same seed -> same tokens whatever the batch order and cache state
    c = [o.outputs[0].token_ids for o in cached.generate(
        prompts, SamplingParams(temperature=0.8, seed=124, max_tokens=6, ignore_eos=True), use_tqdm=False)]
    assert c != a


def test_bfloat16_engine_cached_equals_uncached():
    kw = dict(ENGINE_KW, dtype="bfloat16")
    on, off = LLM("tiny-random", enable_prefix_caching=True, **kw), LLM("tiny-random", enable_prefix_caching=False, **kw)
    assert on.engine.worker.state.ssm[0].dtype == np.float32 and on.engine.worker.state.conv[0].dtype != np.float32
    rng = np.random.default_rng(4)
    system = random_ids(rng, 70)
    prompts = [system + random_ids(rng, 9), system + random_ids(rng, 20), system[:65]]
    a = [on.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    b = [off.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert [o.num_cached_tokens for o in a] == [0, 64, 64]


def test_bfloat16_long_prefill_cached_equals_uncached(monkeypatch):
    """A prefill step of `UPCAST_ROWS` tokens or more multiplies bfloat16 weights in float32 on CPU (`_product`,
    where `Forms.bf16_upcast`: set here, whatever this machine measured); after a cache hit the prompt's rest runs in
    a smaller step, on the bfloat16 weights as they are. Both engines still agree token for token."""
    monkeypatch.setenv(tuning.UPCAST_ENV, "1")
    kw = dict(ENGINE_KW, dtype="bfloat16", max_model_len=512)
    on, off = LLM("tiny-random", enable_prefix_caching=True, **kw), LLM("tiny-random", enable_prefix_caching=False, **kw)
    assert on.engine.worker.forms.bf16_upcast
    steps = []  # tokens of each prefill step of the cached engine
    execute = on.engine.worker.execute

    def spy(plan, *args, **kwargs):
        if plan.is_prefill:
            steps.append(sum(len(s.token_ids) for s in plan.seqs))
        return execute(plan, *args, **kwargs)

    on.engine.worker.execute = spy
    rng = np.random.default_rng(7)
    system = random_ids(rng, 300)
    prompts = [system + random_ids(rng, 9), system + random_ids(rng, 30)]
    a = [on.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    b = [off.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert [o.num_cached_tokens for o in a] == [0, 288]
    assert max(steps) >= dense.UPCAST_ROWS > min(steps), steps  # both product forms ran


@pytest.mark.parametrize("layer_types", [(FULL, FULL), (LINEAR, LINEAR)], ids=["attention-only", "gdn-only"])
def test_single_kind_models_cache_exactly(layer_types):
    """A model without GDN layers takes the plain KV path (reuse = KV match, no ops); a model without attention
    layers reuses checkpoints only. Both stay exact."""
    cfg = dataclasses.replace(get_preset("tiny-random"), layer_types=layer_types, name="-".join(layer_types))
    on, off = LLM(cfg, enable_prefix_caching=True, **ENGINE_KW), LLM(cfg, enable_prefix_caching=False, **ENGINE_KW)
    rng = np.random.default_rng(6)
    system = random_ids(rng, 85)
    prompts = [system + random_ids(rng, 5), system + random_ids(rng, 9)]
    a = [on.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    b = [off.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    assert [_summary(o)[0] for o in a] == [_summary(o)[0] for o in b]
    np.testing.assert_allclose(_summary(a[1])[1], _summary(b[1])[1], atol=1e-4)
    # plain KV path: every full block of the shared 85 tokens (80, not aligned to a checkpoint); GDN only: the
    # deepest checkpoint below them (64), through a restore
    assert a[1].num_cached_tokens == (64 if LINEAR in layer_types else 80)
    assert a[1].metrics.restored == (LINEAR in layer_types)


def test_unknown_gdn_schedule_is_refused():
    with pytest.raises(ValueError, match="gdn_schedule"):
        LLM("tiny-random", gdn_schedule="chunked", **ENGINE_KW)


@pytest.mark.parametrize("schedule", ["parallel", "fused", "auto"])
def test_gdn_schedule_reaches_the_chunked_rule(schedule, monkeypatch):
    """The engine's `gdn_schedule` is the `impl` the chunked GDN rule is traced with in a prefill step (so the
    "scan-parallel" equivalence above really compares two schedules); "auto" on the CPU runs the compiled prefill
    kernel instead (`cpu_kernels.gdn_prefill`), where it builds (so "scan" and "promote" above compare it with the
    "fused" schedule), else the "fused" schedule. The step functions get a fresh cache here, so this engine's step is traced anew, not taken
    from an engine built earlier in the process."""
    seen, kernel = [], []
    rule, prefill = qwen35.chunk_gated_delta_rule, cpu_kernels.gdn_prefill

    def spy(*args, impl="auto", **kwargs):
        seen.append(impl)
        return rule(*args, impl=impl, **kwargs)

    def kernel_spy(*args, **kwargs):
        kernel.append(True)
        return prefill(*args, **kwargs)

    monkeypatch.setattr(qwen35, "chunk_gated_delta_rule", spy)
    monkeypatch.setattr(cpu_kernels, "gdn_prefill", kernel_spy)
    for name in ("step_function", "prompt_step_function"):
        monkeypatch.setattr(worker_mod, name, functools.lru_cache(maxsize=None)(getattr(worker_mod, name).__wrapped__))
    llm = LLM("tiny-random", gdn_schedule=schedule, **ENGINE_KW)
    prompt = random_ids(np.random.default_rng(3), 2 * STRIDE + 5)  # crosses two boundaries: the saving path too
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    assert llm.engine.cfg.linear_layer_ids
    if schedule == "auto" and llm.engine.worker.forms.kernels:
        assert kernel and not seen
    else:
        assert seen and set(seen) == {"fused" if schedule == "auto" else schedule} and not kernel


def _random_workload(rng, num_requests: int) -> list[tuple[int, str, list[int], SamplingParams, int | None]]:
    """(arrival step, id, prompt, params, abort step or None): prompts grown from shared system prompts, repeats and
    continuations of earlier prompts, and unrelated ones; greedy and seeded sampling, n > 1, stops and penalties."""
    systems = [random_ids(rng, int(rng.integers(20, 80))) for _ in range(2)]
    out, prompts, step = [], [], 0
    for i in range(num_requests):
        step += int(rng.integers(0, 3))
        u = rng.random()
        if u < 0.25 and prompts:
            prompt = prompts[int(rng.integers(len(prompts)))] + random_ids(rng, int(rng.integers(1, 40)))
        elif u < 0.4 and prompts:
            prompt = list(prompts[int(rng.integers(len(prompts)))])
        elif u < 0.85:
            prompt = systems[int(rng.integers(2))] + random_ids(rng, int(rng.integers(0, 50)))
        else:
            prompt = random_ids(rng, int(rng.integers(1, 120)))
        prompt = prompt[:120]
        prompts.append(prompt)
        kw = dict(max_tokens=int(rng.integers(1, 24)), logprobs=1)
        if rng.random() < 0.5:
            kw.update(temperature=0.0)
        else:
            kw.update(temperature=1.0, seed=int(rng.integers(2**32)), top_p=float(rng.choice([0.8, 1.0])),
                      top_k=int(rng.choice([-1, 20])), n=int(rng.choice([1, 1, 2, 3])))
        if rng.random() < 0.3:
            kw.update(stop_token_ids=random_ids(rng, 2), ignore_eos=True)
        if rng.random() < 0.3:
            kw.update(repetition_penalty=1.3, frequency_penalty=0.5)
        abort = step + int(rng.integers(0, 8)) if rng.random() < 0.15 else None
        out.append((step, f"q{i}", prompt, SamplingParams(**kw), abort))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("engines, eviction, ahead", [("scan", "lru", False), ("scan", "flop_aware", False),
                                                      ("scan", "lru", True),
                                                      pytest.param("scan-auto-2", "lru", False, marks=pytest.mark.mesh)],
                         indirect=["engines"])
def test_random_workloads_under_memory_pressure_equal_each_request_alone_without_the_cache(engines, eviction, ahead):
    """Random mixed workloads on an engine with so few KV blocks and linear slots that blocks and checkpoints are
    evicted and requests preempted all the time: every request that is not aborted ends exactly as it does alone on
    the cache-off engine (tokens, finish reason, logprobs), whatever its batch; after every step the scheduler's
    invariants hold and the counters agree; no request is lost, duplicated or heard from after its abort. With
    either checkpoint eviction policy, and with the steps planned ahead (`async_scheduling`)."""
    plain = engines[1].engine
    tight = LLMEngine("tiny-random", enable_prefix_caching=True, num_kv_blocks=18, num_linear_slots=9,
                      max_num_batched_tokens=64, tensor_parallel_size=engines[0].engine.config.tensor_parallel_size,
                      checkpoint_eviction=eviction, eviction_alpha=2.0, async_scheduling=ahead, **ENGINE_KW)
    assert tight.scheduler.block_manager.linear.index.policy.name == eviction
    alone = {}
    for seed in range(2):
        work = _random_workload(np.random.default_rng(seed), 16)
        finished, aborted, step = {}, set(), 0
        while step <= max(w[0] for w in work) or tight.has_unfinished_requests():
            for arrival, rid, prompt, params, abort in work:
                if arrival == step:
                    tight.add_request(rid, prompt, params)
                if abort == step and rid not in finished:
                    tight.abort_request(rid)
                    aborted.add(rid)
            for out in tight.step():
                assert out.request_id not in aborted and out.request_id not in finished
                if out.finished:
                    finished[out.request_id] = out
            tight.scheduler.check_invariants()
            s = tight.cache_stats()
            assert s["hits"] <= s["queries"] and s["reused_tokens"] <= s["query_tokens"]
            saving = len(tight.scheduler.block_manager.linear.saving)  # (the saves of a step planned ahead)
            slots = s["live_slots"] + s["checkpoint_slots"] + s["free_slots"] + saving
            assert slots == tight.memory.num_linear_slots - 1
            assert saving == 0 or ahead
            step += 1
        assert finished.keys() | aborted == {w[1] for w in work} and tight.get_num_unfinished_requests() == 0
        for _, rid, prompt, params, _ in work:
            if rid in aborted:
                continue
            got, m = finished[rid], finished[rid].metrics
            # a stride boundary, or a block boundary where samples that could not fork keep their fork point
            assert got.num_cached_tokens % ENGINE_KW["block_size"] == 0
            assert got.num_cached_tokens <= min(m.kv_match, m.linear_reach)
            key = (tuple(prompt), repr(params))
            if key not in alone:
                plain.add_request("alone", prompt, params)
                while plain.has_unfinished_requests():
                    alone.update({key: o for o in plain.step() if o.finished})
            want = alone[key]
            for a, b in zip(got.outputs, want.outputs, strict=True):
                assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason), rid
                np.testing.assert_allclose([lp[t].logprob for t, lp in zip(a.token_ids, a.logprobs)],
                                           [lp[t].logprob for t, lp in zip(b.token_ids, b.logprobs)], atol=1e-5,
                                           err_msg=rid)
    s = tight.cache_stats()
    assert s["live_slots"] == 0
    assert min(s["hits"], s["preemptions"], s["checkpoints_evicted"], s["kv_blocks_evicted"], s["forks"]) > 0, s
    assert (s["planned_ahead"] > 0) == ahead
