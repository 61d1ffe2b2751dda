"""The waiting queue admits preempted sequences first, then one sequence per request in turn, removals included."""
import random

import pytest

from scheduler.waiting import WaitingQueue
from tests.scheduler.sched_helpers import make_seq


class ListModel:
    """The queue's order spelled out with lists: preempted first, then the requests' lanes in turn; a new request
    (no sequence admitted yet) may have one admitted ahead of its turn, and then passes its next turn."""

    def __init__(self):
        self.preempted, self.lanes, self.turns, self.new, self.owed = [], {}, [], [], {}

    def append(self, seq, request):
        if request not in self.lanes:
            self.lanes[request], self.owed[request] = [], 0
            self.turns.append(request)
            self.new.append(request)
        self.lanes[request].append(seq)

    def push_first(self, seqs, request):
        if seqs and request not in self.lanes:
            self.lanes[request], self.owed[request] = [], 0
            self.turns.insert(0, request)
        self.lanes.get(request, [])[:0] = seqs

    def appendleft(self, seq):
        self.preempted.insert(0, seq)

    def _drop(self, request):
        del self.lanes[request], self.owed[request]
        if request in self.turns:
            self.turns.remove(request)
        if request in self.new:
            self.new.remove(request)

    def popleft(self):
        if self.preempted:
            return self.preempted.pop(0)
        while self.owed[self.turns[0]]:
            self.owed[self.turns[0]] -= 1
            self.turns.append(self.turns.pop(0))
        request = self.turns.pop(0)
        seq = self.lanes[request].pop(0)
        if request in self.new:
            self.new.remove(request)
        if self.lanes[request]:
            self.turns.append(request)
        else:
            self._drop(request)
        return seq

    def new_head(self):
        return None if self.preempted or not self.new else self.lanes[self.new[0]][0]

    def pop_new(self):
        request = self.new.pop(0)
        seq = self.lanes[request].pop(0)
        if self.lanes[request]:
            self.owed[request] += 1
        else:
            self._drop(request)
        return seq

    def remove(self, seq):
        if seq in self.preempted:
            self.preempted.remove(seq)
            return
        request = next(r for r, lane in self.lanes.items() if seq in lane)
        self.lanes[request].remove(seq)
        if not self.lanes[request]:
            self._drop(request)

    def order(self):
        out, lanes = list(self.preempted), [[list(self.lanes[r]), self.owed[r]] for r in self.turns]
        while lanes:
            lane = lanes.pop(0)
            if lane[1]:
                lane[1] -= 1
                lanes.append(lane)
                continue
            out.append(lane[0].pop(0))
            if lane[0]:
                lanes.append(lane)
        return out


@pytest.mark.parametrize("seed", range(20))
def test_waiting_queue_keeps_the_order_of_its_list_model(seed):
    rng = random.Random(seed)
    queue, model, next_id = WaitingQueue(), ListModel(), 0
    for _ in range(2000):
        order = model.order()
        op = rng.choice(["append", "append", "appendleft", "push_first", "popleft", "pop_new", "remove", "remove",
                         "remove"])
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
        elif op == "pop_new":
            assert queue.new_head() is model.new_head()
            if model.new_head() is not None:
                assert queue.pop_new() is model.pop_new()
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


def test_a_new_request_is_admitted_ahead_of_its_turn_once_then_passes_its_next_turn():
    queue = WaitingQueue()
    flood = [make_seq(i, [1]) for i in range(4)]
    group = [make_seq(10 + i, [1]) for i in range(3)]
    queue.extend(flood, request=0)
    assert queue.new_head() is flood[0] and queue.popleft() is flood[0]  # an ordinary turn: no longer new
    queue.extend(group, request=1)
    small = make_seq(20, [1])
    queue.append(small, request=2)
    assert queue.new_head() is group[0] and queue.pop_new() is group[0]
    assert queue.new_head() is small and queue.pop_new() is small and queue.new_head() is None
    # the group had its turn ahead: the flood's turn comes first, then the group's
    assert list(queue) == [flood[1], flood[2], group[1], flood[3], group[2]]
    preempted = make_seq(30, [1])
    queue.appendleft(preempted)
    queue.append(make_seq(31, [1]), request=3)
    assert queue.new_head() is None  # a preempted sequence goes first, new or not
