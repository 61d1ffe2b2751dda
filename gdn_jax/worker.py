"""The worker: device state pools and one jitted step (restore -> forward -> sample) over a bucketed batch.

The step plan arrives as plain Python data from the scheduler; the worker pads it to bucketed shapes (batch rows,
tokens per row, blocks per row) so a steady workload never recompiles, validates the linear-state ops on the host
(fail closed), and runs `_step` with the state donated.

The model's graph definition is closed over once per graphdef (`step_function`), not passed as a static argument:
a static argument is hashed on every call, and hashing an NNX graphdef costs tens of milliseconds. The parameters
travel as a flat list of arrays (flattened by the C++ dispatch path, not by NNX's Python pytree hooks).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from gdn_jax.config import ModelConfig
from gdn_jax.model import Batch, forward, init_state
from gdn_jax.restore import ops_to_arrays, restore_sources, validate_cache_ops
from gdn_jax.sampling import sample


def _bucket(n: int, lo: int, hi: int) -> int:
    """Smallest power of two >= n, clamped to [lo, hi]."""
    return min(max(lo, 1 << max(0, math.ceil(math.log2(max(n, 1))))), hi)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    bytes_per_kv_block: int
    bytes_per_linear_slot: int
    num_kv_blocks: int
    num_linear_slots: int

    @property
    def total_bytes(self) -> int:
        return self.num_kv_blocks * self.bytes_per_kv_block + self.num_linear_slots * self.bytes_per_linear_slot

    def describe(self) -> str:
        mib = 1 << 20
        return (f"KV: {self.num_kv_blocks} blocks x {self.bytes_per_kv_block / 1024:.1f} KiB; "
                f"linear state: {self.num_linear_slots} slots x {self.bytes_per_linear_slot / 1024:.1f} KiB; "
                f"total {self.total_bytes / mib:.1f} MiB")


def plan_memory(cfg: ModelConfig, dtype, block_size: int, max_num_seqs: int, max_model_len: int,
                num_kv_blocks: int | None, num_linear_slots: int | None, memory_budget_bytes: int) -> MemoryPlan:
    """Sizes the pools; counts given explicitly win, otherwise they come from the memory budget."""
    itemsize = jnp.dtype(dtype).itemsize
    per_block = 2 * len(cfg.full_layer_ids) * block_size * cfg.num_key_value_heads * cfg.head_dim * itemsize
    per_slot = len(cfg.linear_layer_ids) * (
        (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim * itemsize
        + cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4)
    if num_linear_slots is None:
        if per_slot == 0:
            num_linear_slots = 1
        else:  # slot 0 + one live slot per sequence + checkpoints, within a quarter of the budget
            room = max(0, memory_budget_bytes // 4 // per_slot - 1 - max_num_seqs)
            num_linear_slots = 1 + max_num_seqs + min(room, 8 * max_num_seqs)
    if num_kv_blocks is None:
        want = 1 + 2 * max_num_seqs * math.ceil(max_model_len / block_size)  # room for full concurrency, twice
        if per_block == 0:
            num_kv_blocks = want
        else:
            left = memory_budget_bytes - num_linear_slots * per_slot
            num_kv_blocks = max(2, min(want, left // per_block))
    return MemoryPlan(per_block, per_slot, num_kv_blocks, num_linear_slots)


def _step(graphdef, params, state, batch_arrays, live_ids, restore_requested, src_ids, temperature, top_k, top_p,
          seeds, counters):
    # per-request, per-position keys: reproducible whatever the batch composition
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.PRNGKey(s), c))(seeds, counters)
    # the restore is the forward's read of the initial state: from the source slot, written to the live slot
    initial_state_ids, has_initial_state = restore_sources(live_ids, restore_requested, src_ids)
    batch = Batch(*batch_arrays, linear_ids=live_ids, has_initial_state=has_initial_state,
                  initial_state_ids=initial_state_ids)
    logits, state = forward(graphdef, params, batch, state)
    return (state, *sample(logits, temperature, top_k, top_p, keys))


@functools.lru_cache(maxsize=None)
def step_function(graphdef, params_def):
    """The jitted step for one model structure: `(param_leaves, state, batch_arrays, ...)`, the state donated.
    Cached per (graphdef, params treedef), so workers of the same model share compiled executables, and both are
    hashed here, once, not per call."""

    def step(param_leaves, state, *args):
        return _step(graphdef, jax.tree.unflatten(params_def, param_leaves), state, *args)

    return jax.jit(step, donate_argnums=(1,))


@dataclasses.dataclass
class StepResult:
    tokens: np.ndarray          # [rows] sampled token per scheduled row
    logprobs: np.ndarray        # [rows] logprob of the sampled token
    top_ids: np.ndarray         # [rows, MAX_LOGPROBS]
    top_logprobs: np.ndarray    # [rows, MAX_LOGPROBS]


class Worker:
    def __init__(self, cfg: ModelConfig, graphdef, params, memory: MemoryPlan, block_size: int, max_num_seqs: int,
                 max_model_len: int, chunk_stride: int, dtype, seed: int = 0):
        self.cfg, self.graphdef, self.params = cfg, graphdef, params
        self.memory, self.block_size = memory, block_size
        self.max_rows = _bucket(max_num_seqs, 1, 1 << 30)
        self.max_blocks = math.ceil(max_model_len / block_size)
        self.max_chunk = chunk_stride
        self.seed = seed
        self.state = init_state(cfg, memory.num_kv_blocks, block_size, memory.num_linear_slots, dtype)
        self._param_leaves, params_def = jax.tree.flatten(params)
        self._fn = step_function(graphdef, params_def)
        self.num_compilations = 0  # step compilations this worker triggered (cached executables are shared)

    def _buckets(self, lo: int, hi: int) -> list[int]:
        return sorted({_bucket(n, lo, hi) for n in range(1, hi + 1)})

    def shape_buckets(self) -> list[tuple[int, int, int]]:
        """Every (rows, tokens per row, blocks per row) shape `execute` can produce; T = 1 is decode."""
        rows = self._buckets(1, self.max_rows)
        tokens = [1] + self._buckets(min(16, self.max_chunk), self.max_chunk)
        blocks = self._buckets(min(8, self.max_blocks), self.max_blocks)
        return [(b, t, nb) for b in rows for t in tokens for nb in blocks]

    @staticmethod
    def _padding_args(B: int, T: int, NB: int) -> tuple:
        """Step arguments (after params and state) of an all-padding batch: writes land in block 0 / slot 0 only."""
        z = np.zeros((B, T), np.int32)
        batch_arrays = (z, np.zeros(B, np.int32), np.zeros(B, np.int32), np.zeros((B, NB), np.int32), z)
        return (batch_arrays, *ops_to_arrays([], B), np.zeros(B, np.float32), np.zeros(B, np.int32),
                np.ones(B, np.float32), np.zeros(B, np.uint32), np.zeros(B, np.int32))

    def warm_up(self) -> int:
        """Compiles the step for every shape bucket on an all-padding batch. Afterwards no workload compiles
        again. Returns the number of shapes."""
        shapes = self.shape_buckets()
        for shape in shapes:
            self._run(*self._padding_args(*shape))
        jax.block_until_ready(self.state)
        return len(shapes)

    def compiled_step(self, shape: tuple[int, int, int]):
        """The step's XLA executable for one (rows, tokens, blocks) bucket, compiled ahead of time (for inspection:
        `.as_text()`, `.memory_analysis()`); the worker's state is not touched."""
        return self._fn.lower(self._param_leaves, self.state, *self._padding_args(*shape)).compile()

    def _run(self, *args):
        before = self._fn._cache_size()
        out = self._fn(self._param_leaves, self.state, *args)
        self.num_compilations += self._fn._cache_size() - before
        self.state = out[0]
        return out[1:]

    def execute(self, plan) -> StepResult:
        """Runs one step plan (all-prefill or all-decode) and returns the sampled tokens per row."""
        seqs = plan.seqs
        n = len(seqs)
        longest = max(len(s.token_ids) for s in seqs)
        if n > self.max_rows or longest > (self.max_chunk if plan.is_prefill else 1):
            raise ValueError(f"step plan of {n} rows x {longest} tokens exceeds the worker's shapes "
                             f"({self.max_rows} rows, {self.max_chunk if plan.is_prefill else 1} tokens per row)")
        B = _bucket(n, 1, self.max_rows)
        T = 1 if not plan.is_prefill else _bucket(longest, 16, self.max_chunk)
        NB = _bucket(max(len(s.block_table) for s in seqs), 8, self.max_blocks)
        tokens = np.zeros((B, T), np.int32)
        slot_mapping = np.zeros((B, T), np.int32)  # padding tokens write into block 0
        start = np.zeros(B, np.int32)
        lengths = np.zeros(B, np.int32)
        tables = np.zeros((B, NB), np.int32)
        temperature = np.zeros(B, np.float32)
        top_k = np.zeros(B, np.int32)
        top_p = np.ones(B, np.float32)
        seeds = np.zeros(B, np.uint32)
        counters = np.zeros(B, np.int32)
        for i, s in enumerate(seqs):
            m = len(s.token_ids)
            tokens[i, :m] = s.token_ids
            slot_mapping[i, :m] = s.slot_mapping
            start[i], lengths[i] = s.start_pos, m
            tables[i, :len(s.block_table)] = s.block_table
            sp = s.sampling_params
            temperature[i], top_k[i], top_p[i] = sp.temperature, max(sp.top_k, 0), sp.top_p
            seeds[i] = sp.seed if sp.seed is not None else (self.seed * 1_000_003 + s.seq_id) & 0xFFFFFFFF
            counters[i] = s.num_generated
        ops = [s.linear_op for s in seqs if s.linear_op is not None]
        if self.cfg.linear_layer_ids:
            if len(ops) != n:
                raise ValueError("every scheduled row of a model with GDN layers needs a LinearStateCacheOp")
            validate_cache_ops(ops, self.memory.num_linear_slots)
        live, requested, src = ops_to_arrays(ops, B)
        batch_arrays = (tokens, start, lengths, tables, slot_mapping)
        out = self._run(batch_arrays, live, requested, src, temperature, top_k, top_p, seeds, counters)
        toks, lp, top_ids, top_lp = jax.device_get(out)
        return StepResult(toks[:n], lp[:n], top_ids[:n], top_lp[:n])
