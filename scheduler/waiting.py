"""The scheduler's queue of waiting sequences: preempted sequences first, then the requests' sequences in turn.

A request (one `Scheduler.add`, its samples included) has a lane of its own; the lanes take turns, one sequence per
turn, so a request of a thousand samples queued first holds a one-sequence request after it for one admission, not a
thousand (round-robin, as a fair queue serves its flows). A preempted sequence goes before every lane (it was
running; recomputing it comes first), the most recently preempted first.

A removed sequence (an abort) leaves a tombstone in place, skipped by every read and dropped when it reaches the front
of its lane; a lane is compacted when its tombstones outnumber its sequences, and a lane left empty leaves the turns
when its turn comes (or when such lanes outnumber the others), so `remove` takes O(1) amortized time and memory
stays linear in the sequences queued."""
from collections import deque
from collections.abc import Iterable, Iterator

from scheduler.sequence import Sequence


class _Lane:
    """Sequences in order, as [sequence] entries; [None] is a tombstone."""

    __slots__ = ("items", "live", "dead", "request", "new", "owed")

    def __init__(self, request: int | None):
        self.items: deque[list] = deque()
        self.live = 0
        self.dead = 0
        self.request = request  # None: the lane of preempted sequences
        self.new = False  # a request none of whose sequences was admitted yet (`WaitingQueue.new_head`)
        self.owed = 0  # turns it passes: it had one ahead of them (`WaitingQueue.pop_new`)

    def head(self) -> list | None:
        while self.items and self.items[0][0] is None:
            self.items.popleft()
            self.dead -= 1
        return self.items[0] if self.items else None

    def kill(self, entry: list) -> None:
        entry[0] = None
        self.live -= 1
        self.dead += 1
        if self.dead > max(self.live, 32):
            self.items = deque(e for e in self.items if e[0] is not None)
            self.dead = 0

    def __iter__(self) -> Iterator[Sequence]:
        return (e[0] for e in self.items if e[0] is not None)


class WaitingQueue:
    """Sequences in admission order, each at most once (keyed by `seq_id`): `[0]` is the next to admit."""

    def __init__(self):
        self._preempted = _Lane(None)
        self._lanes: dict[int, _Lane] = {}  # request -> its lane, while it has sequences waiting
        self._turns: deque[_Lane] = deque()  # lanes in the order of their next turn; emptied ones until passed
        self._empty_turns = 0  # emptied lanes still in `_turns`
        self._entries: dict[int, tuple[list, _Lane]] = {}  # seq_id -> its entry and lane
        self._new: deque[_Lane] = deque()  # lanes of new requests, oldest first; ones no longer new until passed

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __iter__(self) -> Iterator[Sequence]:
        """Every waiting sequence in the order it would be admitted if nothing else changed."""
        yield from self._preempted
        turns = deque([iter(lane), lane.owed] for lane in self._turns if lane.live)
        while turns:
            if turns[0][1]:
                turns[0][1] -= 1
                turns.rotate(-1)
                continue
            seq = next(turns[0][0], None)
            if seq is None:
                turns.popleft()
            else:
                yield seq
                turns.rotate(-1)

    def __getitem__(self, index: int) -> Sequence:
        """Only the head (index 0) is ever read."""
        if index != 0:
            raise IndexError("a WaitingQueue reads only its head")
        lane = self._head_lane()
        if lane is None:
            raise IndexError("the waiting queue is empty")
        return lane.head()[0]

    def _check_absent(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq.seq_id in self._entries:
                raise ValueError(f"sequence {seq.seq_id} is already waiting")

    def _entry(self, seq: Sequence, lane: _Lane) -> list:
        entry = [seq]
        self._entries[seq.seq_id] = entry, lane
        lane.live += 1
        return entry

    def _lane(self, request: int, first: bool) -> _Lane:
        """`request`'s lane; a new one takes its turn last, or with `first` next."""
        lane = self._lanes.get(request)
        if lane is None:
            lane = self._lanes[request] = _Lane(request)
            (self._turns.appendleft if first else self._turns.append)(lane)
        return lane

    def append(self, seq: Sequence, request: int) -> None:
        """`seq` last in the lane of `request` (a new request's lane takes its turn after every other)."""
        self._check_absent([seq])
        created = request not in self._lanes
        lane = self._lane(request, first=False)
        if created:
            while self._new and not (self._new[0].new and self._new[0].live):  # admitted or emptied since
                self._new.popleft().new = False
            lane.new = True
            self._new.append(lane)
        lane.items.append(self._entry(seq, lane))

    def extend(self, seqs: Iterable[Sequence], request: int) -> None:
        for seq in seqs:
            self.append(seq, request)

    def push_first(self, seqs: Iterable[Sequence], request: int) -> None:
        """`seqs`, in order, first in the lane of `request`, which keeps its turn, or without one takes the next."""
        seqs = list(seqs)
        self._check_absent(seqs)
        if seqs:
            lane = self._lane(request, first=True)
            lane.items.extendleft(reversed([self._entry(seq, lane) for seq in seqs]))

    def appendleft(self, seq: Sequence) -> None:
        """A preempted sequence: before every other."""
        self._check_absent([seq])
        self._preempted.items.appendleft(self._entry(seq, self._preempted))

    def popleft(self) -> Sequence:
        """The head; its lane's turn ends (one sequence per turn)."""
        lane = self._head_lane()
        if lane is None:
            raise IndexError("pop from an empty waiting queue")
        seq = lane.items.popleft()[0]
        del self._entries[seq.seq_id]
        lane.live -= 1
        lane.new = False
        if lane is not self._preempted:
            self._turns.popleft()
            if lane.live:
                self._turns.append(lane)
            else:
                del self._lanes[lane.request]
        return seq

    def pass_turn(self) -> bool:
        """The head's request passes its turn: its lane goes after every other (a request at its bound of running
        sequences, `Scheduler._admit`). False, and nothing changes, when the head is a preempted sequence (it has no
        turn: it goes first) or nothing waits."""
        lane = self._head_lane()
        if lane is None or lane is self._preempted:
            return False
        self._turns.rotate(-1)
        return True

    def new_head(self) -> Sequence | None:
        """The next sequence of the oldest request none of whose sequences was admitted yet, if one waits (nothing
        preempted waits). The scheduler admits it ahead of its turn (`pop_new`), in a step of its own, so that a
        request's first token waits for no one else's prefill."""
        if self._preempted.head() is not None:
            return None
        while self._new and (not self._new[0].new or self._new[0].head() is None):
            self._new.popleft().new = False
        return self._new[0].head()[0] if self._new else None

    def pop_new(self) -> Sequence:
        """Takes `new_head()` out of the queue; its request is no longer new, and keeps its place in the turns."""
        if self.new_head() is None:
            raise IndexError("no new request waits")
        lane = self._new.popleft()
        lane.new = False
        seq = lane.items.popleft()[0]
        del self._entries[seq.seq_id]
        lane.live -= 1
        if lane.live == 0:
            self._emptied(lane)
        else:
            lane.owed += 1
        return seq

    def remove(self, seq: Sequence) -> None:
        found = self._entries.get(seq.seq_id)
        if found is None or found[0][0] is not seq:
            raise ValueError(f"sequence {seq.seq_id} is not waiting")
        entry, lane = self._entries.pop(seq.seq_id)
        lane.kill(entry)
        if lane.live == 0 and lane is not self._preempted:
            self._emptied(lane)

    def _emptied(self, lane: _Lane) -> None:
        """A request's lane has no sequence left: its turn passes when it comes."""
        del self._lanes[lane.request]
        self._empty_turns += 1
        if self._empty_turns > max(len(self._turns) - self._empty_turns, 32):
            self._turns = deque(lane for lane in self._turns if lane.live)
            self._empty_turns = 0

    def _head_lane(self) -> _Lane | None:
        """The lane of the next sequence to admit (None: nothing waits)."""
        if self._preempted.head() is not None:
            return self._preempted
        while self._turns:
            lane = self._turns[0]
            if lane.head() is None:
                self._turns.popleft()
                self._empty_turns -= 1
            elif lane.owed:
                lane.owed -= 1
                self._turns.rotate(-1)
            else:
                return lane
        return None
