"""checkpoint_mode="scan": the checkpoints a prefill step writes from its chunked scan are the states a separate cold
prefill reaches at those boundaries, in every GDN layer; a long prompt prefills in one step; reuse stays exact."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn_jax import LLM, LLMEngine, SamplingParams
from gdn_jax.config import get_preset, hybrid_layer_types
from gdn_jax.model.state import Batch, init_state
from gdn_jax.model.qwen35 import forward, init_model
from tests.gdn_jax.helpers import BLOCK_SIZE, PREFILL_OPTIONS, random_ids, single_row_batch

pytestmark = pytest.mark.engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True)


COLD_TOKENS = 256  # every prefix the tests below check fits: one padded shape, one compiled forward per model


@functools.cache
def _cold_forward(graphdef):
    return jax.jit(lambda params, batch, state: forward(graphdef, params, batch, state), compiler_options=PREFILL_OPTIONS)


def cold_states(cfg, graphdef, params, dtype, tokens):
    """Per GDN layer, (conv, ssm) after a cold prefill of `tokens` alone, through the plain forward (jitted). The row
    is padded to COLD_TOKENS, its length being len(tokens), so that every prefix runs one compiled shape instead of
    compiling (or dispatching op by op) once per boundary."""
    nb = COLD_TOKENS // BLOCK_SIZE
    batch = single_row_batch(list(tokens) + [0] * (COLD_TOKENS - len(tokens)), 0, nb)
    batch = dataclasses.replace(batch, lengths=jnp.asarray([len(tokens)], jnp.int32))
    _, state = _cold_forward(graphdef)(params, batch, init_state(cfg, nb + 1, BLOCK_SIZE, 2, dtype))
    return [(np.asarray(c[1], np.float32), np.asarray(s[1])) for c, s in zip(state.conv, state.ssm)]


def saved_checkpoints(engine, tokens):
    """{boundary: slot} of the prompt's boundaries that are in the checkpoint index."""
    cfg = engine.scheduler_config
    from scheduler import Sequence, SamplingParams as SP
    probe = Sequence(-1, list(tokens), SP())
    probe.update_linear_state_hashes(cfg.chunk_stride, cfg.state_fingerprint)
    index = engine.scheduler.block_manager.linear.index
    return {(i + 1) * cfg.chunk_stride: index.slot_of[h] for i, h in enumerate(probe.linear_state_hashes)
            if h in index.slot_of}


CASES = [(16, 256, 150, 0), (32, 96, 200, 1), (64, 256, 233, 2)]  # (stride, budget, prompt length, seed)


# "auto": the CPU kernel where it builds; "fused" and "parallel": XLA's chunked scans (the accelerators' path, and the
# CPU's without a compiler), on the case whose budget cuts rows at boundaries and has every row save
@pytest.mark.parametrize("gdn_schedule, stride, budget, length, seed",
                         [("auto", *case) for case in CASES] + [(s, *CASES[1]) for s in ("fused", "parallel")])
def test_every_saved_checkpoint_equals_a_cold_prefill_to_its_boundary(gdn_schedule, stride, budget, length, seed):
    engine = LLMEngine("tiny-random", block_size=BLOCK_SIZE, chunk_stride=stride, max_num_seqs=2, max_model_len=256,
                       max_num_batched_tokens=budget, gdn_schedule=gdn_schedule, verbose=False)
    prompt = random_ids(np.random.default_rng(seed), length)
    engine.add_request("a", prompt, SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    saved = saved_checkpoints(engine, prompt)
    assert sorted(saved) == list(range(stride, length + 1, stride))  # policy "all": every boundary crossed
    assert engine.cache_stats()["checkpoints_save_skipped"] == 0  # a row the budget cut on a boundary deferred none
    assert_checkpoints_equal_cold_prefills(engine, prompt, saved)


def assert_checkpoints_equal_cold_prefills(engine, prompt, saved):
    """Every GDN layer's (conv, ssm) state in each saved slot equals a cold prefill of the prompt to its boundary."""
    pools, w = engine.worker.state, engine.worker
    for b, slot in saved.items():
        for layer, (conv, ssm) in enumerate(cold_states(w.cfg, w.graphdef, w.params, w.dtype, prompt[:b])):
            np.testing.assert_allclose(np.asarray(pools.conv[layer][slot], np.float32), conv, atol=1e-5, rtol=0,
                                       err_msg=f"conv state, boundary {b}, GDN layer {layer}")
            np.testing.assert_allclose(np.asarray(pools.ssm[layer][slot]), ssm, atol=1e-5, rtol=0,
                                       err_msg=f"ssm state, boundary {b}, GDN layer {layer}")


@pytest.mark.parametrize("gdn_schedule", ["auto", "fused", "parallel"])
def test_a_scan_row_that_ends_on_a_boundary_saves_it_once_and_defers_no_save(gdn_schedule):
    """A 64-token prompt at stride 32 prefills in one row that ends on boundary 64: the scan writes both checkpoints,
    and no deferred save is recorded as well (it would be skipped as cached next step or, had the scan save found no
    slot, promote the live slot and pay a rotation copy)."""
    engine = LLMEngine("tiny-random", block_size=BLOCK_SIZE, chunk_stride=32, max_num_seqs=2, max_model_len=128,
                       gdn_schedule=gdn_schedule, verbose=False)
    prompt = random_ids(np.random.default_rng(4), 64)
    engine.add_request("a", prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    seq = engine.scheduler.seqs[engine.seq_id_of("a")]
    assert seq.num_computed_tokens == 64 and seq.pending_save_hash is None
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.cache_stats()
    assert (stats["checkpoints_saved"], stats["checkpoints_save_skipped"], stats["rotation_copies"]) == (2, 0, 0)
    saved = saved_checkpoints(engine, prompt)
    assert sorted(saved) == [32, 64]
    assert_checkpoints_equal_cold_prefills(engine, prompt, saved)


@pytest.fixture(scope="module")
def long_engines():
    kw = dict(block_size=BLOCK_SIZE, chunk_stride=256, max_num_seqs=2, max_model_len=2304,
              max_num_batched_tokens=2048, verbose=False)
    return LLM("tiny-random", **kw), LLM("tiny-random", enable_prefix_caching=False, **kw)


def test_a_2048_token_prompt_prefills_in_one_step_and_a_1792_token_share_is_reused_exactly(long_engines):
    cached, plain = long_engines
    rng = np.random.default_rng(5)
    first = random_ids(rng, 2048)
    second = first[:1792] + random_ids(rng, 256)
    steps = []
    real = cached.engine.worker.execute
    cached.engine.worker.execute = lambda plan, *a, **kw: (steps.append(
        (plan.is_prefill, len(plan.seqs), len(plan.saves))), real(plan, *a, **kw))[1]
    try:
        a = cached.generate([first], GREEDY, use_tqdm=False)[0]
        assert steps[0] == (True, 1, 8) and not any(p for p, _, _ in steps[1:])  # one prefill step, 8 saves
        b = cached.generate([second], GREEDY, use_tqdm=False)[0]
    finally:
        cached.engine.worker.execute = real
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 1792)
    for got, prompt in ((a, first), (b, second)):
        want = plain.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
        assert got.outputs[0].token_ids == want.token_ids
        np.testing.assert_allclose([lp[t].logprob for t, lp in zip(got.outputs[0].token_ids, got.outputs[0].logprobs)],
                                   [lp[t].logprob for t, lp in zip(want.token_ids, want.logprobs)], atol=1e-5, rtol=0)


def test_policy_last_saves_only_the_deepest_boundary_and_a_next_turn_reuses_it():
    kw = dict(block_size=BLOCK_SIZE, chunk_stride=32, max_num_seqs=2, max_model_len=256, verbose=False)
    last = LLM("tiny-random", checkpoint_policy="last", **kw)
    plain = LLM("tiny-random", enable_prefix_caching=False, **kw)
    rng = np.random.default_rng(9)
    turn1 = random_ids(rng, 100)
    out1 = last.generate([turn1], GREEDY, use_tqdm=False)[0]
    assert sorted(saved_checkpoints(last.engine, turn1)) == [96]
    turn2 = turn1 + list(out1.outputs[0].token_ids) + random_ids(rng, 20)
    out2 = last.generate([turn2], GREEDY, use_tqdm=False)[0]
    assert out2.num_cached_tokens == 96
    assert out2.outputs[0].token_ids == plain.generate([turn2], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_saves_land_in_their_layer_under_the_nested_layer_loops():
    """Two repeats of (3 GDN + 1 full): the GDN layer index is traced from both loops (group and run). Saves of two
    ragged rows go into the stacked pools at that index, each equal to a cold prefill to its boundary, in all six
    GDN layers; the live slots hold the rows' final states; a padding save writes slot 0 only."""
    cfg = dataclasses.replace(get_preset("tiny-random"), layer_types=hybrid_layer_types(8))
    graphdef, params = init_model(cfg)
    rng = np.random.default_rng(11)
    rows = [random_ids(rng, 100), random_ids(rng, 70)]
    T, nb = 128, 8
    tokens, slot_mapping = np.zeros((2, T), np.int32), np.zeros((2, T), np.int32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
        slot_mapping[i, :len(r)] = (1 + i * nb) * BLOCK_SIZE + np.arange(len(r))  # row i owns blocks 1+8i..8+8i
    saves = [(0, 32, 3), (0, 96, 4), (1, 64, 5), (0, 16, 0)]  # (row, offset, slot); the last one is padding
    batch = Batch(tokens=jnp.asarray(tokens), start_pos=jnp.zeros(2, jnp.int32),
                  lengths=jnp.asarray([len(r) for r in rows], jnp.int32),
                  block_tables=jnp.asarray(1 + np.arange(2 * nb, dtype=np.int32).reshape(2, nb)),
                  slot_mapping=jnp.asarray(slot_mapping), linear_state_ids=jnp.asarray([1, 2], jnp.int32),
                  has_initial_state=jnp.zeros(2, bool),
                  **{f"save_{k}": jnp.asarray(v, jnp.int32) for k, v in zip(("rows", "offsets", "slots"), zip(*saves))})
    step = jax.jit(forward, static_argnums=(0, 4, 5), compiler_options=PREFILL_OPTIONS)
    _, pools = step(graphdef, params, batch, init_state(cfg, 2 * nb + 1, BLOCK_SIZE, 8), False, 16)
    expected = {slot: rows[row][:offset] for row, offset, slot in saves if slot} | {1: rows[0], 2: rows[1]}
    for slot, prefix in expected.items():
        cold = cold_states(cfg, graphdef, params, jnp.float32, prefix)
        assert len(cold) == 6
        for layer, (conv, ssm) in enumerate(cold):
            np.testing.assert_allclose(np.asarray(pools.conv[layer][slot]), conv, atol=1e-5, rtol=0,
                                       err_msg=f"conv state, slot {slot}, GDN layer {layer}")
            np.testing.assert_allclose(np.asarray(pools.ssm[layer][slot]), ssm, atol=1e-5, rtol=0,
                                       err_msg=f"ssm state, slot {slot}, GDN layer {layer}")
    assert not np.any(np.asarray(pools.ssm[:, 6:]))  # no other slot was written (slot 0 takes the padding save)
