"""The worker: device state pools and one jitted step (restore -> forward -> sample) over a bucketed batch.

The step plan arrives as plain Python data from the scheduler; the worker pads it to bucketed shapes (batch rows,
tokens per row; the block tables always have the largest width, which costs nothing: attention loops over the keys
the rows hold; one rule, `Worker.step_shape`) so a steady workload never recompiles, validates the linear-state ops on
the host (fail closed), and runs `_step` on the step's `Batch` (a pytree of host arrays, the restores folded in) with
the state donated, then `sample_function()`. A mixed plan (prefill and decode rows) runs as its two sub-batches, one
executable each (see docs/design.md, "Mixed prefill + decode steps").

The model's graph definition is closed over once per graphdef (`step_function`), not passed as a static argument:
a static argument is hashed on every call, and hashing an NNX graphdef costs tens of milliseconds. The parameters
travel as a flat list of arrays (flattened by the C++ dispatch path, not by NNX's Python pytree hooks).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import gc
import math
import os
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from gdn_jax import executables
from gdn_jax.config import ModelConfig
from gdn_jax.gated_delta import default_chunk_size
from gdn_jax.model import Batch, dense, forward, init_state, seconds_of
from gdn_jax.restore import RestoreOps, validate_cache_ops
from gdn_jax.sampling import SamplingMetadata, sample
from scheduler.sampling_params import MAX_LOGPROBS


def _bucket(n: int, lo: int, hi: int) -> int:
    """Smallest power of two >= n, clamped to [lo, hi]."""
    return min(max(lo, 1 << max(0, math.ceil(math.log2(max(n, 1))))), hi)


CPU_MEMORY_BUDGET_BYTES = 2 << 30   # pools' budget on a device that reports no memory size (the CPU)
GPU_MEMORY_UTILIZATION = 0.9        # default fraction of an accelerator's memory for weights + pools
CHECKPOINTS_PER_SEQ_MAX = 8         # the default plan never holds more checkpoint slots than this per sequence


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    bytes_per_kv_block: int
    bytes_per_linear_slot: int
    num_kv_blocks: int
    num_linear_slots: int
    max_num_seqs: int = 0

    @property
    def total_bytes(self) -> int:
        return self.num_kv_blocks * self.bytes_per_kv_block + self.num_linear_slots * self.bytes_per_linear_slot

    @property
    def num_checkpoint_slots(self) -> int:
        """Slots beyond padding slot 0 and one live slot per sequence: the room checkpoints always have."""
        return max(0, self.num_linear_slots - 1 - self.max_num_seqs) if self.bytes_per_linear_slot else 0

    def describe(self) -> str:
        mib = 1 << 20
        linear = (f"linear state: {self.num_linear_slots} slots x {self.bytes_per_linear_slot / mib:.2f} MiB "
                  f"(1 padding + {self.max_num_seqs} live + {self.num_checkpoint_slots} checkpoint); "
                  if self.bytes_per_linear_slot else "")
        return (f"KV: {self.num_kv_blocks} blocks x {self.bytes_per_kv_block / 1024:.1f} KiB; {linear}"
                f"total {self.total_bytes / mib:.1f} MiB")


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
        from gdn_jax.engine import _outside_package  # (engine imports this module)
        warnings.warn(f"the {device.platform} device reports no memory limit (memory_stats: {sorted(stats)}), so the "
                      f"pools get the CPU's {CPU_MEMORY_BUDGET_BYTES / 2**30:.0f} GiB budget: pass memory_budget_bytes "
                      f"(or num_kv_blocks and num_linear_slots) to size them", RuntimeWarning,
                      stacklevel=_outside_package())
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


def plan_memory(cfg: ModelConfig, dtype, block_size: int, max_num_seqs: int, max_model_len: int,
                num_kv_blocks: int | None, num_linear_slots: int | None, memory_budget_bytes: int,
                enable_prefix_caching: bool = True) -> MemoryPlan:
    """Sizes the pools; counts given explicitly win, otherwise they come from the memory budget.

    Linear-state slots: slot 0 (padding), one live slot per sequence, and checkpoint room: with prefix caching on at
    least one checkpoint slot per sequence, more (up to `CHECKPOINTS_PER_SEQ_MAX` per sequence) while they fit in a
    quarter of the budget. KV blocks take the rest, up to twice what full concurrency needs; at least one whole
    sequence of `max_model_len` must fit. A minimum that does not fit the budget is an error naming both pools.
    """
    itemsize = jnp.dtype(dtype).itemsize
    per_block = 2 * len(cfg.full_layer_ids) * block_size * cfg.num_key_value_heads * cfg.head_dim * itemsize
    per_slot = len(cfg.linear_layer_ids) * (
        (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim * itemsize
        + cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4)
    caches_linear = enable_prefix_caching and per_slot > 0
    live = 1 + max_num_seqs
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
    return MemoryPlan(per_block, per_slot, num_kv_blocks, num_linear_slots, max_num_seqs)


def host_batch(tokens, start_pos, lengths, block_tables, slot_mapping, ops: RestoreOps, saves) -> Batch:
    """The step's `Batch` as host arrays, its restores folded into the forward's read of the initial state: from
    the source slot, written to the live slot (a copy: the source is never written). `saves`: (rows, offsets, slots)
    of the checkpoints the step writes, or None."""
    initial_state_ids, has_initial_state = ops.sources()
    return Batch(tokens, start_pos, lengths, block_tables, slot_mapping, linear_state_ids=ops.linear_state_ids,
                 has_initial_state=has_initial_state, initial_state_ids=initial_state_ids,
                 **dict(zip(("save_rows", "save_offsets", "save_slots"), saves or (None,) * 3)))


def _step(graphdef, params, rule, state, batch: Batch):
    """The forward of one step: (state, logits [B, V]). Sampling is its own executable (`sample_function`). `rule`:
    the chunked GDN rule's (chunk size, schedule)."""
    logits, state = forward(graphdef, params, batch, state, chunk_size=rule[0], gdn_schedule=rule[1])
    return state, logits


def _step_prompt_logprobs(graphdef, params, rule, state, batch: Batch, targets, full_rows):
    """`_step` plus the log-distribution at every position of the chunk (prompt logprobs). A separate executable,
    so that steps without a prompt-logprobs row never pay for [B, T, V] logits. targets[b, t]: the prompt token at
    position start + t + 1, scored by the logits of position start + t. `full_rows` (static) also returns every row."""
    logits, state = forward(graphdef, params, batch, state, all_logits=True, chunk_size=rule[0],
                            gdn_schedule=rule[1])  # [B, T, V]
    last = jnp.take_along_axis(logits, jnp.maximum(batch.lengths - 1, 0)[:, None, None], axis=1)[:, 0]
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    target_lp = jnp.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]  # [B, T]
    rank = 1 + jnp.sum(logprobs > target_lp[..., None], axis=-1, dtype=jnp.int32)
    top_lp, top_ids = jax.lax.top_k(logprobs, min(MAX_LOGPROBS, logits.shape[-1]))
    prompt = (target_lp, rank, top_ids.astype(jnp.int32), top_lp) + ((logprobs,) if full_rows else ())
    return state, last, prompt


# XLA options of the step and sampling executables on the CPU backend. XLA's CPU fusion emitters (MLIR, the default)
# spend most of a step's compilation generating and optimizing the code of its elementwise fusions; the older LLVM IR
# emitters compile a Qwen3.5-9B prefill shape about twice as fast, and the prefill runs as fast: its time is in the
# matmuls, library calls either way. Decode steps of fewer than DECODE_DEFAULT_EMITTER_ROWS rows and sampling compile
# with them too (20-35% less CPU time each at Qwen3.5-9B's shapes), and run as fast (hybrid-1024, 1-16 rows,
# bfloat16 and float32: within 1%; sampling at Qwen3.5-9B's vocabulary: the same). A decode step of 32 rows or more
# keeps XLA's defaults: with the older emitters it took 0-2% more time at 32 rows, 3-5% at 64 in bfloat16
# (scripts/bench_compile_options.py; docs/design.md, "Compiling the step"). The options are part of the persistent
# cache's key and of the executable store's.
LLVM_IR_CPU_COMPILER_OPTIONS = {"xla_cpu_use_fusion_emitters": False}
DECODE_DEFAULT_EMITTER_ROWS = 32
# Those decode steps also choose LLVM's vector width (XLA prefers 256 bits; `decode_vector_bits`). A one-row step's
# time is its matrix-vector products, loops that stream the weights, and which width streams them faster depends on the
# CPU and the dtype: on an AVX-512 Xeon 512-bit registers run a one-row step 11-15% faster in either dtype
# (hybrid-1024: bfloat16 16.0 -> 14.3 ms, float32 22.0 -> 18.8 ms, median), on an AMD EPYC (Zen 4, whose 512-bit
# operations take two passes) float32 runs 1.5x slower with them and bfloat16 ~25% faster. So the width is measured,
# once per machine and dtype (kept beside the persistent cache), on the step's own form of product. 2-16 rows and
# prefill: the same within 1-2% either way, so only these steps take it. A CPU without AVX-512 vectorises at 256 bits
# either way. docs/design.md, "Compiling the step".
DECODE_VECTOR_BITS_ENV = "GDN_JAX_DECODE_VECTOR_BITS"  # "256" or "512": no measurement
DECODE_VECTOR_BITS = (256, 512)
DECODE_VECTOR_ROUNDS, DECODE_VECTOR_MARGIN = 15, 0.05


def vector_width_options(bits: int) -> dict:
    """The LLVM IR emitters, vectorised at `bits` bits: a narrow decode step's XLA options on the CPU backend."""
    return LLVM_IR_CPU_COMPILER_OPTIONS | {"xla_cpu_prefer_vector_width": bits}


def decode_compiler_options(dtype) -> dict:
    """The XLA options of a narrow decode step of a `dtype` model on the CPU backend: the LLVM IR emitters, vectorised
    at `decode_vector_bits(dtype)` bits."""
    return vector_width_options(decode_vector_bits(jnp.dtype(dtype).name))


@functools.cache
def decode_vector_bits(dtype: str, timer=None) -> int:
    """LLVM's vector width (256 or 512 bits) under which this CPU streams a one-row product of `dtype` weights faster:
    `DECODE_VECTOR_BITS_ENV` if set, else measured once per machine and dtype (`executables.remembered`: kept beside
    JAX's persistent cache, else measured once per process; 256 off the CPU, where the width means nothing). The
    probe is the step's own form of product (`model.dense` of one row, compiled with the LLVM IR emitters at each
    width) over 8 matrices of 4096 x 1024 in `dtype` (128 MB in float32, 64 in bfloat16: more than the 32 MB
    L3 cache of the AMD EPYC development machines, as a model's weights are). The two compiled forms run in turn
    `DECODE_VECTOR_ROUNDS` times; 512 bits only if the median of the rounds' time ratios is `DECODE_VECTOR_MARGIN`
    below 1 (a tie keeps XLA's preference, so that a machine where the widths tie does not switch between them, and
    between stored executables, from one start to the next). `timer(bits, fn, *args) -> seconds` replaces the clock
    (tests; then nothing is kept). About 0.5 s, on a thread of its own (called while a step is traced, the products
    would be staged into that trace)."""
    env = os.environ.get(DECODE_VECTOR_BITS_ENV)
    if env not in (None, "", "256", "512"):
        raise ValueError(f"{DECODE_VECTOR_BITS_ENV} must be 256 or 512 (unset: measured), got {env!r}")
    if env:
        return int(env)
    if jax.default_backend() != "cpu":
        return DECODE_VECTOR_BITS[0]

    def measure():
        weights = tuple(jnp.full((4096, 1024), 0.01 * (i + 1), dtype) for i in range(8))
        x = jnp.full((1, 1024), 0.5, dtype)
        lowered = jax.jit(lambda x, ws: [dense(x, w) for w in ws]).lower(x, weights)
        fns = {bits: lowered.compile(vector_width_options(bits)) for bits in DECODE_VECTOR_BITS}
        for fn in fns.values():
            jax.block_until_ready(fn(x, weights))
        ratios = []  # each round's 512-bit time over its 256-bit time: a load that comes and goes hits both alike
        for _ in range(DECODE_VECTOR_ROUNDS):
            t256, t512 = ((timer or _seconds)(bits, fns[bits], x, weights) for bits in DECODE_VECTOR_BITS)
            ratios.append(t512 / t256)
        return 512 if np.median(ratios) <= 1 - DECODE_VECTOR_MARGIN else 256

    return executables.measured_choice(f"decode_vector_bits {dtype}", measure, lambda bits: bits in DECODE_VECTOR_BITS,
                                       keep=timer is None)


def _seconds(bits: int, fn, *args) -> float:
    """Wall seconds of one call of `fn` (compiled at `bits`), its outputs ready."""
    return seconds_of(fn, *args)


# Prefill steps compile at optimisation level 1 (LLVM's O1 pipeline) instead of XLA's default, 3. A step of 64 tokens
# per row or more spends its time in the library's matmuls, and the code LLVM generates for its elementwise fusions runs
# as fast at O1, while the shape compiles 20-45% faster (hybrid-1024, 64-2048 tokens, 1-16 rows, both dtypes; run time
# within the noise, the logits as at level 3). Shorter chunks (16 and 32 tokens per row: prompt tails, short prompts)
# compile 12-43% faster at O1 and run 0-5% slower (their elementwise fusions are more of their time); level 2 costs
# them the same and compiles no faster. They take O1 too: at Qwen3.5-9B's shapes they were the prefill shapes that
# compiled slowest, and the executable store spares a later start their compilation, but not a first start nor one
# after an edit of the package. An optimisation level named in XLA_FLAGS (`--xla_backend_optimization_level`) holds
# instead (scripts/bench_compile_options.py; docs/design.md, "Compiling the step").
PREFILL_OPT_LEVEL = 1


def executable_kind(rows: int, tokens: int) -> str:
    """The kind of a step shape's executable, as `compiler_options` and `step_function` tell them apart: "prefill"
    (more than one token per row), "decode" (fewer than DECODE_DEFAULT_EMITTER_ROWS rows) or "decode_wide"."""
    if tokens > 1:
        return "prefill"
    return "decode" if rows < DECODE_DEFAULT_EMITTER_ROWS else "decode_wide"


def compiler_options(kind: str, dtype=None) -> dict | None:
    """On the CPU backend: `decode_compiler_options(dtype)` for a "decode" step (`executable_kind`; `dtype`, the
    model's, is then required), `LLVM_IR_CPU_COMPILER_OPTIONS` for "sample", and those at `PREFILL_OPT_LEVEL` for a
    "prefill" step (unless XLA_FLAGS names an optimisation level); XLA's defaults otherwise ("decode_wide", and every
    kind on an accelerator)."""
    if kind not in ("prefill", "decode", "decode_wide", "sample"):
        raise ValueError(f"kind must be 'prefill', 'decode', 'decode_wide' or 'sample', got {kind!r}")
    if kind == "decode_wide" or jax.default_backend() != "cpu":
        return None
    if kind == "decode":
        if dtype is None:
            raise ValueError("a 'decode' step's options depend on the model's dtype: pass it")
        return decode_compiler_options(dtype)
    if kind == "prefill" and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
        return LLVM_IR_CPU_COMPILER_OPTIONS | {"xla_backend_optimization_level": PREFILL_OPT_LEVEL}
    return dict(LLVM_IR_CPU_COMPILER_OPTIONS)


# Lowering a step (tracing it, then emitting its StableHLO) allocates hundreds of thousands of Python objects that
# live until it ends, and so sets off Python's cyclic garbage collector over and over, its full collections included:
# each of those walks every object of the process (~550k once a Qwen3.5-9B warm-up is under way, 0.3-0.5 s each on
# the development machine) and finds almost nothing to free (a lowering leaves a few thousand objects in cycles). So
# the collector is paused while a step or sampling executable is lowered (`gc_paused`); it runs again afterwards.
_gc_lock = threading.Lock()
_gc_pausers = [0, False]  # lowerings under way, whether the collector was enabled before the first


@contextlib.contextmanager
def gc_paused():
    """Python's garbage collector off inside (as it was before, after the last of concurrent users leaves)."""
    with _gc_lock:
        if _gc_pausers[0] == 0:
            _gc_pausers[1] = gc.isenabled()
            gc.disable()
        _gc_pausers[0] += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pausers[0] -= 1
            if _gc_pausers[0] == 0 and _gc_pausers[1]:
                gc.enable()


# Most threads `Worker.warm_up` compiles on (each compilation holds its own working memory).
COMPILE_THREADS_MAX = 8


def compile_threads_default() -> int:
    """Threads `Worker.warm_up` compiles on: the environment's GDN_JAX_COMPILE_THREADS, or the CPU cores this
    process may use, at most COMPILE_THREADS_MAX."""
    env = os.environ.get("GDN_JAX_COMPILE_THREADS")
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"GDN_JAX_COMPILE_THREADS must be a positive integer, got {env!r}")
        return int(env)
    return max(1, min(executables.usable_cores(), COMPILE_THREADS_MAX))


# Sampling, compiled per (rows, vocabulary, history width) and shared by every step shape of that many rows: a
# separate executable from the forward, so that the forward's grid (rows x tokens per row) does not compile the
# sampling (sort, top-k, penalties: 1-1.5 s of CPU at Qwen3.5-9B's vocabulary) once per shape.
@functools.cache
def sample_function():
    return jax.jit(sample_packed, compiler_options=compiler_options("sample"))


def sample_packed(logits, md: SamplingMetadata):
    """`sample`'s five outputs as one int32 [B, 3 + 2 * MAX_LOGPROBS] array (tokens, the chosen logprob's bits, the
    chosen token's rank, top ids, the top logprobs' bits): the step's result comes back to the host in one transfer,
    not five."""
    tokens, chosen, top_ids, top_lp, rank = sample(logits, md)
    bits = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.int32)
    return jnp.concatenate([tokens[:, None], bits(chosen)[:, None], rank[:, None], top_ids, bits(top_lp)], axis=1)


def unpack_sampled(packed: np.ndarray) -> tuple:
    """`sample_packed`'s host array -> (tokens [B], chosen logprobs [B], chosen ranks [B], top ids [B, K], top
    logprobs [B, K])."""
    k = (packed.shape[1] - 3) // 2
    return (packed[:, 0], packed[:, 1].view(np.float32), packed[:, 2], packed[:, 3:3 + k],
            packed[:, 3 + k:].view(np.float32))


@dataclasses.dataclass
class PromptLogprobs:
    """Per scheduled row and chunk position t: the logprob and rank of the prompt token at start + t + 1."""
    logprobs: np.ndarray        # [rows, T]
    ranks: np.ndarray           # [rows, T]
    top_ids: np.ndarray         # [rows, T, MAX_LOGPROBS]
    top_logprobs: np.ndarray    # [rows, T, MAX_LOGPROBS]
    rows: np.ndarray | None     # [rows, T, V] the whole log-distribution, when a row asked for it


# The step uses every argument, so the steps are jitted with keep_unused: JAX's search for unused arguments is then
# skipped, a dead-code pass over the whole program, through every branch of the layer switches, at each loop level
# until nothing changes (~15% of the emission of a Qwen3.5-9B step, 20-25 ms a shape). What it would still have
# dropped are two batch arrays the layer loops carry unread; XLA drops them as well, and the compiled program is the
# same instruction for instruction (docs/design.md, "Compiling the step").
KEEP_UNUSED = True


@functools.lru_cache(maxsize=None)
def step_function(graphdef, params_def, chunk_size: int, kind: str = "prefill", gdn_schedule: str = "auto",
                  dtype=None):
    """The jitted step for one model structure: `(param_leaves, state, batch)`, the state donated. Cached per
    (graphdef, params treedef, GDN chunk size and schedule, `executable_kind` and the model's dtype: their compile
    options differ), so workers of the same model share compiled executables, and the structure is hashed here, once,
    not per call."""

    def step(param_leaves, state, *args):
        return _step(graphdef, jax.tree.unflatten(params_def, param_leaves), (chunk_size, gdn_schedule), state, *args)

    return jax.jit(step, donate_argnums=(1,), compiler_options=compiler_options(kind, dtype), keep_unused=KEEP_UNUSED)


@functools.lru_cache(maxsize=None)
def prompt_step_function(graphdef, params_def, chunk_size: int, gdn_schedule: str = "auto"):
    """The prompt-logprobs variant of `step_function` (its last argument, `full_rows`, is static)."""

    def step(param_leaves, state, *args):
        return _step_prompt_logprobs(graphdef, jax.tree.unflatten(params_def, param_leaves),
                                     (chunk_size, gdn_schedule), state,
                                     *args)

    return jax.jit(step, donate_argnums=(1,), static_argnums=(4,), compiler_options=compiler_options("prefill"),
                   keep_unused=KEEP_UNUSED)


@dataclasses.dataclass
class StepResult:
    tokens: np.ndarray          # [rows] sampled token per scheduled row
    logprobs: np.ndarray        # [rows] logprob of the sampled token
    ranks: np.ndarray           # [rows] its rank in the whole distribution (1 + the tokens strictly likelier)
    top_ids: np.ndarray         # [rows, MAX_LOGPROBS]
    top_logprobs: np.ndarray    # [rows, MAX_LOGPROBS]
    prompt: PromptLogprobs | None = None


class Worker:
    def __init__(self, cfg: ModelConfig, graphdef, params, memory: MemoryPlan, block_size: int, max_num_seqs: int,
                 max_model_len: int, chunk_stride: int, dtype, seed: int = 0,
                 max_num_batched_tokens: int | None = None,
                 checkpoint_mode: str = "promote", checkpoint_policy: str = "all", enable_prefix_caching: bool = True,
                 gdn_schedule: str = "auto", eos_token_ids: tuple[int, ...] | None = None):
        """`checkpoint_mode` "scan" (the scheduler's; see SchedulerConfig): a prefill row holds up to
        `max_num_batched_tokens` tokens, and a step shape with room for a row to cross a boundary writes up to
        `num_saves(B, T)` checkpoints; "promote": a row holds at most `chunk_stride` tokens and no step writes a
        checkpoint. The chunked GDN rule runs with chunk size gcd(`gated_delta.default_chunk_size()`, chunk_stride),
        so that every boundary is a chunk boundary of a row that starts on one.

        `params` may be abstract (`jax.ShapeDtypeStruct` leaves, `weights.abstract_model`): the pools are then
        abstract too, nothing is allocated, and the worker can only lower and compile (`lowered_step`), as
        scripts/bench_compile.py does for models too large for the machine.

        `gdn_schedule`: the chunked GDN rule's schedule, "auto" (fused on CPU, parallel on accelerators), "fused"
        or "parallel" (`gated_delta.chunk_gated_delta_rule`'s impl; same maths, so a CPU test can run the
        accelerators' schedule through the engine)."""
        self.cfg, self.graphdef, self.params = cfg, graphdef, params
        self.memory, self.block_size = memory, block_size
        self.max_rows = _bucket(max_num_seqs, 1, 1 << 30)
        self.max_blocks = math.ceil(max_model_len / block_size)
        self.stride, self.chunk_size = chunk_stride, math.gcd(default_chunk_size(), chunk_stride)
        self.budget = max_num_batched_tokens or max(chunk_stride, 2048)
        self.scan = checkpoint_mode == "scan"
        self.saves = self.scan and enable_prefix_caching and bool(cfg.linear_layer_ids)
        self.checkpoint_policy = checkpoint_policy
        self.max_chunk = min(self.budget, max_model_len) if self.scan else chunk_stride
        # penalty history width: every step's (prompt + output) fits, whatever its blocks bucket, so sampling has no
        # blocks dimension of its own
        self.history_width = self.max_blocks * block_size
        self.seed, self.dtype = seed, dtype
        # the ids `min_tokens` bans besides a request's stop_token_ids, even with ignore_eos (vLLM's rule): the
        # model's EOS and the further end-of-sequence ids its folder lists
        self.eos_token_ids = (tuple(eos_token_ids) if eos_token_ids is not None
                              else () if cfg.eos_token_id is None else (cfg.eos_token_id,))
        self._param_leaves, params_def = jax.tree.flatten(params)
        self.abstract = any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in self._param_leaves)
        self.state = self._new_state()
        self._fn = step_function(graphdef, params_def, self.chunk_size, gdn_schedule=gdn_schedule)
        self._decode_fn = step_function(graphdef, params_def, self.chunk_size, "decode", gdn_schedule, dtype)
        self._decode_wide_fn = step_function(graphdef, params_def, self.chunk_size, "decode_wide", gdn_schedule)
        # compiled lazily, per prefill shape, the first time a step has a prompt-logprobs row (or by warm_up)
        self._prompt_fn = prompt_step_function(graphdef, params_def, self.chunk_size, gdn_schedule)
        self.gdn_schedule = gdn_schedule
        self._sample = sample_function()
        # warm_up's executables, called directly: ("step", rows, tokens) and ("sample", rows)
        self._executables: dict[tuple, object] = {}
        self._stored: dict[tuple, str] = {}  # those loaded from the executable store: name -> its key there
        self._called: list[tuple] = []  # the store's executables the current step called
        self.executable_dir = executables.default_folder()  # the executable store (None: off)
        self.warm_up_stats = {"loaded": 0, "compiled": 0}
        self.state_resets = 0  # reset_state calls
        self.num_compilations = 0  # step compilations this worker triggered (cached executables are shared)

    def rows_bucket(self, n: int) -> int:
        """Rows of the step shape that holds n scheduled rows: the one rule `execute` pads by and `shape_buckets`
        enumerates."""
        return _bucket(n, 1, self.max_rows)

    def tokens_bucket(self, longest: int, prefill: bool = True) -> int:
        """Tokens per row of the step shape whose longest row has `longest` tokens (a decode step has 1)."""
        return _bucket(longest, min(16, self.max_chunk), self.max_chunk) if prefill else 1

    def shape_buckets(self) -> list[tuple[int, int, int]]:
        """Every (rows, tokens per row, blocks per row) shape `execute` can produce from the scheduler's plans; T = 1
        is decode. The block tables are always `max_blocks` wide: attention loops over the keys the rows hold, not
        over the table (`model.Attention`), so a narrower table would save nothing but cost a compilation per width.

        "scan": the scheduler keeps rows x longest row within the token budget (`Scheduler._row_budget`), so a
        bucket is listed only when the fewest rows and the shortest longest row that land in it fit the budget
        together: with 16 sequences and a budget of 2048, 16 rows x 512 tokens would need 9 rows of at least 257
        tokens, which the scheduler never plans. (A step with forked children can exceed it: their rows are taken
        before that rule applies. Such a shape, like any shape outside this list, compiles on first use.)"""
        def fewest(bucket, hi: int) -> dict[int, int]:  # bucket -> the smallest count that pads to it
            return {bucket(n): n for n in range(hi, 0, -1)}

        rows = sorted(fewest(self.rows_bucket, self.max_rows).items())
        tokens = sorted(fewest(self.tokens_bucket, self.max_chunk).items())
        fits = (lambda n, m: n == 1 or n * m <= self.budget) if self.scan else (lambda n, m: True)
        return [(b, t, self.max_blocks) for b, n in rows
                for t in [1] + [t for t, m in tokens if fits(n, m)]]

    def step_shape(self, rows: int, longest: int, prefill: bool) -> tuple[int, int, int]:
        """The bucket (rows, tokens per row, blocks per row) a step of `rows` rows whose longest row has `longest`
        tokens runs in (`rows_bucket`, `tokens_bucket`; the block tables always have their largest width)."""
        return self.rows_bucket(rows), self.tokens_bucket(longest, prefill), self.max_blocks

    def num_saves(self, B: int, T: int) -> int:
        """Checkpoint writes a (B, T) step shape has room for: each row starts on a boundary, so a row of L tokens
        crosses L // chunk_stride of them ("all") or saves at most one ("last"); all rows together hold at most
        the token budget."""
        if not self.saves or T < self.stride:
            return 0
        per_row = T // self.stride if self.checkpoint_policy == "all" else 1
        return min(B * per_row, self.budget // self.stride)

    def _save_arrays(self, saves, B: int, T: int, start, lengths, ops: RestoreOps):
        """Plan saves -> (rows, offsets, slots) [S] int32, padded with writes to slot 0; None for a shape without
        saves. Checked before dispatch: a save lands on a chunk boundary inside its row, at the position of the
        checkpoint boundary it is indexed under (else the checkpoint would hold another position's state, restored
        as exact), in a slot that no row of the step reads or advances."""
        S = self.num_saves(B, T)
        if len(saves) > S:
            raise ValueError(f"{len(saves)} checkpoint saves for a ({B} x {T}) step with room for {S}")
        if not S:
            return None
        rows, offsets, slots = np.zeros(S, np.int32), np.full(S, self.chunk_size, np.int32), np.zeros(S, np.int32)
        busy = set(ops.linear_state_ids.tolist()) | set(ops.restore_src_slot_ids.tolist())
        for i, sv in enumerate(saves):
            if not 0 <= sv.row < B:  # (a negative row would index the batch from its end)
                raise ValueError(f"save {i}: row {sv.row} is not a row of this {B}-row step")
            if not (0 < sv.offset <= lengths[sv.row] and sv.offset % self.chunk_size == 0):
                raise ValueError(f"save {i}: offset {sv.offset} is not a chunk boundary inside row {sv.row}")
            if start[sv.row] + sv.offset != sv.boundary or sv.boundary % self.stride:
                raise ValueError(f"save {i}: row {sv.row} reaches position {start[sv.row] + sv.offset} at offset "
                                 f"{sv.offset}, not the checkpoint boundary {sv.boundary} (a multiple of chunk_stride "
                                 f"{self.stride}) the save is indexed under")
            if not 1 <= sv.slot < self.memory.num_linear_slots or sv.slot in busy:
                raise ValueError(f"save {i}: slot {sv.slot} is out of range or read or advanced by this step")
            rows[i], offsets[i], slots[i] = sv.row, sv.offset, sv.slot
        if len(set(slots[:len(saves)].tolist())) != len(saves):
            raise ValueError("two checkpoint saves write the same slot")
        return rows, offsets, slots

    def _padding_args(self, B: int, T: int, NB: int) -> tuple:
        """Step arguments (after params and state) of an all-padding batch: writes land in block 0 / slot 0 only."""
        z = np.zeros((B, T), np.int32)
        ops = RestoreOps.from_ops([], B)
        batch = host_batch(z, np.zeros(B, np.int32), np.zeros(B, np.int32), np.zeros((B, NB), np.int32), z, ops,
                           self._save_arrays([], B, T, None, None, ops))
        return batch, SamplingMetadata.padding(B, self.history_width)

    def warm_up(self, prompt_logprobs: bool = False, compile_threads: int | None = None) -> int:
        """Compiles the step for every shape bucket (and sampling for every rows bucket), then runs each step shape
        once on an all-padding batch. Afterwards no workload compiles again. Returns the number of step shapes.
        `prompt_logprobs` also compiles the prompt-logprobs variant (top-k, not whole rows) of every prefill shape,
        which is otherwise compiled lazily. An abstract worker only compiles.

        Each step and sampling executable is first looked up in the executable store (`gdn_jax.executables`, keyed
        without tracing; `executable_dir`, None: off): a second process start loads them without lowering. The
        others: the main thread lowers (traces, in Python) each executable while `compile_threads` background
        threads (default `compile_threads_default()`) compile the ones before (with the store on, afresh: not loaded
        from JAX's persistent cache, `executables.fresh_compilation`): XLA compiles one executable on one core and
        releases the GIL, so on a machine of n cores n compilations run at once. They are then stored. The worker
        calls these executables (`_executables`) directly; shapes outside the grid, and the prompt-logprobs variant,
        go through the jitted functions.
        `warm_up_stats`: how many were loaded, compiled."""
        threads = compile_threads_default() if compile_threads is None else compile_threads
        if threads < 1:
            raise ValueError(f"compile_threads must be at least 1, got {compile_threads}")
        shapes = self.shape_buckets()
        extra = [(B, T, NB) for B, T, NB in shapes if T > 1] if prompt_logprobs else []
        folder, static = self.executable_dir, (repr(self.cfg), self.chunk_size, self.gdn_schedule)
        jobs = ([(("step", B, T), self._key_args(B, T), compiler_options(executable_kind(B, T), self.dtype),
                  functools.partial(self.lowered_step, (B, T, NB))) for B, T, NB in shapes]
                + [(("sample", B), self._sample_key_args(B), compiler_options("sample"),
                    functools.partial(self.lowered_sample, B))
                   for B in self.sample_buckets()])
        keys = [executables.executable_key(name[0], static, args, options) if folder else None
                for name, args, options, _ in jobs]
        with concurrent.futures.ThreadPoolExecutor(2) as loaders:  # deserializing releases the GIL
            found = list(loaders.map(functools.partial(executables.load, folder), keys))
        loaded, pending = 0, []
        fresh = executables.fresh_compilation() if folder else contextlib.nullcontext()  # what the store saves
        with fresh, concurrent.futures.ThreadPoolExecutor(threads) as pool:
            for (name, _, _, lower), key, compiled in zip(jobs, keys, found):
                if compiled is not None:
                    self._executables[name], self._stored[name], loaded = compiled, key, loaded + 1
                else:
                    pending.append((name, key, pool.submit(lower().compile)))
            prompt = [pool.submit(self.lowered_prompt_step(shape).compile) for shape in extra]
            for name, key, future in pending:
                self._executables[name] = future.result()
                executables.save(folder, key, self._executables[name])
            for future in prompt:
                future.result()
        self.warm_up_stats = {"loaded": loaded, "compiled": len(pending) + len(extra)}
        if not self.abstract:
            for shape in shapes:
                self._called = []
                try:
                    jax.block_until_ready((self._run(*self._padding_args(*shape)), self.state))
                except Exception as exc:
                    if not self._drop_stale(exc):
                        raise
                    self.reset_state()  # (the caller's scheduler must drop its view of the pools: `state_resets`)
                    self._run(*self._padding_args(*shape))
            for B, T, NB in extra:
                self._run(*self._padding_args(B, T, NB), np.zeros((B, T), np.int32), False, fn=self._prompt_fn)
            jax.block_until_ready(self.state)
        return len(shapes) + len(extra)

    def _key_args(self, B: int, T: int) -> tuple:
        """The step's arguments for one shape, as the executable store keys them."""
        batch = self._padding_args(B, T, self.max_blocks)[0]
        return (self._param_leaves, self.state, batch)

    def _sample_key_args(self, rows: int) -> tuple:
        return (jax.ShapeDtypeStruct((rows, self.cfg.vocab_size), jnp.float32),
                SamplingMetadata.padding(rows, self.history_width))

    def state_lost(self) -> bool:
        """True when the pools were consumed (donated to a call that then failed) and must be rebuilt."""
        return any(x.is_deleted() for x in jax.tree_util.tree_leaves(self.state))

    def _new_state(self):
        make = functools.partial(init_state, self.cfg, self.memory.num_kv_blocks, self.block_size,
                                 self.memory.num_linear_slots, self.dtype)
        return jax.eval_shape(make) if self.abstract else make()

    def reset_state(self) -> None:
        """Fresh zeroed pools of the same shapes (the scheduler must forget everything they held)."""
        self.state = self._new_state()
        self.state_resets += 1

    def lowered_step(self, shape: tuple[int, int, int]):
        """The step's forward lowered for one (rows, tokens, blocks) bucket (`.compile()` compiles it); the worker's
        state is not touched."""
        batch = self._padding_args(*shape)[0]
        with gc_paused():
            return self._fn_for(batch.tokens).lower(self._param_leaves, self.state, batch)

    def lowered_prompt_step(self, shape: tuple[int, int, int]):
        """The prompt-logprobs forward (top-k, not whole rows) lowered for one prefill bucket."""
        batch = self._padding_args(*shape)[0]
        with gc_paused():
            return self._prompt_fn.lower(self._param_leaves, self.state, batch, np.zeros(shape[:2], np.int32),
                                         False)

    def sample_buckets(self) -> list[int]:
        """The row counts sampling is compiled for: one executable per rows bucket, shared by its step shapes."""
        return sorted({B for B, _, _ in self.shape_buckets()})

    def lowered_sample(self, rows: int):
        """Sampling lowered for one rows bucket."""
        with gc_paused():
            return self._sample.lower(*self._sample_key_args(rows))

    def compiled_step(self, shape: tuple[int, int, int]):
        """The step's XLA executable for one (rows, tokens, blocks) bucket, compiled ahead of time (for inspection:
        `.as_text()`, `.memory_analysis()`); the worker's state is not touched."""
        return self.lowered_step(shape).compile()

    def _fn_for(self, tokens):
        kind = executable_kind(*tokens.shape)  # per step: no mapping built per call
        return self._fn if kind == "prefill" else self._decode_fn if kind == "decode" else self._decode_wide_fn


    def _run(self, batch: Batch, sampling: SamplingMetadata, *extra, fn=None):
        """The step's forward (`fn`, with `extra` arguments), then sampling: (the packed samples (`unpack_sampled`)[,
        prompt logprobs]), on the device."""
        jitted = (self._fn, self._decode_fn, self._decode_wide_fn, self._prompt_fn, self._sample)
        before = sum(f._cache_size() for f in jitted)
        args = (self._param_leaves, self.state, batch, *extra)
        if fn is not None:
            self.state, logits, *prompt = fn(*args)
        else:
            self.state, logits, *prompt = self._call(("step", *batch.tokens.shape), self._fn_for(batch.tokens), args)
        sampled = self._call(("sample", logits.shape[0]), self._sample, (logits, sampling))
        self.num_compilations += sum(f._cache_size() for f in jitted) - before
        return (sampled, *prompt)

    def _call(self, name: tuple, jitted, args: tuple):
        """Calls warm-up's executable `name`, else `jitted`; notes the store's executables it calls (`_drop_stale`)."""
        compiled = self._executables.get(name)
        if compiled is None:
            return jitted(*args)
        if name in self._stored:
            self._called.append(name)
        return compiled(*args)

    def _drop_stale(self, exc: BaseException) -> bool:
        """After a failed step: when `exc` is a missing function (`executables.missing_function`; it surfaces when a
        result is read, so which call failed is not known) and the step called executables the store gave, those are
        deleted from the store and dropped here (the jitted functions compile their shapes from then on). Returns
        whether it dropped any: the caller then recomputes the step."""
        called, self._called = list(dict.fromkeys(self._called)), []
        if not called or not executables.missing_function(exc):
            return False
        from gdn_jax.engine import _outside_package  # (engine imports this module)
        for name in called:
            del self._executables[name]
            executables.discard(self.executable_dir, self._stored.pop(name))
        warnings.warn(f"a step failed in a stored executable ({exc}): deleted from the executable store, compiled "
                      f"again: {', '.join(f'{n[0]} {n[1:]}' for n in called)}", RuntimeWarning,
                      stacklevel=_outside_package())
        return True

    def execute(self, plan, prompt_targets: list[list[int] | None] | None = None, full_rows: bool = False
                ) -> StepResult:
        """Runs one step plan (all-prefill, all-decode or mixed) and returns the sampled tokens per row.

        `prompt_targets[i]` (prefill rows only): the prompt tokens at positions start+1, start+2, ... of row i to
        score from this chunk's logits; when any row has some, the step also returns `StepResult.prompt`."""
        self._called = []
        try:
            if getattr(plan, "is_mixed", False):
                return self._execute_mixed(plan, prompt_targets, full_rows)
            return self._execute_one(plan, prompt_targets, full_rows)
        except Exception as exc:
            if self._drop_stale(exc):
                raise executables.StaleExecutable(str(exc)) from exc
            raise

    def _execute_one(self, plan, prompt_targets, full_rows: bool) -> StepResult:
        """An all-prefill or all-decode plan: one step executable."""
        n, *prepared = self._prepare(plan, prompt_targets)
        return self._collect(n, self._launch(*prepared, full_rows), full_rows)

    def _prepare(self, plan, prompt_targets) -> tuple:
        """The host side of `_execute_one`: every check (fail closed) and the step's arrays, nothing dispatched.
        Returns (rows, batch, sampling, prompt targets [B, T] or None)."""
        seqs = plan.seqs
        n = len(seqs)
        longest = max(len(s.token_ids) for s in seqs)
        if n > self.max_rows or longest > (self.max_chunk if plan.is_prefill else 1):
            raise ValueError(f"step plan of {n} rows x {longest} tokens exceeds the worker's shapes "
                             f"({self.max_rows} rows, {self.max_chunk if plan.is_prefill else 1} tokens per row)")
        B, T, NB = self.step_shape(n, longest, plan.is_prefill)
        tokens = np.zeros((B, T), np.int32)
        slot_mapping = np.zeros((B, T), np.int32)  # padding tokens write into block 0
        start = np.zeros(B, np.int32)
        lengths = np.zeros(B, np.int32)
        tables = np.zeros((B, NB), np.int32)
        for i, s in enumerate(seqs):
            m = len(s.token_ids)
            tokens[i, :m] = s.token_ids
            slot_mapping[i, :m] = s.slot_mapping
            start[i], lengths[i] = s.start_pos, m
            tables[i, :len(s.block_table)] = s.block_table
        ops = [s.linear_op for s in seqs if s.linear_op is not None]
        if self.cfg.linear_layer_ids:
            if len(ops) != n:
                raise ValueError("every scheduled row of a model with GDN layers needs a LinearStateCacheOp")
            validate_cache_ops(ops, self.memory.num_linear_slots, in_place=T == 1)
        restore = RestoreOps.from_ops(ops, B)
        saves = self._save_arrays(getattr(plan, "saves", ()), B, T, start, lengths, restore)
        batch = host_batch(tokens, start, lengths, tables, slot_mapping, restore, saves)
        sampling = SamplingMetadata.from_rows(seqs, B, self.history_width, self.cfg.vocab_size,
                                              self.eos_token_ids, self.seed)
        targets = None
        if plan.is_prefill and prompt_targets and any(prompt_targets):
            targets = np.zeros((B, T), np.int32)
            for i, t in enumerate(prompt_targets):
                targets[i, :len(t or ())] = t or ()
        return n, batch, sampling, targets

    def _launch(self, batch: Batch, sampling: SamplingMetadata, targets, full_rows: bool) -> tuple:
        """Dispatches a `_prepare`d step and its sampling; returns their device results at once, while the device
        runs them (JAX dispatches asynchronously): (the packed samples[, prompt logprobs])."""
        if targets is not None:
            return self._run(batch, sampling, targets, full_rows, fn=self._prompt_fn)
        return self._run(batch, sampling)

    @staticmethod
    def _fetch(launched: tuple) -> tuple:
        """Waits for a launched step and returns its results as host arrays. `np.asarray` gives the same read-only
        view of the result buffer as `jax.device_get`, at a fraction of its cost (~30 against ~160 us per decode
        step of 16 rows)."""
        return jax.tree.map(np.asarray, launched)

    def _collect(self, n: int, launched: tuple, full_rows: bool) -> StepResult:
        """A launched step's first n rows, on the host."""
        packed, *prompt = self._fetch(launched)
        sampled = (a[:n] for a in unpack_sampled(packed))
        if not prompt:
            return StepResult(*sampled)
        rows = prompt[0][4][:n] if full_rows else None
        return StepResult(*sampled, PromptLogprobs(*(a[:n] for a in prompt[0][:4]), rows))

    def _execute_mixed(self, plan, prompt_targets, full_rows: bool) -> StepResult:
        """A mixed plan runs as its prefill sub-batch, then its decode sub-batch: the two executables of the
        all-prefill and all-decode shapes, back to back on the same pools (so a mixed step compiles nothing new,
        and each row's result is bit for bit that of the same row scheduled in a step of its own kind). No decode
        row pads to the prefill length.

        The rows of the two sub-batches touch disjoint slots, which is checked here for the whole step before
        anything runs (fail closed): the linear-state ops of all rows together, no restore source that a decode row
        advances (it would be read after its write) or that a row of the one-token sub-batch reads from a live slot,
        and no checkpoint save into a slot a decode row reads or advances."""
        n = plan.num_prefill_rows
        ops = [s.linear_op for s in plan.seqs if s.linear_op is not None]
        if self.cfg.linear_layer_ids and len(ops) == len(plan.seqs):
            validate_cache_ops(ops, self.memory.num_linear_slots)
            linear_state_ids = {op.linear_state_id for op in ops}
            decode_linear_state_ids = {s.linear_op.linear_state_id for s in plan.decode_seqs}
            decode_restore_src_slot_ids = {s.linear_op.restore_src_slot_id for s in plan.decode_seqs
                                           if s.linear_op.is_warm_restore}
            for i, s in enumerate(plan.seqs):
                op = s.linear_op
                if op.is_warm_restore and op.restore_src_slot_id in (
                        linear_state_ids if i >= n else decode_linear_state_ids):
                    raise ValueError(f"row {i}: restore_src_slot_id {op.restore_src_slot_id} is a live slot that a "
                                     "decode row of this mixed step advances")
            decode_slot_ids = decode_linear_state_ids | decode_restore_src_slot_ids  # once, not once per save
            for sv in plan.saves:
                if sv.slot in decode_slot_ids:
                    raise ValueError(f"save into slot {sv.slot}: a decode row of this mixed step reads or advances it")
        prefill = type(plan)(True, plan.prefill_seqs, plan.saves)
        decode = type(plan)(False, plan.decode_seqs)
        # both sub-batches pass every check of their own before either is dispatched
        (m, *first), (k, *second) = (self._prepare(prefill, prompt_targets[:n] if prompt_targets else None),
                                     self._prepare(decode, None))
        # the decode sub-batch is dispatched while the device runs the prefill one, and both are waited for together
        launched = self._launch(*first, full_rows), self._launch(*second, False)
        first, second = self._collect(m, launched[0], full_rows), self._collect(k, launched[1], False)
        fields = ("tokens", "logprobs", "ranks", "top_ids", "top_logprobs")
        return StepResult(*(np.concatenate([getattr(first, f), getattr(second, f)]) for f in fields),
                          prompt=first.prompt)
