"""Who is admitted and who is preempted: requests take turns, a restore source is not charged to the sequence that
restores it, and decode preempts the newest running sequence."""
import pytest

from scheduler import Scheduler
from scheduler.hashing import LINEAR_DOMAIN, chain_hashes, domain_seed
from tests.scheduler.sched_helpers import FakeDevice, make_seq, run, small_config, submit

P = [3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 0, 2, 6, 4, 3, 3, 2, 3, 0, 4, 6, 2, 6, 4, 3, 3, 0, 2, 5, 0]


def _admission_order(plans) -> list[int]:
    return list(dict.fromkeys(r.seq_id for p in plans for r in p.seqs))


@pytest.mark.parametrize("prompt_len", [3, 18], ids=["plain-samples", "forked-samples"])
def test_a_one_sequence_request_is_admitted_next_to_a_flood_queued_before_it(prompt_len):
    """12 samples of one prompt, queued first, then a one-sequence request; 2 run at once. The small request waits
    for one turn of the flood, not for all of it (first come first served admitted it 13th, after 50 steps).
    3 tokens: nothing to fork, 12 plain sequences; 18: the parent forks one child, 10 fall back to the queue (a
    token budget of one stride keeps the small request out while the parent prefills)."""
    cfg = small_config(max_num_seqs=2, max_num_batched_tokens=8)
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    flood = [make_seq(i, P[:prompt_len], max_tokens=8) for i in range(12)]
    sched.add(flood[0], forks=flood[1:])
    for seq in flood:
        dev.add(seq)
    small = submit(sched, dev, make_seq(99, P[20:25], max_tokens=1))
    plans = run(sched, dev)
    order = _admission_order(plans)
    first_step = next(i for i, p in enumerate(plans) if any(r.seq_id == small.seq_id for r in p.seqs))
    assert order.index(small.seq_id) <= 3 and first_step <= 12
    assert sorted(order) == sorted([s.seq_id for s in flood] + [small.seq_id])
    assert small.output_token_ids and all(len(s.output_token_ids) == 8 for s in flood)


def test_requests_of_one_group_take_one_turn_together():
    """One client's 6 prompts, each a request of its own, queued under one group, then a lone request: the lone one
    is admitted second, not after the whole group (each prompt in a lane of its own would put it seventh)."""
    cfg = small_config(max_num_seqs=1)
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    for i in range(6):
        seq = make_seq(i, P[i:i + 3], max_tokens=1)
        sched.add(seq, group="client-a")
        dev.add(seq)
    submit(sched, dev, make_seq(99, P[20:23], max_tokens=1))
    assert [s.seq_id for s in sched.waiting] == [0, 99, 1, 2, 3, 4, 5]
    assert _admission_order(run(sched, dev)) == [0, 99, 1, 2, 3, 4, 5]
    assert sched.seqs == {} and not sched.waiting


def test_samples_that_cannot_fork_wait_in_their_groups_lane():
    """A group's request of 4 samples (18 tokens: the parent forks at 16) and a one-sample request, then a lone
    request; one row, so the 3 children fall back to the queue. They go first in the group's lane, whose turns
    alternate with the lone request's: the lone request is admitted second (a lane of their own would take the next
    turn and put it third)."""
    cfg = small_config(max_num_seqs=1)
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    samples = [make_seq(i, P[:18], max_tokens=2) for i in range(4)]
    sched.add(samples[0], forks=samples[1:], group="client-a")
    other = make_seq(10, P[20:23], max_tokens=1)
    sched.add(other, group="client-a")
    for seq in [*samples, other]:
        dev.add(seq)
    submit(sched, dev, make_seq(99, P[24:27], max_tokens=1))
    assert _admission_order(run(sched, dev)) == [0, 99, 1, 2, 3, 10]
    assert sched.counters["fork_fallbacks"] == 3


@pytest.mark.parametrize("prompt_len", [3, 18], ids=["plain-samples", "forked-samples"])
def test_a_request_at_its_bound_of_running_sequences_lets_the_others_in(prompt_len):
    """`max_running_per_request=2`, 8 rows: 12 samples of one prompt (plain, or forked) never run more than 2 at once,
    while a group of 3 one-sample requests queued after them and a lone request arriving later run beside them (the
    group's 3 at most 2 at once too): the flood's lane passes its turn instead of holding the queue. Without the
    bound the flood takes 7 rows at once."""
    cfg = small_config(max_num_seqs=8, max_running_per_request=2)
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    flood = [make_seq(i, P[:prompt_len], max_tokens=6) for i in range(12)]
    sched.add(flood[0], forks=flood[1:])
    group = [make_seq(20 + i, P[i:i + 3], max_tokens=6) for i in range(3)]
    for seq in group:
        sched.add(seq, group="client-b")
    for seq in flood + group:
        dev.add(seq)
    lanes = {s.seq_id: "flood" for s in flood} | {s.seq_id: "group" for s in group} | {99: "lone"}
    most, plans = {}, []
    while sched.has_unfinished():
        if len(plans) == 3:
            submit(sched, dev, make_seq(99, P[20:25], max_tokens=2))
        plans.append(plan := sched.schedule())
        sched.check_invariants()
        sched.postprocess(plan, dev.execute(plan))
        running = [lanes[s.seq_id] for s in sched.running]
        for lane in set(running):
            most[lane] = max(most.get(lane, 0), running.count(lane))
    assert most == {"flood": 2, "group": 2, "lone": 1}
    lone = next(i for i, p in enumerate(plans) if any(r.seq_id == 99 for r in p.seqs))
    assert lone <= 4  # the step after it arrived, or the one after (a new request's own step)
    assert all(len(s.output_token_ids) == 6 for s in flood + group)


def test_requests_take_one_admission_each_in_turn():
    cfg = small_config(max_num_seqs=1)
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    for request, n in ((0, 3), (10, 2), (20, 1)):
        seqs = [make_seq(request + i, P[:3], max_tokens=1) for i in range(n)]
        sched.add(seqs[0], forks=seqs[1:])
        for seq in seqs:
            dev.add(seq)
    assert [s.seq_id for s in sched.waiting] == [0, 10, 20, 1, 11, 2]
    assert _admission_order(run(sched, dev)) == [0, 10, 20, 1, 11, 2]


def test_a_restore_source_is_not_charged_to_the_sequences_that_restore_it():
    """One checkpoint (at 8) and two free slots: two requests that restore it are both admitted warm in one step,
    each charged only its live slot. Charging the source to the second as well (it is pinned already, so it is not
    taken from the free pool again) would leave it no slot, and it would start cold."""
    cfg = small_config(num_linear_slots=4, max_num_seqs=2)  # slots 1, 2, 3
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    submit(sched, dev, make_seq(1, P[:9], max_tokens=1))
    run(sched, dev)
    linear = sched.block_manager.linear
    h = chain_hashes(P[:8], 8, domain_seed(LINEAR_DOMAIN, 8))[-1]
    checkpoint = linear.index.slot_of[h]
    assert len(linear.free_slots) == 2 and linear.num_checkpoints == 1
    a = submit(sched, dev, make_seq(2, P[:8] + [0, 1], max_tokens=2))
    b = submit(sched, dev, make_seq(3, P[:8] + [2, 3], max_tokens=2))
    plan = sched.schedule()
    assert [(r.seq_id, r.start_pos, r.linear_op.restore_src_slot_id) for r in plan.seqs] == [
        (a.seq_id, 8, checkpoint), (b.seq_id, 8, checkpoint)]
    assert linear.index.pins[checkpoint] == 2 and not linear.free_slots
    sched.check_invariants()
    sched.postprocess(plan, dev.execute(plan))
    assert linear.index.pins[checkpoint] == 0  # held for the step only, by neither sequence after it
    run(sched, dev)
    assert sched.stats()["checkpoints_restored"] == 2


def test_decode_out_of_kv_preempts_the_newest_running_sequence():
    """Two running sequences hold every KV block; the older one needs a block for its next token: the newer one is
    preempted (and recomputed later), never the older."""
    cfg = small_config(max_model_len=16, num_kv_blocks=5)  # blocks 1-4: two prompts of 2 blocks each
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    older = submit(sched, dev, make_seq(1, P[:8], max_tokens=3))
    newer = submit(sched, dev, make_seq(2, P[10:18], max_tokens=3))
    plan = sched.schedule()
    assert [r.seq_id for r in plan.seqs] == [older.seq_id, newer.seq_id]
    sched.postprocess(plan, dev.execute(plan))
    assert sched.block_manager.kv.num_free_blocks == 0
    plan = sched.schedule()  # the older sequence's 9th token opens its third block
    assert newer.num_preemptions == 1 and older.num_preemptions == 0
    assert older.seq_id in [r.seq_id for r in plan.seqs if r.start_pos == 8]
    sched.postprocess(plan, dev.execute(plan))
    run(sched, dev)
    assert len(older.output_token_ids) == len(newer.output_token_ids) == 3 and older.num_preemptions == 0


@pytest.mark.own_mode
@pytest.mark.parametrize("new_request_steps", [True, False])
def test_a_new_request_prefills_in_a_step_of_its_own_then_steps_alternate(new_request_steps):
    """Three requests decode; a fourth arrives. Its first prefill is a step of its own (the decodes sit it out), and
    the next step is an ordinary mixed one even when another new request waits: the running requests lose one step
    in two at most. Without `new_request_steps` the arrival rides in the decodes' mixed step."""
    cfg = small_config(checkpoint_mode="scan", max_num_seqs=6, new_request_steps=new_request_steps)
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    for i in range(3):
        submit(sched, dev, make_seq(i, P[3 * i:3 * i + 9], max_tokens=20))
    plan = None
    while plan is None or plan.is_prefill:  # to a step of decodes only (an ordinary one)
        sched.postprocess(plan := sched.schedule(), dev.execute(plan))
    submit(sched, dev, make_seq(10, P[:14], max_tokens=3))
    submit(sched, dev, make_seq(11, P[5:19], max_tokens=3))
    plans = []
    for _ in range(2):
        plans.append(sched.schedule())
        sched.postprocess(plans[-1], dev.execute(plans[-1]))
    rows = [[r.seq_id for r in p.seqs] for p in plans]
    if new_request_steps:  # the new requests' first prefills alone (11's split by the budget); then an ordinary step
        assert rows == [[10, 11], [11, 0, 1, 2, 10]]
        assert plans[0].num_decode_rows == 0 and plans[1].num_decode_rows == 4
    else:
        assert rows[0][0] == 10 and plans[0].num_decode_rows == 3
    run(sched, dev)


@pytest.mark.parametrize("hints, reuse", [((), (8, 16)), ((12, 20), (12, 20))])
def test_hinted_positions_become_checkpoints_that_later_prompts_hit(hints, reuse):
    """bs 4, stride 8: a prompt hinted at 12 and 20 (off the grid) stops its prefill there and keeps each state; a
    later prompt sharing 13 tokens then restores 12, one sharing 22 restores 20 (16 and 8 from the grid alone).
    The stride boundaries after a hint are still saved, and every state read is the prefix's own (FakeDevice)."""
    cfg = small_config()
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    first = make_seq(1, P[:28], max_tokens=2)
    first.checkpoint_positions = hints
    submit(sched, dev, first)
    run(sched, dev)
    index = sched.block_manager.linear.index
    assert sorted(index.depth_of.values()) == sorted({8, 16, 24} | set(hints))
    later = [submit(sched, dev, make_seq(2, P[:13] + [6, 6, 6], max_tokens=1)),
             submit(sched, dev, make_seq(3, P[:22] + [6, 6], max_tokens=1))]
    run(sched, dev)
    assert tuple(s.num_cached_tokens for s in later) == reuse


def test_hints_are_checked():
    sched = Scheduler(small_config())
    for hints in [(6,), (12, 8), (8, 8), (0,), (32,)]:
        seq = make_seq(1, P[:28])
        seq.checkpoint_positions = hints
        with pytest.raises(ValueError, match="checkpoint_positions"):
            sched.add(seq)
