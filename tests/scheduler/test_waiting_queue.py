"""The waiting queue admits preempted sequences first, then one sequence per request in turn, removals included."""
import random

import pytest

from scheduler.waiting import WaitingQueue
from tests.scheduler.sched_helpers import make_seq


class ListModel:
    """The queue's order spelled out with lists: preempted first, then the requests' lanes in turn."""

    def __init__(self):
        self.preempted, self.lanes, self.turns = [], {}, []

    def append(self, seq, request):
        if request not in self.lanes:
            self.lanes[request] = []
            self.turns.append(request)
        self.lanes[request].append(seq)

    def push_first(self, seqs, request):
        if seqs and request not in self.lanes:
            self.lanes[request] = []
            self.turns.insert(0, request)
        self.lanes.get(request, [])[:0] = seqs

    def appendleft(self, seq):
        self.preempted.insert(0, seq)

    def popleft(self):
        if self.preempted:
            return self.preempted.pop(0)
        request = self.turns.pop(0)
        seq = self.lanes[request].pop(0)
        if self.lanes[request]:
            self.turns.append(request)
        else:
            del self.lanes[request]
        return seq

    def remove(self, seq):
        if seq in self.preempted:
            self.preempted.remove(seq)
            return
        request = next(r for r, lane in self.lanes.items() if seq in lane)
        self.lanes[request].remove(seq)
        if not self.lanes[request]:
            del self.lanes[request]
            self.turns.remove(request)

    def order(self):
        out, lanes = list(self.preempted), [list(self.lanes[r]) for r in self.turns]
        while lanes:
            lane = lanes.pop(0)
            out.append(lane.pop(0))
            if lane:
                lanes.append(lane)
        return out


@pytest.mark.parametrize("seed", range(20))
def test_waiting_queue_keeps_the_order_of_its_list_model(seed):
    rng = random.Random(seed)
    queue, model, next_id = WaitingQueue(), ListModel(), 0
    for _ in range(2000):
        order = model.order()
        op = rng.choice(["append", "append", "appendleft", "push_first", "popleft", "remove", "remove", "remove"])
        if op in ("append", "push_first"):
            request = rng.randrange(6)
            seqs = [make_seq(next_id + i, [1]) for i in range(rng.randrange(1 if op == "append" else 0, 4))]
            next_id += len(seqs)
            if op == "append":
                for seq in seqs:
                    queue.append(seq, request)
                    model.append(seq, request)
            else:
                queue.push_first(seqs, request)
                model.push_first(seqs, request)
        elif op == "appendleft":
            seq = make_seq(next_id, [1])
            next_id += 1
            queue.appendleft(seq)
            model.appendleft(seq)
        elif order and op == "popleft":
            assert queue[0] is order[0]
            assert queue.popleft() is model.popleft() is order[0]
        elif order:
            seq = rng.choice(order)
            queue.remove(seq)
            model.remove(seq)
        assert len(queue) == len(model.order()) and bool(queue) == bool(model.order())
        assert list(queue) == model.order()
        lanes = [queue._preempted, *queue._turns]
        assert sum(len(lane.items) for lane in lanes) <= 2 * len(queue) + 33 * len(lanes)  # tombstones compacted
        assert len(queue._turns) <= 2 * len(model.lanes) + 33  # emptied lanes too
    with pytest.raises(ValueError, match="not waiting"):
        queue.remove(make_seq(next_id, [1]))
    for seq in model.order():
        assert queue.popleft() is seq
    with pytest.raises(IndexError):
        queue[0]


def test_a_request_of_many_sequences_takes_one_turn_at_a_time():
    queue = WaitingQueue()
    flood = [make_seq(i, [1]) for i in range(100)]
    queue.extend(flood, request=0)
    small = make_seq(100, [1])
    queue.append(small, request=100)
    assert queue.popleft() is flood[0] and queue.popleft() is small
    preempted = make_seq(101, [1])
    queue.appendleft(preempted)
    assert queue[0] is preempted and list(queue) == [preempted] + flood[1:]
    with pytest.raises(ValueError, match="sequence 1 is already waiting"):
        queue.push_first([make_seq(102, [1]), flood[1]], request=7)
    assert len(queue) == 100 and 7 not in queue._lanes and 102 not in queue._entries
