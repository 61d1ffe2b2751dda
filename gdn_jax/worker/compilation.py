"""How steps are compiled: XLA options per step kind, the garbage collector paused while lowering, compile threads."""

from __future__ import annotations

import contextlib
import gc
import threading

import jax

from gdn_jax import envs
from gdn_jax.backends.cpu import tuning
from gdn_jax.backends.cpu.tuning import LLVM_IR_CPU_COMPILER_OPTIONS, vector_width_options
from gdn_jax.backends.cpu.tuning import DECODE_VECTOR_BITS  # noqa: F401 (scripts read it here)
from gdn_jax.model.forms import Forms

# XLA options of the step and sampling executables on the CPU backend (`compiler_options`). XLA's CPU fusion emitters
# (MLIR, the default) spend most of a step's compilation generating and optimizing the code of its elementwise
# fusions; the older LLVM IR emitters (`LLVM_IR_CPU_COMPILER_OPTIONS`) compile a prefill shape much faster,
# and the prefill runs as fast: its time is in the matmuls, library calls either way. Decode steps of fewer than
# DECODE_DEFAULT_EMITTER_ROWS rows and sampling compile with them too, with less CPU time, and run as fast. A decode
# step of 32 rows or more keeps XLA's defaults: with the older emitters it ran a little slower. Those narrow decode
# steps also choose LLVM's vector width (`Forms.decode_vector_bits`, measured per machine and dtype:
# `tuning.decode_vector_bits`): a one-row step's time is its matrix-vector products, loops that stream the weights,
# and which width streams them faster depends on the CPU and the dtype; at 2-16 rows and in prefill the width makes
# no difference. The options are part of the persistent cache's key and of the executable store's
# (scripts/bench/bench_compile_options.py; docs/design.md, "Compiling the step"; figures in docs/benchmarks.md).
DECODE_DEFAULT_EMITTER_ROWS = 32


# Prefill steps compile at optimisation level 1 (LLVM's O1 pipeline) instead of XLA's default, 3. A step of 64 tokens
# per row or more spends its time in the library's matmuls, and the code LLVM generates for its elementwise fusions runs
# as fast at O1 (the logits as at level 3), while the shape compiles markedly faster. Shorter chunks (16 and 32 tokens
# per row: prompt tails, short prompts) compile faster at O1 and run a little slower (their elementwise fusions are
# more of their time); level 2 costs them the same and compiles no faster. They take O1 too: at the larger models'
# shapes they were the prefill shapes that compiled slowest, and the executable store spares a later start their
# compilation, but not a first start nor one after an edit of the package. An optimisation level named in XLA_FLAGS
# (`--xla_backend_optimization_level`) holds instead (scripts/bench/bench_compile_options.py; docs/design.md, "Compiling the
# step"; figures in docs/benchmarks.md).
PREFILL_OPT_LEVEL = 1


def executable_kind(rows: int, tokens: int) -> str:
    """The kind of a step shape's executable, as `compiler_options` and `step_function` tell them apart: "prefill"
    (more than one token per row), "decode" (fewer than DECODE_DEFAULT_EMITTER_ROWS rows) or "decode_wide"."""
    if tokens > 1:
        return "prefill"
    return "decode" if rows < DECODE_DEFAULT_EMITTER_ROWS else "decode_wide"


def compiler_options(kind: str, forms: Forms | None = None) -> dict | None:
    """On the CPU backend: the LLVM IR emitters at `forms.decode_vector_bits` for a "decode" step (`executable_kind`;
    the step's `forms` are then required), `LLVM_IR_CPU_COMPILER_OPTIONS` for "sample", and those at
    `PREFILL_OPT_LEVEL` for a "prefill" step (unless XLA_FLAGS names an optimisation level); XLA's defaults otherwise
    ("decode_wide", and every kind on an accelerator). Deterministic forms compile every kind alike: the same loop
    body must round the same way in a prefill, a decode and a sampling program."""
    if kind not in ("prefill", "decode", "decode_wide", "sample"):
        raise ValueError(f"kind must be 'prefill', 'decode', 'decode_wide' or 'sample', got {kind!r}")
    if kind == "decode_wide" or jax.default_backend() != "cpu" or (forms is not None and forms.deterministic):
        return None
    if kind == "decode":
        if forms is None:
            raise ValueError("a 'decode' step's options depend on its forms' vector width: pass them")
        return vector_width_options(forms.decode_vector_bits)
    if kind == "prefill" and "xla_backend_optimization_level" not in envs.get("XLA_FLAGS"):
        return LLVM_IR_CPU_COMPILER_OPTIONS | {"xla_backend_optimization_level": PREFILL_OPT_LEVEL}
    return dict(LLVM_IR_CPU_COMPILER_OPTIONS)


# Lowering a step (tracing it, then emitting its StableHLO) allocates hundreds of thousands of Python objects that
# live until it ends, and so sets off Python's cyclic garbage collector over and over, its full collections included:
# each of those walks every object of the process (hundreds of thousands once a large model's warm-up is under way)
# and finds almost nothing to free (a lowering leaves a few thousand objects in cycles). So
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
    return max(1, min(tuning.usable_cores(), COMPILE_THREADS_MAX))


# Sampling, compiled per (rows, vocabulary, history width) and shared by every step shape of that many rows: a
# separate executable from the forward, so that the forward's grid (rows x tokens per row) does not compile the
# sampling (sort, top-k, penalties: seconds of CPU at a large vocabulary) once per shape.
