"""How steps are compiled: XLA options per step kind, the garbage collector paused while lowering, compile threads."""

from __future__ import annotations

import contextlib
import functools
import gc
import threading

import jax
import jax.numpy as jnp
import numpy as np

from gdn_jax import envs
from gdn_jax.worker import executable_store as executables
from gdn_jax.model.dense import dense, seconds_of


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
    bits = envs.optional_int(DECODE_VECTOR_BITS_ENV)
    if bits is not None:
        return bits
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
    if kind == "prefill" and "xla_backend_optimization_level" not in envs.get("XLA_FLAGS"):
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
    threads = envs.optional_int("GDN_JAX_COMPILE_THREADS")
    if threads is not None:
        return threads
    return max(1, min(executables.usable_cores(), COMPILE_THREADS_MAX))


# Sampling, compiled per (rows, vocabulary, history width) and shared by every step shape of that many rows: a
# separate executable from the forward, so that the forward's grid (rows x tokens per row) does not compile the
# sampling (sort, top-k, penalties: 1-1.5 s of CPU at Qwen3.5-9B's vocabulary) once per shape.
