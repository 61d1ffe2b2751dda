"""n > 1 at scheduler level: the prompt is prefilled once, children share its full KV blocks by refcount, copy the
parent's live linear state through a fork op, recompute only the last partial block, and fall back to ordinary
requests when a fork cannot happen. The fake device checks every state and KV read."""
import pytest

from scheduler import SamplingParams, Scheduler, Sequence
from scheduler.sequence import SequenceStatus
from tests.scheduler.sched_helpers import FakeDevice, make_seq, run, small_config, submit

PROMPT = [3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 0, 2, 6, 4, 3, 3, 2, 3, 0, 4, 6, 2, 6, 4, 3, 1]


def _serve_group(cfg, prompt, n, max_tokens=3, first_id=1):
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    parent = make_seq(first_id, prompt, max_tokens=max_tokens)
    children = [make_seq(first_id + i, prompt, max_tokens=max_tokens) for i in range(1, n)]
    sched.add(parent, forks=children)
    for s in [parent] + children:
        dev.add(s)
    return sched, dev, parent, children


def _prefill_tokens(plans) -> int:
    return sum(r.num_prompt_tokens_computed for p in plans for r in p.seqs)


@pytest.mark.parametrize("length, caching", [(19, True), (19, False), (23, True), (17, True), (26, False)])
def test_children_fork_from_one_prefill(length, caching):
    """bs 4, chunk 8: 19 -> fork point 16, a checkpoint boundary (the parent rotates its slot into a checkpoint in
    the very step its children read it); 23 -> 20, between boundaries; 17 -> 16 with one token left each."""
    cfg = small_config(enable_prefix_caching=caching)
    prompt = PROMPT[:length]
    point = (length - 1) // 4 * 4
    sched, dev, parent, children = _serve_group(cfg, prompt, 4)
    plans = run(sched, dev)
    # the prompt's first `point` tokens were computed once, the rest once per sample
    assert _prefill_tokens(plans) == point + 4 * (length - point)
    fork_rows = [r for p in plans for r in p.seqs if r.linear_op is not None and r.linear_op.fork]
    assert sorted(r.seq_id for r in fork_rows) == [c.seq_id for c in children]
    assert {r.start_pos for r in fork_rows} == {point} and all(r.sample for r in fork_rows)
    k = next(i for i, p in enumerate(plans) if any(r.linear_op is not None and r.linear_op.fork for r in p.seqs))
    fork_plan = plans[k]
    before = [r for p in plans[:k] for r in p.seqs if r.seq_id == parent.seq_id][-1]
    assert before.start_pos + len(before.token_ids) == point  # the parent stopped at the fork point
    for r in fork_rows:  # the child's table starts with the parent's blocks (shared), then its own
        assert r.block_table[:point // 4] == before.block_table[:point // 4]
        assert r.block_table[point // 4] not in before.block_table
    parent_rows = [r for r in fork_plan.seqs if r.seq_id == parent.seq_id]
    if length - point >= 2:  # the parent advances in the same step its children copy its state
        assert parent_rows and parent_rows[0].start_pos == point
    src = {r.linear_op.restore_src_slot_id for r in fork_rows}
    assert len(src) == 1  # all read the parent's live slot
    s = sched.stats()
    assert s["forks"] == 3 and s["fork_fallbacks"] == 0
    assert s["queries"] == (1 if caching else 0) and s["hits"] == 0
    assert s["live_slots"] == 0 and s["num_running"] == 0
    outs = [parent.output_token_ids] + [c.output_token_ids for c in children]
    assert all(o == outs[0] and len(o) == 3 for o in outs)  # the fake model is deterministic


@pytest.mark.parametrize("length", [9, 17, 25])
def test_no_row_of_a_fork_step_advances_the_source_one_token_past_a_block_boundary(length):
    """bs 4: at its fork point the parent has one token left, a decode row's worth. It sits out the step in which its
    children copy its live slot: the worker refuses a mixed step whose decode row advances a slot that a restore
    reads. (With two or more tokens left it prefills in that step: a prefill row's restores precede its forward.)"""
    sched, dev, parent, children = _serve_group(small_config(), PROMPT[:length], 3)
    plans = run(sched, dev)
    fork_plans = [p for p in plans if any(r.linear_op.fork for r in p.seqs)]
    assert fork_plans and sched.stats()["forks"] == 2
    for plan in fork_plans:
        sources = {r.linear_op.restore_src_slot_id for r in plan.seqs if r.linear_op.fork}
        assert not sources & {r.linear_op.linear_state_id for r in plan.seqs}
        assert parent.seq_id not in [r.seq_id for r in plan.seqs]
    assert all(c.output_token_ids == parent.output_token_ids for c in children)


def test_children_share_the_full_blocks_by_refcount():
    cfg = small_config()
    sched, dev, parent, children = _serve_group(cfg, PROMPT[:23], 3)
    plans = []
    while not any(r.linear_op is not None and r.linear_op.fork for r in (plans[-1].seqs if plans else [])):
        plan = sched.schedule()
        plans.append(plan)
        sched.check_invariants()
        sched.postprocess(plan, dev.execute(plan))
    kv = sched.block_manager.kv
    shared = parent.block_table[:5]  # fork point 20 = 5 full blocks
    assert all(c.block_table[:5] == shared for c in children)
    assert all(kv.ref_counts[b] == 3 for b in shared)
    own = [c.block_table[5] for c in children] + [parent.block_table[5]]
    assert len(set(own)) == 3 and all(kv.ref_counts[b] == 1 for b in own)
    assert len({c.linear_state_id for c in children} | {parent.linear_state_id}) == 3
    run(sched, dev)
    assert sched.stats()["forks"] == 2


def test_checkpoint_restores_do_not_count_forks():
    cfg = small_config()
    single, dev1, *_ = _serve_group(cfg, PROMPT[:19], 1)
    run(single, dev1)
    group, dev4, *_ = _serve_group(cfg, PROMPT[:19], 4)
    run(group, dev4)
    assert group.stats()["checkpoints_restored"] == single.stats()["checkpoints_restored"]
    assert group.stats()["forks"] == 3 and single.stats()["forks"] == 0


def test_children_that_do_not_fit_run_as_ordinary_requests():
    cfg = small_config(max_num_seqs=2)
    sched, dev, parent, children = _serve_group(cfg, PROMPT[:19], 4)
    plans = run(sched, dev)
    s = sched.stats()
    assert s["forks"] == 1 and s["fork_fallbacks"] == 2
    assert all(c.finish_reason == "length" and c.output_token_ids == parent.output_token_ids for c in children)
    # the two fallbacks prefill on their own (from the prefix cache: the fork point 16 is a checkpoint)
    assert s["queries"] == 3 and s["hits"] == 2
    assert _prefill_tokens(plans) == 16 + 2 * 3 + 2 * 3


def test_children_that_do_not_fit_restore_the_fork_point_off_the_stride_grid():
    """Fork point 20 (bs 4, chunk 8) is no checkpoint boundary: the parent keeps its state there as a checkpoint
    keyed by the block hash, so the fallbacks recompute 3 tokens each instead of 7 (from checkpoint 16)."""
    cfg = small_config(max_num_seqs=2)
    sched, dev, parent, children = _serve_group(cfg, PROMPT[:23], 4)
    plans = run(sched, dev)
    s = sched.stats()
    assert s["forks"] == 1 and s["fork_fallbacks"] == 2 and s["hits"] == 2
    assert s["reused_tokens"] == 2 * 20
    assert _prefill_tokens(plans) == 20 + 4 * 3  # once to the fork point, then 3 tokens per sample
    assert all(c.output_token_ids == parent.output_token_ids for c in children)
    assert sched.block_manager.linear.index.num_off_grid == 1


def test_a_cached_fork_point_turns_children_into_ordinary_cache_hits():
    cfg = small_config()
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    submit(sched, dev, make_seq(1, PROMPT[:19], max_tokens=2))
    run(sched, dev)
    parent = make_seq(2, PROMPT[:19], max_tokens=2)
    children = [make_seq(i, PROMPT[:19], max_tokens=2) for i in (3, 4)]
    sched.add(parent, forks=children)
    for s in [parent] + children:
        dev.add(s)
    run(sched, dev)
    s = sched.stats()
    assert s["forks"] == 0 and s["fork_fallbacks"] == 2 and s["hits"] == 3


def test_short_prompt_has_nothing_to_share():
    cfg = small_config()
    sched, dev, parent, children = _serve_group(cfg, PROMPT[:4], 3)  # fork point 0
    assert not sched.forks and len(sched.waiting) == 3
    plans = run(sched, dev)
    assert _prefill_tokens(plans) == 12 and sched.stats()["forks"] == 0


def test_chunk_stride_one_never_forks_because_its_one_token_steps_advance_states_in_place():
    """A fork copies its parent's live slot in the step that may advance that slot too. Only a step of two or more
    tokens per row reads every initial state before writing any; with chunk_stride 1 a prefill step may hold one
    token per row (always under "promote"), and such a step advances the pools in place, where the worker rejects a
    restore from a live slot of the same step.
    The samples therefore run as ordinary requests, each computing its own prompt."""
    cfg = small_config(block_size=1, chunk_stride=1, max_num_batched_tokens=4, num_kv_blocks=80)
    sched, dev, parent, children = _serve_group(cfg, PROMPT[:6], 3)  # fork point 5 > 0 would otherwise fork
    assert not sched.forks and len(sched.waiting) == 3
    plans = run(sched, dev)
    assert sched.stats()["forks"] == 0
    assert not any(row.linear_op.fork for p in plans for row in p.seqs)


def test_a_full_chunk_finished_by_a_row_that_starts_at_the_fork_point_still_yields_its_checkpoint():
    """Every full chunk yields a checkpoint. A row that starts at a fork point off the stride grid cannot save its
    boundaries from the scan (they are no chunk ends of it), so a boundary it ends on is saved by promotion, as a
    decode's is: without that, n > 1 under "scan" lost the whole-prompt checkpoint a later turn would reuse."""
    cfg = small_config()
    sched, dev, parent, children = _serve_group(cfg, PROMPT[:16], 2, max_tokens=1)  # fork point 12, stride 8
    run(sched, dev)
    assert sched.stats()["forks"] == 1
    index = sched.block_manager.linear.index
    assert index.contains(parent.linear_state_hashes[0]) and index.contains(parent.linear_state_hashes[1])


def test_attention_only_model_forks_kv_only():
    cfg = small_config(has_linear_attention_layers=False, num_linear_slots=0)
    sched, dev, parent, children = _serve_group(cfg, PROMPT[:23], 3)
    plans = run(sched, dev)
    assert _prefill_tokens(plans) == 20 + 3 * 3 and sched.stats()["forks"] == 2


@pytest.mark.parametrize("victim", ["parent", "child"])
def test_abort_before_the_fork(victim):
    cfg = small_config()
    sched, dev, parent, children = _serve_group(cfg, PROMPT[:23], 3)
    plan = sched.schedule()  # the parent's first chunk
    sched.postprocess(plan, dev.execute(plan))
    sched.abort(parent.seq_id if victim == "parent" else children[0].seq_id)
    sched.check_invariants()
    run(sched, dev)
    if victim == "parent":
        assert parent.finish_reason == "abort" and all(c.finish_reason == "length" for c in children)
        assert sched.stats()["forks"] == 0 and sched.stats()["fork_fallbacks"] == 2
    else:
        assert children[0].finish_reason == "abort" and children[1].finish_reason == "length"
        assert sched.stats()["forks"] == 1
    assert sched.stats()["live_slots"] == 0


def test_add_rejects_a_fork_with_another_prompt_or_a_clashing_id():
    sched = Scheduler(small_config())
    with pytest.raises(ValueError, match="shares its parent's prompt"):
        sched.add(make_seq(1, PROMPT[:10]), forks=[make_seq(2, PROMPT[:9])])
    with pytest.raises(ValueError, match="distinct seq_ids"):
        sched.add(make_seq(1, PROMPT[:10]), forks=[make_seq(1, PROMPT[:10])])
    assert not sched.seqs and not sched.waiting and not sched.forks


class _Watched(Sequence):
    """A sequence that counts the attribute reads and comparisons made on it while `watching` is on: the scheduler's
    work on a request it has no business with in that step."""
    watching, touches = False, 0

    def __getattribute__(self, name):
        if _Watched.watching:
            _Watched.touches += 1
        return super().__getattribute__(name)

    def __eq__(self, other):
        if _Watched.watching:
            _Watched.touches += 1
        return self is other

    __hash__ = Sequence.__hash__


def _queue_groups(sched, dev, first_id: int, groups: int, n: int) -> None:
    for g in range(groups):
        sp = SamplingParams(max_tokens=2, temperature=0.0)
        seqs = [_Watched(first_id + g * n + i, PROMPT[:19], sp) for i in range(n)]
        sched.add(seqs[0], forks=seqs[1:])
        for s in seqs:
            dev.add(s)


def test_a_step_does_no_work_on_queued_requests_with_samples_to_fork():
    """Requests of n > 1 queued behind full running rows are not looked at by a step: each decode step used to visit
    every queued parent and every sample waiting to fork from it, so a step's host time grew with the queue."""
    cfg = small_config(max_num_seqs=2)
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    running = [submit(sched, dev, make_seq(i, PROMPT[:9], max_tokens=20)) for i in (1, 2)]
    _queue_groups(sched, dev, 100, groups=30, n=3)
    for _ in range(3):  # both prefilled and decoding
        plan = sched.schedule()
        sched.postprocess(plan, dev.execute(plan))
    assert all(not s.is_prefilling and s.status == SequenceStatus.RUNNING for s in running)
    _Watched.touches, _Watched.watching = 0, True
    try:
        for _ in range(5):
            plan = sched.schedule()
            sched.postprocess(plan, dev.execute(plan))
    finally:
        _Watched.watching = False
    assert _Watched.touches == 0
    sched.check_invariants()
    run(sched, dev)
    assert not sched.seqs and sched.stats()["forks"] + sched.stats()["fork_fallbacks"] == 60


def test_aborting_a_sample_waiting_to_fork_does_no_work_on_other_requests():
    """Aborting a sample that waits for its fork used to search every queued request's samples for its parent, so
    aborting a queue of requests with n > 1 took time quadratic in its length."""
    cfg = small_config(max_num_seqs=2)
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    _queue_groups(sched, dev, 100, groups=30, n=3)
    parent, children = make_seq(1, PROMPT[:19], max_tokens=2), [make_seq(i, PROMPT[:19], max_tokens=2) for i in (2, 3)]
    sched.add(parent, forks=children)  # queued behind the others
    for s in [parent] + children:
        dev.add(s)
    _Watched.touches, _Watched.watching = 0, True
    try:
        sched.abort(children[1].seq_id)
        sched.abort(children[0].seq_id)
    finally:
        _Watched.watching = False
    assert _Watched.touches == 0
    assert children[0].finish_reason == children[1].finish_reason == "abort" and parent.seq_id not in sched.forks
    sched.check_invariants()
    run(sched, dev)
    assert parent.finish_reason == "length" and not sched.seqs


def test_samples_take_their_parents_hash_chains_instead_of_hashing_the_prompt_again(monkeypatch):
    """The samples of a request share its prompt, so they share the prefix-cache hash chains over it: each sample
    hashed the whole prompt again (n = 256 samples of an 8k-token prompt: 160k hashes, 0.2 s of host time)."""
    import scheduler.hashing

    calls = [0]
    real = scheduler.hashing.hash_unit

    def counted(prev, tokens):
        calls[0] += 1
        return real(prev, tokens)

    monkeypatch.setattr(scheduler.hashing, "hash_unit", counted)

    def hashes(n: int) -> int:
        calls[0] = 0
        sched, dev, parent, children = _serve_group(small_config(max_num_seqs=8), PROMPT, n, max_tokens=6)
        run(sched, dev, check=False)
        assert sched.stats()["forks"] == n - 1
        assert all(c.block_hashes == parent.block_hashes for c in children if c.token_ids == parent.token_ids)
        return calls[0]

    one, eight = hashes(1), hashes(8)
    # a sample hashes only the blocks and chunks its own tokens fill: 26 prompt + 6 output tokens end one more block
    assert eight <= one + 7 * 2
