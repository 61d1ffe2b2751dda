"""Which stride boundaries a "scan" prefill row saves as checkpoints: every one it crosses (`"stride"`), or the ones a
dynamic program over the shared-prefix lengths seen so far finds most useful (`OverlapPlacement`, `"overlap"`).
`"end_of_turn"` saves what "stride" does and also where a chat's next turn starts: the end of each prompt and of
each output so far, at the KV block boundary at or below it (the scheduler does this with `keep_state`).
"""
from __future__ import annotations

from collections import Counter, deque

from scheduler.eviction import PrefillCost

PLACEMENTS = ("stride", "overlap", "end_of_turn")


class OverlapPlacement:
    """Checkpoint placement from the observed overlap, after Sparse Prefix Caching (arXiv 2605.05219): a checkpoint
    at boundary i (i strides) serves a later request that shares s >= i strides with this sequence, when no
    deeper checkpoint of it is <= s. With P(s >= i) from the shared-prefix lengths seen at the last `window`
    admissions (the KV match, in whole strides), a set i_1 < ... < i_k saves in expectation
    sum_j flops(i_j) * (P(s >= i_j) - P(s >= i_{j+1})); the dynamic program (the paper's, exact) finds the set of at
    most `per_sequence` boundaries of largest expected FLOPs saved. Until `warm` admissions were seen it places
    every boundary, as "stride" does."""

    def __init__(self, stride: int, cost: PrefillCost, per_sequence: int, window: int = 256, warm: int = 8):
        self.stride, self.cost, self.per_sequence, self.warm = stride, cost, max(1, per_sequence), warm
        self.shared: deque[int] = deque(maxlen=window)

    def observe(self, kv_match: int) -> None:
        """An admission shared `kv_match` tokens with the cache."""
        self.shared.append(kv_match // self.stride)

    def boundaries(self, strides: int) -> set[int] | None:
        """The boundaries (in strides, 1..`strides`) a sequence of `strides` whole strides saves; None: all of
        them (not enough admissions seen yet)."""
        if len(self.shared) < self.warm or strides < 1:
            return None
        counts, total = Counter(min(s, strides) for s in self.shared), len(self.shared)
        tail = [0.0] * (strides + 2)  # tail[i] = P(s >= i)
        for i in range(strides, 0, -1):
            tail[i] = tail[i + 1] + counts[i] / total
        gain = [self.cost.flops(i * self.stride) for i in range(strides + 1)]
        # best[c][i]: the largest value of c boundaries whose shallowest is i; after[c][i] the next one (0: none)
        best = [[0.0] * (strides + 1) for _ in range(self.per_sequence + 1)]
        after = [[0] * (strides + 1) for _ in range(self.per_sequence + 1)]
        for i in range(1, strides + 1):
            best[1][i] = gain[i] * tail[i]
        for c in range(2, self.per_sequence + 1):
            for i in range(1, strides + 1):
                best[c][i], after[c][i] = best[1][i], 0
                for j in range(i + 1, strides + 1):
                    value = gain[i] * (tail[i] - tail[j]) + best[c - 1][j]
                    if value > best[c][i]:
                        best[c][i], after[c][i] = value, j
        value, c, i = max((best[c][i], c, i) for c in range(1, self.per_sequence + 1) for i in range(1, strides + 1))
        if value <= 0:
            return set()
        chosen = set()
        while i:
            chosen.add(i)
            i, c = after[c][i], c - 1
        return chosen
