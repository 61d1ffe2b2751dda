"""Mixed steps (prefill rows and decode rows in one step, `mixed_steps`) give every request exactly the outputs of
separate scheduling (all-prefill or all-decode steps): the same tokens, logprobs and prompt logprobs within float32
summation order, with checkpoints saved from the scan and restored by a later request."""

import dataclasses

import numpy as np
import pytest

from gdn_jax import SamplingParams
from gdn_jax.engine import LLMEngine
from scheduler.plan import StepPlan
from tests.gdn_jax.helpers import random_ids

pytestmark = pytest.mark.engine

ENGINE_KW = dict(block_size=16, chunk_stride=32, max_num_seqs=4, max_model_len=256, max_num_batched_tokens=64,
                 verbose=False)


@pytest.fixture(scope="module")
def engines():
    """The same model with mixed steps and with separate (prefill-first) steps."""
    return (LLMEngine("tiny-random", mixed_steps=True, **ENGINE_KW),
            LLMEngine("tiny-random", mixed_steps=False, **ENGINE_KW))


def _drive(engine, arrivals):
    """arrivals: step index -> [(request id, prompt, params)]. Runs to the end; returns the outputs per request and,
    per step, (prefill rows, decode rows) and the ids of the requests that got a decode token in it."""
    finals, steps, i = {}, [], 0
    while i <= max(arrivals) or engine.has_unfinished_requests():
        for rid, prompt, params in arrivals.get(i, ()):
            engine.add_request(rid, prompt, params)
        outs = engine.step()
        info = engine.last_step_info
        steps.append(((info["rows"] - info["decode_rows"]) if info["is_prefill"] else 0, info["decode_rows"]))
        finals.update({o.request_id: o for o in outs if o.finished})
        i += 1
    return finals, steps


def _summary(out):
    c = out.outputs[0]
    lps = np.array([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
    prompt = None if out.prompt_logprobs is None else [
        None if d is None else sorted((t, x.logprob, x.rank) for t, x in d.items()) for d in out.prompt_logprobs]
    return c.token_ids, lps, prompt, out.num_cached_tokens


def test_a_decode_row_and_a_prefill_row_in_one_step_equal_separate_steps(engines):
    rng = np.random.default_rng(11)
    system = random_ids(rng, 70)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2, ignore_eos=True)
    scored = SamplingParams(temperature=0.0, max_tokens=3, logprobs=1, prompt_logprobs=2, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=6, logprobs=1, ignore_eos=True)
    arrivals = {0: [("a", random_ids(rng, 20), greedy), ("b", system + random_ids(rng, 5), sampled)],
                2: [("c", random_ids(rng, 150), scored)],       # a long prompt while a and b decode
                4: [("d", system + random_ids(rng, 40), greedy)]}  # restores b's checkpoint at 64 mid-decode
    mixed, mixed_steps = _drive(engines[0], arrivals)
    separate, separate_steps = _drive(engines[1], arrivals)
    assert sorted(mixed) == sorted(separate) == ["a", "b", "c", "d"]
    for rid in mixed:
        tm, lm, pm, cm = _summary(mixed[rid])
        ts, ls, ps, cs = _summary(separate[rid])
        assert tm == ts, rid
        # a decode row's batch differs between the two (its rows bucket), so float32 sums may differ in order
        np.testing.assert_allclose(lm, ls, rtol=0, atol=1e-5, err_msg=rid)
        assert cm == cs and (pm is None) == (ps is None), rid
        for a, b in zip(pm or (), ps or ()):  # c's prompt logprobs: same tokens and ranks, same values
            assert (a is None) == (b is None) and [x[::2] for x in a or ()] == [x[::2] for x in b or ()], rid
            np.testing.assert_allclose([x[1] for x in a or ()], [x[1] for x in b or ()], rtol=0, atol=1e-5)
    assert _summary(mixed["d"])[3] == 64 and mixed["c"].prompt_logprobs is not None
    # the mixed engine really mixed (c's chunks beside a's decode tokens), the other never did
    assert sum(1 for p, d in mixed_steps if p and d) >= 3
    assert not any(p and d for p, d in separate_steps)


def _mixed_plan(engine):
    """A mixed step's plan: request x decodes while y's 70-token prompt prefills (with checkpoint saves)."""
    assert not engine.has_unfinished_requests()
    engine.add_request("x", list(range(5, 25)), SamplingParams(temperature=0.0, max_tokens=4))
    engine.step()  # prefill: x decodes next
    engine.add_request("y", list(range(30, 100)), SamplingParams(temperature=0.0, max_tokens=1))
    plan = engine.scheduler.schedule()
    assert plan.is_mixed and plan.saves
    return plan


def _fails_and_leaves_the_pools(engine, plan, bad, message: str):
    """`bad` (a corrupted `plan`) raises `message` with the GDN pools untouched; then the step is failed and x, y
    leave the engine."""
    before = [np.asarray(pool).copy() for pool in (engine.worker.state.conv, engine.worker.state.ssm)]
    with pytest.raises(ValueError, match=message):
        engine.worker.execute(bad)
    for pool, was in zip((engine.worker.state.conv, engine.worker.state.ssm), before):
        np.testing.assert_array_equal(np.asarray(pool), was)
    engine.scheduler.fail_step(plan)
    engine.abort_request(["x", "y"])
    assert not engine.has_unfinished_requests()


def test_mixed_plan_with_a_save_into_a_decode_rows_slot_fails_closed(engines):
    """The whole step is checked before either sub-batch runs: nothing is dispatched, the pools are untouched."""
    engine = engines[0]
    plan = _mixed_plan(engine)
    live = plan.decode_seqs[0].linear_op.linear_state_id
    bad = StepPlan(True, plan.seqs, [type(plan.saves[0])(0, plan.saves[0].offset, plan.saves[0].boundary, live)],
                   num_decode_rows=plan.num_decode_rows)
    _fails_and_leaves_the_pools(engine, plan, bad, "decode row")


def test_mixed_plan_whose_decode_half_fails_its_own_checks_dispatches_nothing(engines):
    """A check of the decode sub-batch alone (here: a decode row without its LinearStateCacheOp) fails before the
    prefill sub-batch runs: the pools are untouched, so the failed step can be scheduled again from the same state."""
    engine = engines[0]
    plan = _mixed_plan(engine)
    seqs = plan.seqs[:-1] + [dataclasses.replace(plan.seqs[-1], linear_op=None)]
    bad = StepPlan(True, seqs, plan.saves, num_decode_rows=plan.num_decode_rows)
    _fails_and_leaves_the_pools(engine, plan, bad, "LinearStateCacheOp")
    engine.add_request("x", list(range(5, 25)), SamplingParams(temperature=0.0, max_tokens=4))
    engine.step()  # prefill: x decodes next
    engine.add_request("y", list(range(30, 100)), SamplingParams(temperature=0.0, max_tokens=1))
    plan = engine.scheduler.schedule()
    assert plan.is_mixed
    seqs = plan.seqs[:-1] + [dataclasses.replace(plan.seqs[-1], linear_op=None)]
    bad = StepPlan(True, seqs, plan.saves, num_decode_rows=plan.num_decode_rows)
    before = [np.asarray(pool).copy() for pool in (engine.worker.state.conv, engine.worker.state.ssm)]
    with pytest.raises(ValueError, match="LinearStateCacheOp"):
        engine.worker.execute(bad)
    for pool, was in zip((engine.worker.state.conv, engine.worker.state.ssm), before):
        np.testing.assert_array_equal(np.asarray(pool), was)
    engine.scheduler.fail_step(plan)
    engine.abort_request("x")
    engine.abort_request("y")
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("row", [-1, 64])
def test_a_save_of_a_row_outside_the_step_is_refused(engines, row):
    """A checkpoint save names a row of its sub-batch: one outside it (an index error, or a negative row taken from
    the batch's end) is a ValueError naming it, with nothing dispatched."""
    engine = engines[0]
    plan = _mixed_plan(engine)
    sv = plan.saves[0]
    bad = StepPlan(True, plan.seqs, [type(sv)(row, sv.offset, sv.boundary, sv.slot)],
                   num_decode_rows=plan.num_decode_rows)
    _fails_and_leaves_the_pools(engine, plan, bad, f"row {row} is not a row of this")


@pytest.mark.parametrize("shift", [-1, 1])
def test_a_save_whose_boundary_is_not_its_position_is_refused(engines, shift):
    """A save is indexed under its boundary's hash: one whose row reaches another position at its offset (another
    boundary, or none) would store the state of one position as the checkpoint of another, restored later as exact.
    It is a ValueError naming both, with nothing dispatched."""
    engine = engines[0]
    plan = _mixed_plan(engine)
    sv = plan.saves[0]
    boundary = sv.boundary + shift * (engine.worker.stride if shift > 0 else 1)
    bad = StepPlan(True, plan.seqs, [type(sv)(sv.row, sv.offset, boundary, sv.slot)],
                   num_decode_rows=plan.num_decode_rows)
    _fails_and_leaves_the_pools(engine, plan, bad, f"position {sv.boundary} at offset {sv.offset}, not the "
                                                   f"checkpoint boundary {boundary}")


class _CountedSlot(int):
    """A slot id that counts the comparisons made with it. All share one hash, so a set of them compares its
    members whenever it is built (a save slot, a plain int, never compares with them)."""
    comparisons = 0

    def __eq__(self, other):
        type(self).comparisons += 1
        return int(self) == int(other)

    def __hash__(self):
        return -7


def test_mixed_step_checks_every_save_against_one_set_of_decode_slots():
    """The slots a mixed step's decode rows read or advance are gathered once for all its saves: they were gathered
    again for every save, saves x rows work (2048 saves, 256 decode rows: 4 ms of checks instead of 0.2)."""
    from types import SimpleNamespace

    from gdn_jax.worker.worker import Worker
    from scheduler.plan import LinearStateCacheOp

    rows = 4
    seqs = [SimpleNamespace(linear_op=LinearStateCacheOp(1, True, -1))] + [
        SimpleNamespace(linear_op=LinearStateCacheOp(_CountedSlot(2 + i), True, _CountedSlot(2 + rows + i)))
        for i in range(rows)]
    worker = SimpleNamespace(cfg=SimpleNamespace(linear_layer_ids=(0,)),
                             memory=SimpleNamespace(num_linear_slots=1000))
    comparisons = []
    for saves in (1, 200):
        plan = StepPlan(True, seqs, [SimpleNamespace(slot=100 + j) for j in range(saves)], num_decode_rows=rows)
        _CountedSlot.comparisons = 0
        Worker._check_mixed(worker, plan)  # every check passes
        comparisons.append(_CountedSlot.comparisons)
    assert comparisons[0] == comparisons[1] > 0  # no work per save on the decode rows' slots
    bad = StepPlan(True, seqs, plan.saves + [SimpleNamespace(slot=_CountedSlot(2 + rows))], num_decode_rows=rows)
    with pytest.raises(ValueError, match=f"save into slot {2 + rows}: a decode row"):
        Worker._check_mixed(worker, bad)
