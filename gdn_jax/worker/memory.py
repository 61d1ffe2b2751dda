"""The memory plan: how many KV blocks and linear-state slots the pools get."""

from __future__ import annotations

import dataclasses
import math
import warnings

import jax
import jax.numpy as jnp

from gdn_jax.diagnostics import user_stacklevel
from gdn_jax.config import GPU_MEMORY_UTILIZATION, EngineConfig, ModelConfig
from gdn_jax.worker.host_tier import compressed_entry_bytes


CPU_MEMORY_BUDGET_BYTES = 2 << 30   # pools' budget on a device that reports no memory size (the CPU)
CHECKPOINTS_PER_SEQ_MAX = 8         # the default plan never holds more checkpoint slots than this per sequence


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    bytes_per_kv_block: int
    bytes_per_linear_slot: int
    num_kv_blocks: int
    num_linear_slots: int
    max_num_seqs: int = 0
    devices: int = 1  # the pools are split over this many devices (tensor parallelism); the bytes are per device
    # checkpoints compressed on the device (`checkpoint_dtype`), in the bytes that float32 checkpoint slots would hold
    num_compressed_checkpoints: int = 0
    bytes_per_compressed_checkpoint: int = 0
    checkpoint_dtype: str = "float32"
    # speculative decoding: the slots a verify step writes each sequence's state into after each draft (k per
    # sequence), so that a rejection keeps the state of the last accepted position
    num_draft_slots: int = 0

    @property
    def total_bytes(self) -> int:
        return (self.num_kv_blocks * self.bytes_per_kv_block + self.num_linear_slots * self.bytes_per_linear_slot
                + self.num_compressed_checkpoints * self.bytes_per_compressed_checkpoint)

    @property
    def num_checkpoint_slots(self) -> int:
        """Slots beyond padding slot 0 and one live slot per sequence: the room checkpoints always have."""
        return (max(0, self.num_linear_slots - 1 - self.max_num_seqs - self.num_draft_slots)
                if self.bytes_per_linear_slot else 0)

    def describe(self) -> str:
        mib = 1 << 20
        linear = (f"linear state: {self.num_linear_slots} slots x {self.bytes_per_linear_slot / mib:.2f} MiB "
                  f"(1 padding + {self.max_num_seqs} live + "
                  f"{f'{self.num_draft_slots} draft + ' if self.num_draft_slots else ''}"
                  f"{self.num_checkpoint_slots} checkpoint); "
                  if self.bytes_per_linear_slot else "")
        if self.num_compressed_checkpoints:
            linear += (f"{self.num_compressed_checkpoints} {self.checkpoint_dtype} checkpoints x "
                       f"{self.bytes_per_compressed_checkpoint / mib:.2f} MiB; ")
        each = f" per device (the pools split {self.devices} ways)" if self.devices > 1 else ""
        return (f"KV: {self.num_kv_blocks} blocks x {self.bytes_per_kv_block / 1024:.1f} KiB; {linear}"
                f"total {self.total_bytes / mib:.1f} MiB{each}")


def default_memory_budget(params_bytes: int, gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
                          device=None) -> int:
    """Bytes for the KV and linear-state pools. On a device that reports its memory (a GPU): this engine's share,
    `gpu_memory_utilization` of what XLA may allocate there (`memory_stats()["bytes_limit"]`: by default 75% of the
    GPU's memory, XLA_PYTHON_CLIENT_MEM_FRACTION sets it), minus its weights (on the device already). The share is
    per engine, as vLLM's is per instance: two engines of one process at 0.45 each fit where one at 0.9 does; a share
    that does not fit beside what the process holds there already (another engine's weights and pools) is a
    ValueError naming both, not an allocation failure later. Elsewhere (the CPU, or a device that reports no limit,
    which warns) `CPU_MEMORY_BUDGET_BYTES`."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return CPU_MEMORY_BUDGET_BYTES
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        warnings.warn(f"the {device.platform} device reports no memory limit (memory_stats: {sorted(stats)}), so the "
                      f"pools get the CPU's {CPU_MEMORY_BUDGET_BYTES / 2**30:.0f} GiB budget: pass memory_budget_bytes "
                      f"(or num_kv_blocks and num_linear_slots) to size them", RuntimeWarning,
                      stacklevel=user_stacklevel())
        return CPU_MEMORY_BUDGET_BYTES
    gib, share = 2**30, int(gpu_memory_utilization * limit)
    others = max(0, stats.get("bytes_in_use", 0) - params_bytes)  # other engines' weights and pools
    if share + others > limit:
        raise ValueError(f"gpu_memory_utilization {gpu_memory_utilization:g} asks for {share / gib:.2f} GiB of the "
                         f"{limit / gib:.2f} GiB XLA may allocate on the device, but {others / gib:.2f} GiB of it are "
                         f"held already (another engine's weights and pools): release an engine no longer used "
                         f"before building the next (in a notebook: `del llm; gc.collect()`), or give each engine of "
                         f"a process its share (e.g. 0.45 for two)")
    if share <= params_bytes:
        raise ValueError(f"the weights ({params_bytes / gib:.2f} GiB) leave no room for the caches in "
                         f"{gpu_memory_utilization:.0%} of the {limit / gib:.2f} GiB XLA may allocate on the device "
                         f"(by default 75% of its memory; XLA_PYTHON_CLIENT_MEM_FRACTION, set before JAX starts, "
                         f"changes it)")
    return share - params_bytes


def plan_memory(cfg: ModelConfig, config: EngineConfig, memory_budget_bytes: int | None = None,
                devices: int = 1) -> MemoryPlan:
    """Sizes the pools of model `cfg` under `config` (its dtype, cache and scheduling settings); the pool counts
    `config` gives win, otherwise they come from `memory_budget_bytes` (default `config.cache.memory_budget_bytes`;
    the engine sizes an unset one from the device, `default_memory_budget`).

    Linear-state slots: slot 0 (padding), one live slot per sequence, and checkpoint room: with prefix caching on at
    least one checkpoint slot per sequence, more (up to `CHECKPOINTS_PER_SEQ_MAX` per sequence) while they fit in a
    quarter of the budget. KV blocks take the rest, up to twice what full concurrency needs; at least one whole
    sequence of `max_model_len` must fit. A minimum that does not fit the budget is an error naming both pools.
    `devices`: the pools are split by heads over that many devices (`cfg` in their layout, `sharding.tp_config`);
    the budget and every byte count are then per device.
    """
    cache, max_num_seqs, max_model_len = config.cache, config.scheduling.max_num_seqs, config.scheduling.max_model_len
    block_size, num_kv_blocks, num_linear_slots = cache.block_size, cache.num_kv_blocks, cache.num_linear_slots
    if memory_budget_bytes is None:
        memory_budget_bytes = cache.memory_budget_bytes
    if memory_budget_bytes is None and (num_kv_blocks is None or num_linear_slots is None):
        raise ValueError("plan_memory needs a memory budget where a pool count is not given")
    itemsize = jnp.dtype(config.dtype).itemsize
    per_block = 2 * cfg.num_kv_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * itemsize // devices
    per_slot = len(cfg.linear_layer_ids) * (
        (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim * itemsize
        + cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4) // devices
    caches_linear = cache.enable_prefix_caching and per_slot > 0
    drafts = config.num_speculative_tokens * max_num_seqs if per_slot else 0
    live = 1 + max_num_seqs + drafts  # (the draft slots are live states of the verify steps)
    if num_linear_slots is not None and caches_linear and num_linear_slots < live + 1:
        raise ValueError(f"num_linear_slots={num_linear_slots} leaves no room for a checkpoint with prefix caching on: "
                         f"slot 0 is padding and max_num_seqs={max_num_seqs} need live slots, so at least "
                         f"{live + 1} are needed ({live + max_num_seqs} for one checkpoint per sequence)")
    min_blocks = 1 + math.ceil(max_model_len / block_size)
    if num_linear_slots is None:
        if per_slot == 0:
            num_linear_slots = 1
        else:
            min_slots = live + (max_num_seqs if caches_linear else 0)
            need = min_slots * per_slot + (0 if num_kv_blocks is not None else min_blocks * per_block)
            if need > memory_budget_bytes:
                raise ValueError(
                    f"the memory budget ({memory_budget_bytes / 2**20:.1f} MiB) cannot hold the minimum pools: "
                    f"{min_slots} linear-state slots x {per_slot / 2**20:.2f} MiB (padding, {max_num_seqs} live, "
                    f"{min_slots - live} checkpoint) + {min_blocks} KV blocks x {per_block / 2**10:.1f} KiB; "
                    f"raise memory_budget_bytes or lower max_num_seqs / max_model_len")
            extra = 0
            if caches_linear:
                quarter = memory_budget_bytes // 4 // per_slot - min_slots
                fits = (memory_budget_bytes - need) // per_slot
                extra = max(0, min(quarter, fits, (CHECKPOINTS_PER_SEQ_MAX - 1) * max_num_seqs))
            num_linear_slots = min_slots + extra
    if num_kv_blocks is None:
        want = 1 + 2 * max_num_seqs * math.ceil(max_model_len / block_size)  # room for full concurrency, twice
        if per_block == 0:
            num_kv_blocks = want
        else:
            left = memory_budget_bytes - num_linear_slots * per_slot
            if left // per_block < min_blocks:
                raise ValueError(
                    f"the memory budget ({memory_budget_bytes / 2**20:.1f} MiB) minus {num_linear_slots} linear-state "
                    f"slots x {per_slot / 2**20:.2f} MiB leaves {max(left, 0) / 2**20:.1f} MiB for KV, less than one "
                    f"sequence of max_model_len={max_model_len} needs ({min_blocks} blocks x {per_block / 2**10:.1f} KiB)")
            num_kv_blocks = min(want, left // per_block)
    compressed = {}
    if cache.checkpoint_dtype != "float32" and caches_linear:
        compressed = _compressed_checkpoints(cfg, cache.checkpoint_dtype, num_linear_slots - live, max_num_seqs,
                                             per_slot)
        num_linear_slots = live + compressed.pop("staging")
    return MemoryPlan(per_block, per_slot, num_kv_blocks, num_linear_slots, max_num_seqs, devices,
                      num_draft_slots=drafts, **compressed)


def _compressed_checkpoints(cfg: ModelConfig, dtype: str, slots: int, max_num_seqs: int, per_slot: int) -> dict:
    """The checkpoint room of `slots` float32 slots with `checkpoint_dtype` `dtype`: a few stay float32 slots, which a
    step writes its checkpoints into before they are compressed (so they bound the checkpoints one step saves), up to
    one per sequence and half of them; the bytes of the others hold compressed checkpoints."""
    staging = max(1, min(max_num_seqs, slots // 2))
    entry = compressed_entry_bytes(len(cfg.linear_layer_ids), (cfg.linear_conv_kernel_dim - 1, cfg.conv_dim),
                                   (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
                                   dtype)
    return dict(staging=staging, num_compressed_checkpoints=(slots - staging) * per_slot // entry,
                bytes_per_compressed_checkpoint=entry, checkpoint_dtype=dtype)
