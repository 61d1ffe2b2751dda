"""The host tier: a checkpoint the device pool evicts lives on in host memory, and a later hit copies it back into a
slot before the step that restores it. The fake device moves the states and checks every one a row reads."""
from scheduler import Scheduler
from tests.scheduler.sched_helpers import FakeDevice, make_seq, run, small_config, submit

SHARED = [3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 0, 2, 6, 4, 3, 3, 2, 3]  # 18 tokens: checkpoints at 8 and 16 (stride 8)


def _serve(host: int):
    """Two slots for checkpoints beside 1 live: A's checkpoints are evicted by the prompts after it, then a prompt
    sharing A's 18 tokens comes."""
    cfg = small_config(max_num_seqs=1, num_linear_slots=4, num_host_checkpoints=host)
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    for i, prompt in enumerate([SHARED, [6] * 18, [5] * 18]):
        submit(sched, dev, make_seq(i, prompt, max_tokens=1))
        run(sched, dev)
    again = submit(sched, dev, make_seq(9, SHARED + [0, 0], max_tokens=2))
    plans = run(sched, dev)
    return sched, again, plans


def test_an_evicted_checkpoint_is_hit_on_the_host_and_copied_back_before_its_step():
    sched, again, plans = _serve(host=4)
    assert again.num_cached_tokens == 16 and again.restored
    onloads = [(p, h, slot) for p in plans for h, slot in p.onloads]
    assert len(onloads) == 1
    plan, h, slot = onloads[0]
    row = next(r for r in plan.seqs if r.seq_id == 9)  # the entry goes into the row's live slot, which it reads
    assert row.start_pos == 16 and row.linear_op.linear_state_id == slot and not row.linear_op.restore_requested
    host = sched.block_manager.host
    assert host.num_onloaded == 1 and host.num_offloaded >= 2 and h in host.entries  # (the entry stays)


def test_without_the_host_tier_the_prompt_is_computed_again():
    sched, again, plans = _serve(host=0)
    assert again.num_cached_tokens == 0 and all(not p.host_ops for p in plans)


def test_a_full_host_tier_forgets_its_least_recently_used_entry():
    sched, again, _ = _serve(host=1)  # the checkpoints of the two prompts after A pushed A's out of the host
    assert again.num_cached_tokens == 0 and sched.block_manager.host.num_dropped > 0


def test_a_failed_step_forgets_what_it_was_to_copy():
    cfg = small_config(max_num_seqs=1, num_linear_slots=4, num_host_checkpoints=4)
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    for i, prompt in enumerate([SHARED, [6] * 18, [5] * 18]):
        submit(sched, dev, make_seq(i, prompt, max_tokens=1))
        run(sched, dev)
    submit(sched, dev, make_seq(9, SHARED + [0, 0], max_tokens=2))
    plan = sched.schedule()
    assert plan.onloads
    outs = [op[2] for op in plan.host_ops if op[0] == "out"]
    sched.fail_step(plan)  # the copies may not have run: what it was to copy out is forgotten, what in is kept
    host = sched.block_manager.host
    assert plan.onloads[0][0] in host.entries and not set(outs) & set(host.entries)
    sched.check_invariants()


def test_the_compressed_tier_takes_every_unpinned_checkpoint_before_a_match():
    """offload_checkpoints (checkpoint_dtype): a match first moves every unpinned checkpoint to the tier, so the
    device keeps none between steps and the hit is restored from the tier, though its slot was never needed."""
    cfg = small_config(max_num_seqs=1, num_linear_slots=8, num_host_checkpoints=8, offload_checkpoints=True)
    sched, dev = Scheduler(cfg), FakeDevice(cfg)
    submit(sched, dev, make_seq(0, SHARED, max_tokens=1))
    run(sched, dev)
    index = sched.block_manager.linear.index
    assert len(index) == 2 and not sched.block_manager.host.entries  # saved, still on the device
    again = submit(sched, dev, make_seq(9, SHARED + [0, 0], max_tokens=2))
    plans = run(sched, dev)
    outs = [op for op in plans[0].host_ops if op[0] == "out"]
    assert len(outs) == 2 and plans[0].host_ops.index(outs[-1]) < plans[0].host_ops.index(("in", *plans[0].onloads[0]))
    assert again.num_cached_tokens == 16 and sched.block_manager.host.num_onloaded == 1
    stats = sched.stats()
    assert stats["compressed_checkpoints"] >= 1 and stats["host_checkpoints"] == 0
