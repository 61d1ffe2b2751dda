"""n > 1 forks: the parent prefills its prompt up to the fork point (the last block boundary below the final prompt
token); then each child mounts those full KV blocks by refcount, gets its own live slot restored from the parent's
live slot (a fork op), and computes the rest of the prompt itself (at most block_size tokens: the last partial block
is recomputed, never copied). A child that cannot be forked at that moment (no row, block, slot or budget), or whose
parent finds the fork point already in the prefix cache, runs as an ordinary request instead.
"""
from scheduler.plan import ScheduledSequence
from scheduler.sequence import Sequence, SequenceStatus


class ForkScheduling:
    """The `Scheduler`'s n > 1 forks: its `forks`, `fork_parent` and `fork_rank` (set up by `Scheduler.add`)."""

    def _pop_forks(self, parent_id: int) -> list[Sequence]:
        """Forget that `parent_id` has children waiting to fork from it; returns them."""
        _, children = self.forks.pop(parent_id)
        del self.fork_rank[parent_id]
        for child in children:
            del self.fork_parent[child.seq_id]
        return children

    def _release_forks(self, parent_id: int) -> None:
        """The children of `parent_id` become ordinary sequences of its request, first in its lane of the waiting
        queue, which takes the next turn unless it has one already."""
        children = self._pop_forks(parent_id)
        if children:
            self.waiting.push_first(children, children[0].lane)
        self.counters["fork_fallbacks"] += len(children)

    def _schedule_forks(self, rows: list[ScheduledSequence], budget: int, parents: set[int] | None = None) -> int:
        """Fork the children of every parent that has just computed its fork point (before anything in this step
        advances the parent), in the order the parents were added; the ones that do not fit now run as ordinary
        requests. Adds to `parents` the parents that forked a child. Returns the budget left. Only running parents
        are looked at: a queued one cannot fork, and a step's work must not grow with the queue."""
        running = self._running_per_request()
        ready = [s.seq_id for s in self.running
                 if s.seq_id in self.forks and s.num_computed_tokens == self.forks[s.seq_id][0]]
        for parent_id in sorted(ready, key=self.fork_rank.__getitem__):
            point, children = self.forks[parent_id]
            parent = self.seqs[parent_id]
            left = []
            for child in children:
                need = len(child.token_ids) - point
                if (len(self.running) >= self.config.max_num_seqs or need > budget or self._at_bound(running, child)
                        or not self.block_manager.can_fork(child, point)):
                    left.append(child)
                    continue
                op = self.block_manager.fork(child, parent, point)
                del self.fork_parent[child.seq_id]
                if parents is not None:
                    parents.add(parent_id)
                child.num_computed_tokens = point
                child.status = SequenceStatus.RUNNING
                child.kv_match = child.num_cached_tokens = point
                child.num_admissions = 1
                self.running.append(child)
                if running is not None:
                    running[child.lane] += 1
                budget -= need
                rows.append(self._row(child, len(child.token_ids), op))
                self.counters["forks"] += 1
            self.forks[parent_id] = (point, left)
            if left:  # they restore the parent's state at the fork point instead of prefilling the prompt
                self.block_manager.keep_state(parent, point)
            self._release_forks(parent_id)
        return budget
