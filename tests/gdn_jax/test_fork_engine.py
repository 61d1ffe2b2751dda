"""n > 1 through the engine: one prefill, then forks; each sample equals a separate request with its derived seed."""

import numpy as np
import pytest

from gdn_jax import LLM, SamplingParams
from tests.gdn_jax.helpers import random_ids

pytestmark = pytest.mark.engine

KW = dict(block_size=16, chunk_stride=32, max_num_seqs=4, max_model_len=128, verbose=False)


def _recording(monkeypatch, llm) -> list:
    """Records every plan the worker executes (until the test ends)."""
    plans, execute = [], llm.engine.worker.execute

    def wrapped(plan):
        plans.append(plan)
        return execute(plan)

    monkeypatch.setattr(llm.engine.worker, "execute", wrapped)
    return plans


def _prompt_tokens_computed(plans) -> int:
    return sum(r.num_prompt_tokens_computed for p in plans for r in p.seqs)


@pytest.fixture(scope="module")
def cached():
    return LLM("tiny-random", enable_prefix_caching=True, **KW)


@pytest.fixture(scope="module")
def plain():
    return LLM("tiny-random", enable_prefix_caching=False, **KW)


@pytest.mark.parametrize("length", [75, 50])
def test_n_samples_equal_separate_requests_with_derived_seeds_from_one_prefill(cached, plain, length, monkeypatch):
    """75 tokens: fork point 64 is a checkpoint boundary (the parent rotates its slot in the step its children copy
    it); 50: fork point 48. Each child recomputes only the prompt's last partial block."""
    prompt = random_ids(np.random.default_rng(length), length)
    point = (length - 1) // 16 * 16
    sp = SamplingParams(temperature=1.0, top_k=50, seed=2 ** 32 - 2, max_tokens=8, ignore_eos=True, logprobs=1)
    plans = _recording(monkeypatch, plain)
    separate = [plain.generate([prompt], SamplingParams(**{**sp.__dict__, "seed": (sp.seed + i) % 2 ** 32}),
                               use_tqdm=False)[0].outputs[0] for i in range(4)]
    assert _prompt_tokens_computed(plans) == 4 * length
    for llm in (plain, cached):
        before = dict(llm.cache_stats())
        plans = _recording(monkeypatch, llm)
        out = llm.generate([prompt], SamplingParams(**{**sp.__dict__, "n": 4}), use_tqdm=False)[0]
        assert [c.index for c in out.outputs] == [0, 1, 2, 3] and out.finished
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in separate]
        for c, s in zip(out.outputs, separate):
            assert c.cumulative_logprob == pytest.approx(s.cumulative_logprob, abs=1e-3)
            assert len(c.logprobs) == 8 and c.finish_reason == "length"
        assert len({tuple(c.token_ids) for c in out.outputs}) == 4
        # the prompt's first `point` tokens were prefilled once; each sample computed only the rest
        assert _prompt_tokens_computed(plans) == point + 4 * (length - point)
        after = llm.cache_stats()
        delta = {k: after[k] - before[k] for k in ("forks", "hits", "checkpoints_restored", "fork_fallbacks")}
        assert delta["forks"] == 3 and delta["hits"] == 0 and delta["fork_fallbacks"] == 0
        fork_plans = [p for p in plans if any(r.linear_op.fork for r in p.seqs)]
        assert len(fork_plans) == 1
        children = [r for r in fork_plans[0].seqs if r.linear_op.fork]
        parent = [r for r in fork_plans[0].seqs if not r.linear_op.fork]
        assert len(children) == 3 and {r.start_pos for r in children} == {point}
        assert len({r.linear_op.restore_src_slot_id for r in children}) == 1
        if llm is cached and point % 32 == 0:
            # the fork point is a boundary: the parent's prefill wrote its checkpoint from the scan (mode "scan") and
            # kept its live slot, which the children copy in the step the parent advances it (read before written)
            op = parent[0].linear_op
            assert not op.is_warm_restore and children[0].linear_op.restore_src_slot_id == op.linear_state_id
            assert before["checkpoints_saved"] + 2 == after["checkpoints_saved"]  # boundaries 32 and 64
        assert after["live_slots"] == 0 and after["num_running"] == 0
        llm.engine.scheduler.check_invariants()
        if llm is cached:
            llm.engine.scheduler.reset_prefix_cache()


@pytest.mark.parametrize("length", [49, 17])
def test_a_fork_one_token_past_a_block_boundary_completes_every_sample(cached, plain, length, monkeypatch):
    """49 tokens: fork point 48 leaves the parent one token to compute, a decode row's worth; 17: point 16. The parent
    sits out the step its children fork in: the worker refuses a mixed step whose decode row advances the slot a fork
    reads, and every sample would end in "error"."""
    prompt = random_ids(np.random.default_rng(length), length)
    sp = SamplingParams(temperature=1.0, top_k=50, seed=7, max_tokens=4, ignore_eos=True)
    separate = [plain.generate([prompt], SamplingParams(**{**sp.__dict__, "seed": sp.seed + i}),
                               use_tqdm=False)[0].outputs[0].token_ids for i in range(3)]
    for llm in (plain, cached):
        plans = _recording(monkeypatch, llm)
        out = llm.generate([prompt], SamplingParams(**{**sp.__dict__, "n": 3}), use_tqdm=False)[0]
        assert [c.finish_reason for c in out.outputs] == ["length"] * 3
        assert [c.token_ids for c in out.outputs] == separate
        (fork_plan,) = [p for p in plans if any(r.linear_op.fork for r in p.seqs)]
        sources = {r.linear_op.restore_src_slot_id for r in fork_plan.seqs if r.linear_op.fork}
        assert len(sources) == 1 and not sources & {r.linear_op.linear_state_id for r in fork_plan.seqs}
        assert llm.cache_stats()["live_slots"] == 0
        llm.reset_prefix_cache()


def test_unseeded_samples_differ_and_abort_releases_all(plain):
    prompt = random_ids(np.random.default_rng(3), 40)
    out = plain.generate([prompt], SamplingParams(n=3, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs) == 3 and len({tuple(c.token_ids) for c in out.outputs}) == 3
    engine = plain.engine
    before = engine.cache_stats()["fork_fallbacks"]
    engine.add_request("pending", prompt, SamplingParams(n=4, max_tokens=20, ignore_eos=True))
    engine.abort_request("pending")  # before its fork: no sample runs as an ordinary request
    engine.add_request("group", prompt, SamplingParams(n=4, max_tokens=20, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.abort_request("group")
    assert not engine.has_unfinished_requests()
    s = engine.cache_stats()
    assert s["fork_fallbacks"] == before and s["forks"] >= 3
    assert s["live_slots"] == 0 and s["num_running"] == 0 and s["kv_blocks_free"] == engine.memory.num_kv_blocks - 1
    engine.scheduler.check_invariants()


def test_n_larger_than_the_batch_completes(plain):
    """n = 6 with max_num_seqs = 4: three children fork, two run as ordinary requests afterwards."""
    prompt = random_ids(np.random.default_rng(8), 40)
    sp = SamplingParams(n=6, seed=11, max_tokens=4, ignore_eos=True)
    out = plain.generate([prompt], sp, use_tqdm=False)[0]
    alone = [plain.generate([prompt], SamplingParams(seed=11 + i, max_tokens=4, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids for i in range(6)]
    assert [c.token_ids for c in out.outputs] == alone


def test_fork_op_validation_fails_closed():
    from gdn_jax.model.state import validate_cache_ops
    from scheduler import LinearStateCacheOp

    # a fork may read a live slot the same step advances (it reads the state before the step) ...
    validate_cache_ops([LinearStateCacheOp(2, False, -1), LinearStateCacheOp(3, True, 2, fork=True)], 8)
    # ... but never a slot the same step restores into: it would hand over the stale content
    with pytest.raises(ValueError, match="source 3 is itself restored"):
        validate_cache_ops([LinearStateCacheOp(3, True, 5), LinearStateCacheOp(4, True, 3, fork=True)], 8)
    with pytest.raises(ValueError, match="itself restored"):
        validate_cache_ops([LinearStateCacheOp(3, True, 5), LinearStateCacheOp(4, True, 3)], 8)
    op = LinearStateCacheOp(4, True, 2, fork=True)
    assert LinearStateCacheOp.from_dict(op.to_dict()) == op and op.is_warm_restore and not op.restores_checkpoint


def test_worker_fork_reads_the_parents_state_before_the_step_advances_it():
    """Slot 1 holds 32 prefilled tokens. One step: the parent continues in slot 1 while a child forks slot 1 into
    slot 2 and computes the same 16 tokens over the shared KV blocks: both rows must give the same logits as an
    uninterrupted 48-token prefill."""
    from gdn_jax.config import EngineConfig, get_preset
    from gdn_jax.model.qwen35 import init_model
    from gdn_jax.worker.memory import plan_memory
    from gdn_jax.worker.worker import Worker
    from scheduler import LinearStateCacheOp, ScheduledSequence, StepPlan
    from scheduler.sampling_params import MAX_LOGPROBS

    cfg = get_preset("tiny-random")
    graphdef, params = init_model(cfg)
    settings = EngineConfig.create(block_size=16, max_num_seqs=2, max_model_len=64, chunk_stride=32,
                                   checkpoint_mode="promote", num_kv_blocks=9, num_linear_slots=4)
    mem = plan_memory(cfg, settings)
    w = Worker(cfg, graphdef, params, mem, settings)

    def row(seq_id, tokens, start, table, op):
        slots = [table[p // 16] * 16 + p % 16 for p in range(start, start + len(tokens))]
        return ScheduledSequence(seq_id, tokens, start, table, slots, op, True,
                                 SamplingParams(temperature=0.0, logprobs=MAX_LOGPROBS), 0)  # top logprobs compared

    toks = random_ids(np.random.default_rng(1), 48)
    ref = Worker(cfg, graphdef, params, mem, settings.replace(chunk_stride=64)).execute(
        StepPlan(True, [row(1, toks, 0, [1, 2, 3], LinearStateCacheOp(1, True, -1))]))
    w.execute(StepPlan(True, [row(1, toks[:32], 0, [1, 2], LinearStateCacheOp(1, True, -1))]))
    both = w.execute(StepPlan(True, [row(1, toks[32:], 32, [1, 2, 3], LinearStateCacheOp(1, False, -1)),
                                     row(2, toks[32:], 32, [1, 2, 4], LinearStateCacheOp(2, True, 1, fork=True))]))
    for i in range(2):
        np.testing.assert_allclose(both.top_logprobs[i], ref.top_logprobs[0], atol=1e-5)
    assert both.tokens.tolist() == [ref.tokens[0]] * 2


def test_the_host_work_of_a_step_per_sample_does_not_grow_with_n(monkeypatch):
    """Each sampled row of a step recorded its token by searching the request's samples for its own and summing the
    preemptions of all of them, so a step of a request with n samples did work quadratic in n (n = 256: 4 ms of host
    time per step). The device is left out: a stub returns the step's tokens."""
    from gdn_jax import LLMEngine
    from gdn_jax.worker.step import StepResult
    from scheduler import Sequence

    engine = LLMEngine("tiny-random", max_num_seqs=32, max_model_len=128, block_size=16, chunk_stride=32, verbose=False)

    def execute(plan, *args):
        rows = len(plan.seqs)
        return StepResult(np.full(rows, 70), np.zeros(rows, np.float32), np.ones(rows, np.int32),
                          np.zeros((rows, 0), np.int32), np.zeros((rows, 0), np.float32))

    monkeypatch.setattr(engine.worker, "execute", execute)
    reads = [0]

    class Counted(Sequence):
        def __getattribute__(self, name):
            reads[0] += 1
            return super().__getattribute__(name)

    def reads_per_row(n: int) -> float:
        rid = f"n{n}"
        engine.add_request(rid, list(range(10, 50)), SamplingParams(n=n, max_tokens=20, ignore_eos=True, seed=1))
        while engine.last_step_info.get("rows") != n or engine.last_step_info["is_prefill"]:
            engine.step()
        for seq in engine._requests[rid].seqs:
            seq.__class__ = Counted
        reads[0] = 0
        engine.step()
        assert engine.last_step_info["rows"] == n and not engine.last_step_info["is_prefill"]
        engine.abort_request(rid)
        return reads[0] / n

    few, many = reads_per_row(4), reads_per_row(32)
    assert many <= few + 4, (few, many)


def test_the_samples_of_a_request_convert_its_prompt_once(cached, monkeypatch):
    """The n samples of a request copy its converted prompt: each converted the prompt again, token by token
    (n = 256 samples of a 4000-token prompt: 55 ms to add the request instead of 13)."""
    import scheduler.sequence

    conversions = [0]

    def counted_int(x):
        conversions[0] += 1
        return int(x)

    monkeypatch.setattr(scheduler.sequence, "int", counted_int, raising=False)
    prompt = list(range(5, 85))
    engine = cached.engine
    engine.add_request("samples", prompt, SamplingParams(n=8, max_tokens=1))
    try:
        assert conversions[0] == len(prompt)
        seqs = engine._requests["samples"].seqs
        assert all(s.token_ids == prompt and s.num_prompt_tokens == len(prompt) for s in seqs)
        assert len({id(s.token_ids) for s in seqs}) == 8  # each sample appends to a list of its own
        assert [s.sampling_params.n for s in seqs] == [1] * 8
        assert all(engine.scheduler.seqs[s.seq_id] is s for s in seqs)
    finally:
        engine.abort_request("samples")
    assert not engine.has_unfinished_requests()
