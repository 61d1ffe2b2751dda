"""Step plans: chunk boundaries, budgets, decode, stop rules, preemption, aborts."""
import dataclasses
import random

import pytest

from scheduler import SamplingParams, Scheduler, Sequence
from tests.scheduler.sched_helpers import FakeDevice, make_seq, run, small_config, submit

P = [3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 0, 2, 6, 4, 3, 3, 2, 3, 0, 4, 6, 2, 6, 4, 3]


def shape(plan):
    return plan.is_prefill, [(r.seq_id, r.start_pos, len(r.token_ids), r.sample) for r in plan.seqs]


def test_prefill_chunks_end_on_chunk_stride_multiples():
    cfg = small_config(max_num_batched_tokens=8)
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    submit(sched, dev, make_seq(1, P[:21], max_tokens=2))
    plans = run(sched, dev)
    assert [shape(p) for p in plans] == [
        (True, [(1, 0, 8, False)]), (True, [(1, 8, 8, False)]), (True, [(1, 16, 5, True)]),
        (False, [(1, 21, 1, True)])]
    row = plans[1].seqs[0]
    assert row.block_table == plans[2].seqs[0].block_table[:4]
    assert row.slot_mapping == [row.block_table[p // 4] * 4 + p % 4 for p in range(8, 16)]


@pytest.mark.promote_only
def test_prefill_token_budget_and_max_num_seqs_bound_a_step():
    cfg = small_config(max_num_batched_tokens=16, max_num_seqs=2)
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    for i in range(3):
        submit(sched, dev, make_seq(i, [i] * 10, max_tokens=1))
    plan = sched.schedule()
    assert shape(plan) == (True, [(0, 0, 8, False), (1, 0, 8, False)])
    sched.postprocess(plan, dev.execute(plan))
    assert shape(sched.schedule()) == (True, [(0, 8, 2, True), (1, 8, 2, True)])


def test_prefill_goes_before_decode_and_steps_never_mix_without_mixed_steps():
    cfg = small_config(mixed_steps=False)
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    submit(sched, dev, make_seq(1, P[:5], max_tokens=3))
    plans = [sched.schedule()]
    sched.postprocess(plans[0], dev.execute(plans[0]))
    submit(sched, dev, make_seq(2, P[5:10], max_tokens=3))
    plans += run(sched, dev)
    assert [shape(p) for p in plans[:3]] == [
        (True, [(1, 0, 5, True)]), (True, [(2, 0, 5, True)]), (False, [(1, 5, 1, True), (2, 5, 1, True)])]
    assert plans[2].seqs[0].num_generated == 1


@pytest.mark.own_mode
def test_mixed_step_decodes_first_and_prefills_within_the_rest_of_the_budget():
    """"scan" with mixed_steps: a running decode gets its token in the step that prefills a new prompt; the prefill
    row takes what the decode rows leave of the budget (rounded down to the stride), and its saves index it."""
    cfg = small_config(checkpoint_mode="scan", max_num_batched_tokens=16)
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    submit(sched, dev, make_seq(1, P[:5], max_tokens=4))
    plans = [sched.schedule()]
    sched.postprocess(plans[0], dev.execute(plans[0]))
    submit(sched, dev, make_seq(2, P[:24], max_tokens=2))
    plans += run(sched, dev)
    assert [(shape(p), p.num_decode_rows) for p in plans[:4]] == [
        ((True, [(1, 0, 5, True)]), 0),
        ((True, [(2, 0, 8, False), (1, 5, 1, True)]), 1),   # 15 tokens left: one stride of 8
        ((True, [(2, 8, 8, False), (1, 6, 1, True)]), 1),
        ((True, [(2, 16, 8, True), (1, 7, 1, True)]), 1)]   # the last 8 fit exactly
    assert [p.prefill_seqs for p in plans[1:4]] == [p.seqs[:1] for p in plans[1:4]]
    assert [[(s.row, s.boundary) for s in p.saves] for p in plans[1:3]] == [[(0, 8)], [(0, 16)]]
    assert all(p.num_tokens <= 16 for p in plans)


def test_stop_rules_eos_stop_token_and_max_tokens():
    cfg = small_config(eos_token_id=5)
    sched = Scheduler(cfg)
    eos = Sequence(1, [1, 2], SamplingParams(max_tokens=9))
    ign = Sequence(2, [1, 2], SamplingParams(max_tokens=2, ignore_eos=True))
    stop = Sequence(3, [1, 2], SamplingParams(max_tokens=9, stop_token_ids=[4]))
    for s in (eos, ign, stop):
        sched.add(s)
    feed = {1: [0, 5], 2: [5, 5], 3: [0, 4]}
    while sched.has_unfinished():
        plan = sched.schedule()
        sched.postprocess(plan, [feed[r.seq_id].pop(0) for r in plan.seqs])
    assert (eos.output_token_ids, eos.finish_reason) == ([0, 5], "stop")
    assert (ign.output_token_ids, ign.finish_reason) == ([5, 5], "length")
    assert (stop.output_token_ids, stop.finish_reason) == ([0, 4], "stop")


def _workload(seed=0, n=10):
    rng = random.Random(seed)
    base = [rng.randrange(7) for _ in range(40)]
    return [(i, base[:rng.randrange(1, 40)] + [rng.randrange(7) for _ in range(rng.randrange(3))],
             rng.randrange(1, 20)) for i in range(n)]


def _serve(cfg, workload):
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    seqs = [submit(sched, dev, make_seq(i, toks, max_tokens=m)) for i, toks, m in workload]
    plans = run(sched, dev)
    return seqs, plans, sched


def test_preemption_under_a_tight_kv_pool_keeps_every_output():
    workload = _workload()
    roomy, _, _ = _serve(small_config(num_kv_blocks=200, num_linear_slots=40), workload)
    for caching in (True, False):
        tight, _, sched = _serve(small_config(num_kv_blocks=17, num_linear_slots=6,
                                              enable_prefix_caching=caching), workload)
        assert sched.stats()["preemptions"] > 0
        assert any(s.num_preemptions for s in tight)
        assert [s.output_token_ids for s in tight] == [s.output_token_ids for s in roomy]
        assert [s.finish_reason for s in tight] == [s.finish_reason for s in roomy]
        stats = sched.stats()
        assert stats["live_slots"] == 0 and stats["kv_blocks_free"] == 16


def _plain(plans):
    return [dataclasses.asdict(p) for p in plans]


def test_no_gdn_model_plans_ignore_every_linear_knob():
    workload = _workload(seed=1)
    a = small_config(has_linear_attention_layers=False, num_linear_slots=0, num_kv_blocks=30)
    b = dataclasses.replace(a, num_linear_slots=64, state_fingerprint="other")
    _, plans_a, sched = _serve(a, workload)
    _, plans_b, _ = _serve(b, workload)
    assert _plain(plans_a) == _plain(plans_b)
    assert all(r.linear_op is None for p in plans_a for r in p.seqs)
    assert sched.block_manager.linear is None and sched.stats()["checkpoints_saved"] == 0


def test_linear_machinery_without_prefix_caching_leaves_the_kv_schedule_unchanged():
    workload = _workload(seed=2)
    plain = small_config(has_linear_attention_layers=False, enable_prefix_caching=False, num_kv_blocks=20)
    hybrid = dataclasses.replace(plain, has_linear_attention_layers=True, num_linear_slots=5)
    _, plans_plain, _ = _serve(plain, workload)
    _, plans_hybrid, _ = _serve(hybrid, workload)
    stripped = [dataclasses.replace(p, seqs=[dataclasses.replace(r, linear_op=None) for r in p.seqs])
                for p in plans_hybrid]
    assert _plain(stripped) == _plain(plans_plain)


def test_no_gdn_model_reuses_the_whole_kv_match_unaligned():
    cfg = small_config(has_linear_attention_layers=False, num_linear_slots=0)
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    submit(sched, dev, make_seq(1, P[:13], max_tokens=1))
    run(sched, dev)
    seq = submit(sched, dev, make_seq(2, P[:13] + [1]))
    plan = sched.schedule()
    assert (seq.kv_match, seq.num_cached_tokens, seq.reuse_lost) == (12, 12, 0)
    assert shape(plan) == (True, [(2, 12, 2, True)]) and plan.seqs[0].linear_op is None


@pytest.mark.promote_only
def test_abort_releases_waiting_and_running_sequences():
    cfg = small_config(max_num_seqs=2, num_linear_slots=3)
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    seqs = [submit(sched, dev, make_seq(i, P[:10], max_tokens=5)) for i in range(3)]
    plan = sched.schedule()
    assert [r.seq_id for r in plan.seqs] == [0, 1]
    assert sched.abort(2) and sched.abort(1) and not sched.abort(99) and not sched.abort(1)
    assert seqs[2].finish_reason == "abort"  # waiting: finished at once
    assert seqs[1].finish_reason is None and seqs[1].block_table  # in flight: released at postprocess
    sched.postprocess(plan, dev.execute(plan))  # the aborted row is ignored
    assert seqs[1].finish_reason == "abort"
    assert seqs[1].num_computed_tokens == 0 and seqs[1].block_table == []
    sched.check_invariants()
    run(sched, dev)
    stats = sched.stats()
    assert seqs[0].finish_reason == "length" and stats["live_slots"] == 0
    assert stats["kv_blocks_free"] == cfg.num_kv_blocks - 1


class _ComparedSequence(Sequence):
    """A sequence that counts the times it is compared with another (a search of the waiting queue)."""
    comparisons = 0

    def __eq__(self, other):
        type(self).comparisons += 1
        return self is other

    __hash__ = Sequence.__hash__


def test_aborting_a_whole_waiting_queue_takes_no_search():
    """An abort finds its waiting sequence without searching the queue: aborting all of a queue in random order
    compared each abort with the sequences before it (1024 waiting: 257 000 comparisons); the order of the rest, and
    what is admitted next, stay those of the queue."""
    cfg = small_config(max_num_seqs=1)
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    n = 1024
    for i in range(n):
        seq = _ComparedSequence(i, P[:10], SamplingParams(max_tokens=1, temperature=0.0))
        submit(sched, dev, seq)
    order = list(range(n))
    random.Random(3).shuffle(order)
    _ComparedSequence.comparisons = 0
    for i in order[:-3]:
        assert sched.abort(i)
    assert _ComparedSequence.comparisons == 0
    left = sorted(order[-3:])
    assert [s.seq_id for s in sched.waiting] == left and len(sched.waiting) == 3
    sched.check_invariants()
    plans = run(sched, dev)
    assert list(dict.fromkeys(r.seq_id for p in plans for r in p.seqs)) == left  # admitted in queue order


def test_reset_prefix_cache_forgets_unused_blocks_and_checkpoints():
    cfg = small_config()
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    submit(sched, dev, make_seq(1, P[:20], max_tokens=1))
    run(sched, dev)
    assert sched.stats()["checkpoint_slots"] == 2 and sched.stats()["kv_blocks_cached"] == 5
    assert sched.reset_prefix_cache() is True  # emptied
    stats = sched.stats()
    assert (stats["checkpoint_slots"], stats["kv_blocks_cached"]) == (0, 0)
    assert stats["free_slots"] == cfg.num_linear_slots - 1
    seq = submit(sched, dev, make_seq(2, P[:20] + [1]))
    plan = sched.schedule()
    assert seq.num_cached_tokens == 0
    sched.postprocess(plan, dev.execute(plan))
    # a running request keeps its computed blocks: they stay cached, and the reset says so
    held = sched.stats()["kv_blocks_cached"]
    assert seq.status.name == "RUNNING" and held > 0
    assert sched.reset_prefix_cache() is False and sched.stats()["kv_blocks_cached"] == held
    sched.check_invariants()


def test_stats_count_queries_hits_and_reused_tokens():
    cfg = small_config()
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    submit(sched, dev, make_seq(1, P[:20], max_tokens=1))
    run(sched, dev)
    submit(sched, dev, make_seq(2, P[:20] + [1], max_tokens=1))
    submit(sched, dev, make_seq(3, [6, 6, 6], max_tokens=1))
    run(sched, dev)
    s = sched.stats()
    assert (s["queries"], s["hits"], s["query_tokens"], s["reused_tokens"]) == (3, 1, 44, 16)
    assert s["checkpoints_restored"] == 1 and s["preemptions"] == 0


class _CountedTokens(list):
    """A sequence's token ids, counting the ids read by iterating over them or slicing them."""
    read = 0

    def __iter__(self):
        _CountedTokens.read += len(self)
        return super().__iter__()

    def __getitem__(self, i):
        if isinstance(i, slice):
            _CountedTokens.read += len(range(*i.indices(len(self))))
        return super().__getitem__(i)


def test_a_penalty_row_reads_only_the_new_tokens_of_its_history():
    """A row that applies penalties carries the sequence's tokens so far (`history`). Building it read the whole
    prompt and output on every decode step (and the worker converted it all again): a cost per step that grew with
    the context, 0.8 ms per row at 32k tokens. Only the tokens added since the previous step are read now."""
    cfg = small_config(max_model_len=256, num_kv_blocks=80, max_num_batched_tokens=128)
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    prompt = [random.Random(3).randrange(7) for _ in range(120)]
    seq = submit(sched, dev, Sequence(1, prompt, SamplingParams(max_tokens=40, repetition_penalty=1.2, seed=1)))
    seq.token_ids = _CountedTokens(seq.token_ids)
    histories = []
    while len(histories) < 20:
        plan = sched.schedule()
        histories += [row.history for row in plan.seqs if row.history is not None]
        sched.postprocess(plan, dev.execute(plan))
    assert [list(h) for h in histories] == [prompt + seq.output_token_ids[:k] for k in range(20)]
    _CountedTokens.read = 0
    for _ in range(10):  # decode steps
        plan = sched.schedule()
        assert not plan.is_prefill and len(plan.seqs[0].history) == len(seq.token_ids)
        sched.postprocess(plan, dev.execute(plan))
    assert _CountedTokens.read <= 10 * 4  # a few ids a step (the new token, the row's token), not 150 each


def test_admitting_many_rows_in_one_step_reads_each_row_a_bounded_number_of_times(monkeypatch):
    """Before each further prefill row, a "scan" step bounds it by the longest row so far; that longest was found again
    over every row already scheduled, so admitting R prompts in one step read R**2 / 2 rows (1024 short prompts: 35 ms
    for one schedule())."""
    import scheduler.scheduler as sched_module
    from scheduler.plan import ScheduledSequence

    reads = [0]

    class Counted(ScheduledSequence):
        def __getattribute__(self, name):
            if name == "token_ids":
                reads[0] += 1
            return super().__getattribute__(name)

    monkeypatch.setattr(sched_module, "ScheduledSequence", Counted)
    rows = 40
    cfg = small_config(max_num_seqs=rows, num_kv_blocks=4 * rows + 20, num_linear_slots=2 * rows + 4,
                       max_num_batched_tokens=16 * rows)
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    for i in range(rows):
        submit(sched, dev, make_seq(i, [(i * 7 + j) % 5 for j in range(5 + i % 3)]))
    plan = sched.schedule()
    assert len(plan.seqs) == rows
    assert reads[0] <= 3 * rows
    sched.postprocess(plan, dev.execute(plan))
