"""The waiting queue keeps exactly the order a deque would under the scheduler's operations, removals included."""
import random
from collections import deque

import pytest

from scheduler.waiting import WaitingQueue
from tests.scheduler.sched_helpers import make_seq


@pytest.mark.parametrize("seed", range(20))
def test_waiting_queue_keeps_a_deques_order(seed):
    rng = random.Random(seed)
    queue, model, next_id = WaitingQueue(), deque(), 0
    for _ in range(2000):
        op = rng.choice(["append", "appendleft", "insert", "popleft", "remove", "remove", "remove"])
        if op in ("append", "appendleft"):
            seq = make_seq(next_id, [1])
            next_id += 1
            getattr(queue, op)(seq)
            getattr(model, op)(seq)
        elif op == "insert":
            seqs = [make_seq(next_id + i, [1]) for i in range(rng.randrange(4))]
            next_id += len(seqs)
            at = rng.choice([0, 1, rng.randrange(len(model) + 2)])
            queue.insert(at, seqs)
            for i, seq in enumerate(seqs):
                model.insert(at + i, seq)
        elif model and op == "popleft":
            assert queue[0] is model[0]
            assert queue.popleft() is model.popleft()
        elif model:
            seq = rng.choice(model)
            queue.remove(seq)
            model.remove(seq)
        assert len(queue) == len(model) and bool(queue) == bool(model)
        assert list(queue) == list(model)
        assert len(queue._items) <= 2 * len(model) + 33  # tombstones are compacted away
    with pytest.raises(ValueError, match="not waiting"):
        queue.remove(make_seq(next_id, [1]))
    while model:
        assert queue.popleft() is model.popleft()
    with pytest.raises(IndexError):
        queue[0]
