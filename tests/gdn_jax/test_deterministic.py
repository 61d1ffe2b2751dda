"""The deterministic mode (`deterministic=True`): a request's tokens and top-5 logprobs over 16 decode steps are the
same bits alone, inside batches of 1 to 16 mixed requests arriving at different steps (mixed steps, prompts split
at any point by the token budget), on a prefix-cache hit at any checkpoint, and after preemption, in float32 and
bfloat16. Hypothesis chooses the batches, the arrivals and the splits."""

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from gdn_jax import SamplingParams
from gdn_jax.engine import LLMEngine
from tests.gdn_jax import test_donation as donation
from tests.gdn_jax.helpers import FIXTURE

pytestmark = pytest.mark.deterministic

KW = dict(block_size=16, chunk_stride=32, max_model_len=256, verbose=False, deterministic=True)
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, logprobs=5, ignore_eos=True)
DTYPES = ("float32", "bfloat16")
TIGHT_BLOCKS = 25  # the tight engine's KV blocks: 24 usable (block 0 pads)
# Each example runs engines for seconds: 2 in CI (the derandomised "ci" profile), 50 random ones under `make soak`.
EXAMPLES = settings(max_examples=2 if settings.default.derandomize else 50, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module", params=DTYPES)
def engines(request):
    """Per dtype: the request alone (one step for its prompt, no cache), a busy engine (16 rows, a 40-token budget
    that splits prompts off the checkpoint grid, prefix caching) and a tight one (KV blocks for about two requests:
    they preempt each other)."""
    dtype = request.param
    return dict(
        alone=LLMEngine("tiny-random", dtype=dtype, enable_prefix_caching=False, max_num_seqs=1,
                        max_num_batched_tokens=256, **KW),
        busy=LLMEngine("tiny-random", dtype=dtype, enable_prefix_caching=True, max_num_seqs=16,
                       max_num_batched_tokens=40, **KW),
        # (new_request_steps off: the preemption test times its target's arrival to the others' next block, and a
        # step of the target's own would let it finish first)
        tight=LLMEngine("tiny-random", dtype=dtype, enable_prefix_caching=True, max_num_seqs=4, num_kv_blocks=TIGHT_BLOCKS,
                        max_num_batched_tokens=64, new_request_steps=False, **KW),
    )


def _fingerprint(out):
    """The tokens, and per decode step the (id, logprob bits, rank) of the top-5 and the chosen token."""
    c = out.outputs[0]
    return list(c.token_ids), [sorted((t, np.float32(x.logprob).view(np.int32).item(), x.rank) for t, x in d.items())
                               for d in c.logprobs]


def _drive(engine, arrivals):
    """arrivals: step index -> [(request id, prompt, params)]. Runs them all to the end: request id -> output."""
    finals, i = {}, 0
    while i <= max(arrivals) or engine.has_unfinished_requests():
        for rid, prompt, params in arrivals.get(i, ()):
            engine.add_request(rid, prompt, params)
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        i += 1
    return finals


def _alone(engines, prompt):
    return _fingerprint(_drive(engines["alone"], {0: [("x", prompt, PARAMS)]})["x"])


_counter = iter(range(1 << 30))
prompts = st.builds(lambda seed, n: np.random.default_rng(seed).integers(4, 500, n).tolist(),
                    st.integers(0, 1 << 20), st.integers(1, 160))


@EXAMPLES
@given(target=prompts, others=st.lists(st.tuples(prompts, st.integers(0, 4), st.integers(1, 20)), max_size=15),
       arrival=st.integers(0, 4))
def test_alone_equals_inside_any_batch(engines, target, others, arrival):
    """Up to 15 other requests arrive over the first steps, with their own lengths; the target arrives among them."""
    n = next(_counter)
    arrivals = {}
    for i, (prompt, at, max_tokens) in enumerate(others):
        arrivals.setdefault(at, []).append((f"o{n}.{i}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens)))
    arrivals.setdefault(arrival, []).append((f"x{n}", target, PARAMS))
    out = _drive(engines["busy"], arrivals)[f"x{n}"]
    assert _fingerprint(out) == _alone(engines, target)


@EXAMPLES
@given(seed=st.integers(0, 1 << 20), checkpoint=st.integers(1, 5), extra=st.integers(0, 31),
       rest=st.integers(1, 40))
def test_alone_equals_a_prefix_cache_hit(engines, seed, checkpoint, extra, rest):
    """A first request shares the target's first `checkpoint` x 32 + `extra` tokens; the target then restores the
    checkpoint at `checkpoint` x 32 (its KV blocks shared, its GDN state copied) and computes the rest."""
    n = next(_counter)
    rng = np.random.default_rng(seed)
    k = checkpoint * KW["chunk_stride"] + extra
    target = rng.integers(4, 500, k + rest).tolist()
    first = target[:k] + [3] * 8  # token 3 is in no prompt: the match ends at k
    engine = engines["busy"]
    _drive(engine, {0: [(f"w{n}", first, SamplingParams(temperature=0.0, max_tokens=1))]})
    out = _drive(engine, {0: [(f"x{n}", target, PARAMS)]})[f"x{n}"]
    assert out.num_cached_tokens == checkpoint * KW["chunk_stride"]
    assert _fingerprint(out) == _alone(engines, target)


@pytest.mark.parametrize("engines", ["bfloat16"], indirect=True)  # (both dtypes: the tests above)
@EXAMPLES
@given(target=prompts, others=st.lists(st.integers(0, 1 << 20), min_size=3, max_size=3))
def test_alone_equals_after_preemption(engines, target, others):
    """Three requests decode until the KV blocks left are the target's prompt and one more; the target, admitted then
    as the newest running request, is preempted when they next need a block (and is resumed from its tokens, or from
    a checkpoint). In bfloat16, whose rounding shows a differing order soonest."""
    n = next(_counter)
    engine = engines["tight"]
    for i, seed in enumerate(others):
        engine.add_request(f"o{n}.{i}", np.random.default_rng(seed).integers(4, 500, 24).tolist(),
                           SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    need = -(-(len(target) + 1) // KW["block_size"]) + 1
    while engine.cache_stats()["kv_blocks_free"] > need + 1:
        engine.step()
    out = _drive(engine, {0: [(f"x{n}", target, PARAMS)]})[f"x{n}"]
    assert out.metrics.num_preemptions > 0
    assert _fingerprint(out) == _alone(engines, target)


def test_qwen3_next_moe_alone_equals_batched():
    """A sparse-MoE model (routing by rows, experts in tiles, the shared expert's gate; Qwen3-Next's layout, with a
    dense layer among the MoE ones) keeps the guarantee: a request alone and in a batch of 8, the same tokens and
    the same float32 logprobs, bit for bit."""
    rng = np.random.default_rng(3)
    target = rng.integers(4, 200, 90).tolist()
    others = [rng.integers(4, 200, int(n)).tolist() for n in rng.integers(3, 120, 7)]
    engine = LLMEngine(str(FIXTURE.parent / "hf_tiny_next"), enable_prefix_caching=False, max_num_seqs=8,
                       max_num_batched_tokens=64, **KW)
    alone = _fingerprint(_drive(engine, {0: [("a", target, PARAMS)]})["a"])
    jobs = [(f"o{i}", p, SamplingParams(temperature=0.0, max_tokens=8)) for i, p in enumerate(others)]
    rows, step = [], engine.step

    def counted_step():
        outputs = step()
        rows.append(engine.last_step_info["rows"])
        return outputs

    engine.step = counted_step
    batched = _drive(engine, {0: jobs[:3] + [("b", target, PARAMS)] + jobs[3:]})["b"]
    assert _fingerprint(batched) == alone
    assert max(rows) == 8  # the target among seven others in a step


def test_every_step_shape_updates_the_pools_in_place():
    """Donation holds in the deterministic steps too (bfloat16: pools of 16-bit patterns): every pool aliased to an
    output, none copied, no temporary as large as one layer's pool."""
    worker = LLMEngine("tiny", dtype="bfloat16", deterministic=True, **donation.ENGINE_KW).worker
    pools = jax.tree.leaves(worker.state)
    first = len(jax.tree.leaves(worker.params))
    layer_pools = donation._layer_pools(worker.state)
    # the one-row and two-row decode steps and the prefill step with the most checkpoint writes (2 rows x 64 tokens,
    # 4 saves): test_donation.py checks every shape of the grid, in the default mode's steps
    shapes = [worker.step_shape(1, 1, False), worker.step_shape(2, 1, False), worker.step_shape(2, 64, True)]
    assert {worker.num_saves(b, t) for b, t, _ in shapes} == {0, 4} and set(shapes) <= set(worker.shape_buckets())
    for shape in shapes:
        compiled = worker.compiled_step(shape)
        hlo, mem = compiled.as_text(), compiled.memory_analysis()
        assert donation._aliased_parameters(hlo) == set(range(first, first + len(pools))), shape
        assert not {p.size for p in pools + layer_pools} & set(donation._copied_sizes(hlo)), shape
        assert mem.temp_size_in_bytes < min(p.nbytes for p in layer_pools), shape
