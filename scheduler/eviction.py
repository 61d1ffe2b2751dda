"""Which unpinned checkpoint an eviction takes: the least recently used (`LRUEviction`, vLLM's and SGLang's rule), or
the one of least utility by Marconi's FLOP-aware score (`FlopAwareEviction`).

Both see the same candidates: the unpinned checkpoints, oldest use first, each with the prefix length it holds the
state of (its depth) and the logical time of its last use (a counter of the index's inserts and restores, so that a
trace gives the same choices on every run).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

EVICTION_POLICIES = ("lru", "flop_aware")


@dataclass(frozen=True)
class PrefillCost:
    """FLOPs to prefill a prefix of L tokens: `linear` per token (every matrix, the GDN rule) plus `quadratic` per
    (query, earlier-or-same key) pair (attention's scores and values over every full-attention layer)."""

    linear: float = 1.0
    quadratic: float = 0.0

    def flops(self, tokens: int) -> float:
        return self.linear * tokens + self.quadratic * tokens * (tokens + 1) / 2


class LRUEviction:
    """The least recently used unpinned checkpoint."""

    name = "lru"

    def victim(self, candidates: OrderedDict, depth_of: dict, last_used: dict) -> int:
        return next(iter(candidates))


class FlopAwareEviction:
    """Marconi's eviction (Pan et al., "Marconi: Prefix Caching for the Era of Hybrid LLMs", MLSys 2025,
    arXiv 2411.19379, section 4.2): each candidate's utility is its recency plus `alpha` times its FLOP efficiency,
    both min-max normalised over the candidates, and the lowest utility goes (ties: the least recently used).

    FLOP efficiency is the compute a hit saves per byte the entry holds. A hit on a checkpoint at depth L saves the
    prefill of those L tokens (`PrefillCost.flops`, attention's quadratic part included). Every checkpoint holds one
    state slot of the same size (its KV blocks are shared, and evicted by the KV cache's own rule), so the bytes are a
    constant that the normalisation removes: the efficiency term ranks by the FLOPs saved. With alpha = 0 this is
    LRU. The paper tunes alpha by replaying recent requests (its "retrospective bootstrapping"); here alpha is a
    setting."""

    name = "flop_aware"

    def __init__(self, cost: PrefillCost, alpha: float = 1.0):
        if alpha < 0:
            raise ValueError(f"the FLOP-aware eviction's alpha must be >= 0, got {alpha}")
        self.cost, self.alpha = cost, alpha

    def utilities(self, candidates: OrderedDict, depth_of: dict, last_used: dict) -> dict[int, float]:
        """Candidate slot -> utility (recency + alpha x FLOP efficiency, each normalised to [0, 1])."""
        recency = {s: float(last_used[s]) for s in candidates}
        efficiency = {s: self.cost.flops(depth_of[s]) for s in candidates}
        r, e = _normalised(recency), _normalised(efficiency)
        return {s: r[s] + self.alpha * e[s] for s in candidates}

    def victim(self, candidates: OrderedDict, depth_of: dict, last_used: dict) -> int:
        utility = self.utilities(candidates, depth_of, last_used)
        return min(candidates, key=lambda s: utility[s])  # min keeps the first (least recent) of equals


def _normalised(values: dict) -> dict:
    low, high = min(values.values()), max(values.values())
    span = high - low
    return {k: (v - low) / span if span else 0.0 for k, v in values.items()}


def eviction_policy(name: str, cost: PrefillCost = PrefillCost(), alpha: float = 1.0):
    """The policy called `name` (`EVICTION_POLICIES`)."""
    if name == "lru":
        return LRUEviction()
    if name == "flop_aware":
        return FlopAwareEviction(cost, alpha)
    raise ValueError(f"checkpoint_eviction must be one of {EVICTION_POLICIES}, got {name!r}")
