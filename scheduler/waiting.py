"""The scheduler's queue of waiting sequences: a deque whose `remove` (an abort) takes O(1) amortized time.

A removed sequence leaves a tombstone in place, skipped by every read and dropped when it reaches the front; the
queue is compacted when tombstones outnumber the sequences, so memory and iteration stay linear in the sequences
queued. Aborting a whole queue in any order costs time linear in its length, where `deque.remove` searched it
once per abort (quadratic)."""
from collections import deque
from collections.abc import Iterable, Iterator

from scheduler.sequence import Sequence


class WaitingQueue:
    """Sequences in scheduling order, each at most once (keyed by `seq_id`)."""

    def __init__(self):
        self._items: deque[list] = deque()  # [sequence] entries; [None] is a tombstone
        self._entries: dict[int, list] = {}  # seq_id -> its entry
        self._dead = 0  # tombstones in _items

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __iter__(self) -> Iterator[Sequence]:
        return (e[0] for e in self._items if e[0] is not None)

    def __getitem__(self, index: int) -> Sequence:
        """Only the head (index 0) is ever read."""
        if index != 0:
            raise IndexError("a WaitingQueue reads only its head")
        self._drop_leading()
        if not self._items:
            raise IndexError("the waiting queue is empty")
        return self._items[0][0]

    def _entry(self, seq: Sequence) -> list:
        if seq.seq_id in self._entries:
            raise ValueError(f"sequence {seq.seq_id} is already waiting")
        entry = self._entries[seq.seq_id] = [seq]
        return entry

    def append(self, seq: Sequence) -> None:
        self._items.append(self._entry(seq))

    def extend(self, seqs: Iterable[Sequence]) -> None:
        for seq in seqs:
            self.append(seq)

    def appendleft(self, seq: Sequence) -> None:
        self._items.appendleft(self._entry(seq))

    def insert(self, index: int, seqs: Iterable[Sequence]) -> None:
        """Puts `seqs`, in order, before the sequence now at `index` (at the end past the last). Costs O(index) plus
        the tombstones passed, which are dropped: the queue inserts only near its head."""
        entries, head = [self._entry(seq) for seq in seqs], []
        while self._items and len(head) < index:
            passed = self._items.popleft()
            if passed[0] is None:
                self._dead -= 1
            else:
                head.append(passed)
        self._items.extendleft(reversed(entries))
        self._items.extendleft(reversed(head))

    def popleft(self) -> Sequence:
        self._drop_leading()
        if not self._items:
            raise IndexError("pop from an empty waiting queue")
        seq = self._items.popleft()[0]
        del self._entries[seq.seq_id]
        return seq

    def remove(self, seq: Sequence) -> None:
        entry = self._entries.get(seq.seq_id)
        if entry is None or entry[0] is not seq:
            raise ValueError(f"sequence {seq.seq_id} is not waiting")
        del self._entries[seq.seq_id]
        entry[0] = None
        self._dead += 1
        if self._dead > max(len(self._entries), 32):
            self._items = deque(e for e in self._items if e[0] is not None)
            self._dead = 0

    def _drop_leading(self) -> None:
        while self._items and self._items[0][0] is None:
            self._items.popleft()
            self._dead -= 1
