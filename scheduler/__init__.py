"""Pure-Python scheduler: sequences, KV and linear-state prefix caches, step plans. No JAX."""
from scheduler.composite import CompositeBlockManager, PrefixMatch
from scheduler.config import SchedulerConfig
from scheduler.hashing import chain_hashes, domain_seed
from scheduler.kv_cache import BlockManagerImpl
from scheduler.linear_cache import LinearStateBlockManager, LinearStatePrefixCache, deepest_hit_at_or_below
from scheduler.plan import CheckpointSave, LinearStateCacheOp, ScheduledSequence, StepPlan
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence, SequenceStatus

__all__ = [
    "BlockManagerImpl", "CompositeBlockManager", "LinearStateBlockManager", "LinearStateCacheOp",
    "CheckpointSave", "LinearStatePrefixCache", "PrefixMatch", "SamplingParams", "ScheduledSequence", "Scheduler",
    "SchedulerConfig", "Sequence", "SequenceStatus", "StepPlan", "chain_hashes",
    "deepest_hit_at_or_below", "domain_seed",
]
