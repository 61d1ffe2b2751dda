"""The CPU's measured choices: which form of a product, and which vector width, this machine runs faster.

Which form wins depends on the CPU (its vector units, whether it has matrix units or bfloat16 dot products), so each
choice is measured on the machine, once, and kept in a per-machine file (`remembered`). `resolve_forms` gathers
them, with the environment's overrides and whether the compiled kernels load, into the one frozen `Forms` value that
a step's trace takes. The engine calls it once, at start; the model never measures, reads the environment or loads
the kernels itself. `measure_again` deletes the kept choices and measures them anew.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from gdn_jax import envs
from gdn_jax.backends.cpu import kernels as cpu_kernels, library
from gdn_jax.diagnostics import user_stacklevel
from gdn_jax.model.dense import dense, library_weight_left, one_row
from gdn_jax.model.forms import VECTOR_BITS, Forms

# The environment's overrides: "1" / "0" decide a choice without measuring it (the vector width: "256" / "512").
UPCAST_ENV = "GDN_JAX_BF16_UPCAST"
FEW_ROWS_ENV = "GDN_JAX_BF16_FEW_ROWS_WEIGHT_LEFT"
ROWS_KERNEL_ENV = "GDN_JAX_BF16_ROWS_KERNEL"  # "1": 2-16 rows, "0": never
F32_ROWS_KERNEL_ENV = "GDN_JAX_F32_ROWS_KERNEL"  # the same for float32 products
DECODE_VECTOR_BITS_ENV = "GDN_JAX_DECODE_VECTOR_BITS"
# Forms that are settings, not measurements.
PREFILL_KV_CHUNK_ENV = "GDN_JAX_PREFILL_KV_CHUNK_KEYS"  # `attention.kv_chunk_keys`
UNROLL_ENV = "GDN_JAX_UNROLL_LAYERS"  # `Forms.unroll`
PAGED_DECODE_ENV = "GDN_JAX_PAGED_DECODE"  # `Forms.paged_decode`, off the CPU

# XLA options of the step and sampling executables on the CPU backend (`worker.compilation.compiler_options`): the
# older LLVM IR fusion emitters, which compile a step much faster than XLA's default MLIR emitters, its time
# being in the matmuls, library calls either way (docs/design.md, "Compiling the step").
LLVM_IR_CPU_COMPILER_OPTIONS = {"xla_cpu_use_fusion_emitters": False}
DECODE_VECTOR_BITS = VECTOR_BITS  # the LLVM vector widths a narrow decode step is measured at (XLA prefers 256)
DECODE_VECTOR_ROUNDS, DECODE_VECTOR_MARGIN = 15, 0.05
FEW_ROWS_ROUNDS, FEW_ROWS_MARGIN = 15, 0.05
ROWS_KERNEL_COUNTS = (4, 8, 16)  # the row counts measured: 2-4 rows take the kernel if it wins at 4, 5-8 at 8, ...
# per dtype of the products: (the variable that decides without measuring, the weights' shape measured on, the name
# the choice is kept under). bfloat16: a 9B-size layer's; float32: a smaller one's, as the float32 models a CPU runs
ROWS_KERNEL_MEASURE = {"bfloat16": (ROWS_KERNEL_ENV, (4096, 1024), "bf16_rows_kernel_chained"),
                       "float32": (F32_ROWS_KERNEL_ENV, (2048, 512), "f32_rows_kernel_chained")}


def vector_width_options(bits: int) -> dict:
    """The LLVM IR emitters, vectorised at `bits` bits: a narrow decode step's XLA options on the CPU backend."""
    return LLVM_IR_CPU_COMPILER_OPTIONS | {"xla_cpu_prefer_vector_width": bits}


def resolve_forms(dtype) -> Forms:
    """The forms the engine's steps of a `dtype` model take on this process's backend, resolved once at engine start:
    the environment's settings, whether the compiled kernels load (`library.available`), and this machine's measured
    choices, read from the per-machine file or measured once (`remembered`). Off the CPU: XLA's generic forms."""
    settings = dict(prefill_kv_chunk_keys=envs.optional_int(PREFILL_KV_CHUNK_ENV), unroll=envs.get(UNROLL_ENV) or "0")
    if jax.default_backend() != "cpu":  # (the paged kernel is opt-in until measured on a GPU)
        return Forms(**settings, paged_decode="on" if envs.optional_bool(PAGED_DECODE_ENV) else "off")
    forms = product_forms(dtype)
    return dataclasses.replace(forms, **settings, decode_vector_bits=decode_vector_bits(jnp.dtype(dtype).name, forms))


def product_forms(dtype) -> Forms:
    """The CPU forms of a `dtype` model's products: the kernels where they load, and for a 16-bit model the measured
    choices of `upcast_is_faster`, `few_rows_weight_left` and `rows_kernel_rows`; for a float32 one, the float32
    `rows_kernel_rows`."""
    forms = Forms(cpu=True, kernels=library.available())
    if jnp.dtype(dtype) == jnp.float32:
        return dataclasses.replace(forms, f32_rows_kernel_rows=rows_kernel_rows(dtype="float32"))
    if jnp.dtype(dtype).itemsize != 2:
        return forms
    return dataclasses.replace(forms, bf16_upcast=upcast_is_faster(), few_rows_weight_left=few_rows_weight_left(),
                               rows_kernel_rows=rows_kernel_rows())


def measure_again(dtypes=("float32", "bfloat16"), cache: str | None = None) -> dict[str, Forms]:
    """Deletes this machine's kept choices (`choices_file(cache)`), measures them anew and keeps them, and returns
    the forms the engine resolves now for each of `dtypes` (what `gdn-jax tune` runs). Choices the environment sets
    are not measured. Needs JAX's persistent cache on (`cache`, or JAX's setting) to keep anything."""
    path = choices_file(cache)
    if path is not None:
        path.unlink(missing_ok=True)
    forget_measured()
    return {jnp.dtype(dtype).name: resolve_forms(dtype) for dtype in dtypes}


# The per-machine file of measured choices


def usable_cores() -> int:
    """The CPU cores this process may use (its affinity where the system has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def choices_file(cache: str | None = None) -> Path | None:
    """Where this machine's measured choices are kept (`remembered`): `machine/<host_cpu>.json` in `cache`, by
    default JAX's persistent compilation cache folder; None when that cache is off."""
    cache = cache or jax.config.jax_compilation_cache_dir
    return Path(cache, "machine", f"{library.host_cpu_tag()}.json") if cache else None


def choice_key(name: str) -> str:
    """A measured choice's key in its file (`remembered`): `name`, the jax and jaxlib versions, and the number of cores
    this process may use."""
    return f"{name} jax={jax.__version__} jaxlib={jaxlib.__version__} cores={usable_cores()}"


_said: set[str] = set()  # the files `remembered` could not write, said once per process


def remembered(name: str, measure, valid, cache: str | None = None):
    """What this machine measured for `name` at an earlier start, else `measure()`, then kept for later starts.

    Near a tie a measurement can come out either way from one start to the next, and each choice changes the
    compiled steps (the executable store's and JAX's cache keys), so a start that chose otherwise would compile them
    again. Kept, a choice is measured once per machine: in `choices_file(cache)` (one per CPU kind, `host_cpu`), under
    `name` and the jax and jaxlib versions and the number of cores this process may use. `measure_again` (or
    deleting the file) measures again.

    A stored value that `valid(value)` refuses, or a file that does not read as JSON, is measured again; a file that
    cannot be written keeps the choice for this process only (said once, a RuntimeWarning). Off (every start
    measures) when JAX's cache is off."""
    path = choices_file(cache)
    if path is None:
        return measure()
    key = choice_key(name)
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet (or unreadable: measured, and written again below)
        stored = {}
    stored = stored if isinstance(stored, dict) else {}
    entry = stored.get(key)
    if isinstance(entry, dict) and "value" in entry and valid(entry["value"]):
        return entry["value"]
    value = measure()
    stored[key] = {"value": value, "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    tmp = None
    try:  # written whole, then renamed: a reader sees the old file or the new one (two writers: the last one wins,
        # and what the other measured is measured again at a later start)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            tmp = f.name
            json.dump(stored, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as exc:
        if tmp:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if str(path) not in _said:
            _said.add(str(path))
            warnings.warn(f"the engine's measured choices cannot be kept in {path} ({exc}): each start measures "
                          f"them again", RuntimeWarning, stacklevel=user_stacklevel())
    return value


_measured: dict[str, object] = {}  # the choices this process measured or read, by name (`measured_choice`)


def measured_choice(name: str, measure, valid, keep: bool = True):
    """`measure()`, kept per machine (`remembered`) and for the rest of the process, unless `keep` is false (a test's
    own timer). The environment's overrides are read before, at every call."""
    if not keep:
        return measure()
    if name not in _measured:
        _measured[name] = remembered(name, measure, valid)
    return _measured[name]


def forget_measured() -> None:
    """Forgets what this process measured or read (`measured_choice`): the next call reads the file again."""
    _measured.clear()


# The measurements


def seconds_of(fn, *args) -> float:
    """Wall seconds of one call of `fn`, its outputs ready."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def _best_seconds(fn, *args, repeats: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    return min(seconds_of(fn, *args) for _ in range(repeats))


def upcast_is_faster(timer=_best_seconds) -> bool:
    """Whether this CPU multiplies a many-row bfloat16 product faster with both operands converted to float32 (the
    conversion included) than with XLA's bfloat16 routine (float32 accumulation): `Forms.bf16_upcast`. Which one
    wins depends on the CPU (docs/benchmarks.md). Measured once per machine (`remembered`; a `timer` other than the
    default keeps nothing) on a prefill-sized product (1024 rows of a 1024 x 2048 weight, best of 5 each), unless
    `UPCAST_ENV` says "1" or "0". The values agree either way to float32 rounding (exact products, float32
    sums in another order)."""
    setting = envs.optional_bool(UPCAST_ENV)
    if setting is not None:
        return setting

    def measure():
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.standard_normal((1024, 1024)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((2048, 1024)), jnp.bfloat16)
        native = jax.jit(lambda x, w: jnp.einsum("md,vd->mv", x, w, preferred_element_type=jnp.float32))
        converted = jax.jit(lambda x, w: jnp.einsum("md,vd->mv", x.astype(jnp.float32), w.astype(jnp.float32)))
        return timer(converted, x, w) < timer(native, x, w)

    return measured_choice("bf16_upcast", measure, lambda faster: isinstance(faster, bool),
                           keep=timer is _best_seconds)


def few_rows_weight_left(timer=None) -> bool:
    """Whether this CPU multiplies bfloat16 products of 1-15 rows (decode steps) faster in XLA's library with the
    weight on the left, W @ x.T, one row padded to two with a zero row, than as XLA's own loop over the weight
    (`dense.one_row`) and x @ W.T: `Forms.few_rows_weight_left`. A CPU with matrix units streams the weight far faster
    in the library at any few rows; others stream it faster in the loop (docs/benchmarks.md).

    Measured once per machine (`remembered`), unless `FEW_ROWS_ENV` says "1" or "0": a one-row product over 8
    bfloat16 matrices of 4096 x 1024, as the loop (at both `DECODE_VECTOR_BITS` widths, the faster of the two each
    round) and as two rows with the weight on the left, in turn `FEW_ROWS_ROUNDS` times; the library form is chosen
    when the median of the rounds' time ratios is `FEW_ROWS_MARGIN` below 1 (a tie keeps the loop). `timer(fn, *args)
    -> seconds` replaces the clock (tests; then nothing is kept). Either way the values agree to float32 summation
    order (exact products of bfloat16 numbers, float32 sums)."""
    setting = envs.optional_bool(FEW_ROWS_ENV)
    if setting is not None:
        return setting
    if jax.default_backend() != "cpu":
        return False

    def measure():
        rng = np.random.default_rng(0)
        weights = tuple(jnp.asarray(rng.standard_normal((4096, 1024)) * 0.02, jnp.bfloat16) for _ in range(8))
        x = jnp.asarray(rng.standard_normal((1, 1024)), jnp.bfloat16)
        loops = [jax.jit(lambda x, ws: [one_row(x[0], w) for w in ws], compiler_options=vector_width_options(bits))
                 for bits in DECODE_VECTOR_BITS]
        library_form = jax.jit(lambda x, ws: [library_weight_left(jnp.concatenate([x, jnp.zeros_like(x)]), w)
                                              for w in ws], compiler_options=LLVM_IR_CPU_COMPILER_OPTIONS)
        for fn in (*loops, library_form):  # compiled and run once, untimed
            jax.block_until_ready(fn(x, weights))
        clock = timer or seconds_of
        ratios = []
        for _ in range(FEW_ROWS_ROUNDS):
            loop = min(clock(fn, x, weights) for fn in loops)
            ratios.append(clock(library_form, x, weights) / loop)
        return float(np.median(ratios)) <= 1 - FEW_ROWS_MARGIN

    return measured_choice("bf16_few_rows_weight_left", measure, lambda v: isinstance(v, bool), keep=timer is None)


def rows_kernel_rows(timer=None, dtype: str = "bfloat16") -> int:
    """The most rows of a `dtype` product (from 2 on) that the compiled few-row kernel multiplies
    (`cpu_kernels.rows_product`) instead of XLA's library with the weight on the left: 0 (none) or one of
    `ROWS_KERNEL_COUNTS` (`Forms.rows_kernel_rows`, `Forms.f32_rows_kernel_rows`). On a CPU without matrix units XLA
    streams the weight of a product of 2-16 bfloat16 rows far slower than that of one row, where the kernel reads
    each weight row once for all the rows; a CPU with matrix units multiplies them there. At float32, XLA's library
    spends more per call on a few rows than the kernel (docs/benchmarks.md).

    Measured once per machine and dtype (`remembered`), unless its variable (`ROWS_KERNEL_MEASURE`) says "1" (16) or
    "0" (0), where the kernels load (`library.available`; else 0): for each of `ROWS_KERNEL_COUNTS`, in turn
    `FEW_ROWS_ROUNDS` times over 8 matrices of the dtype's shape, the kernel against the library's form, each
    product's rows feeding the next's (`_chained`, as a decode step's products follow one another: products that do
    not depend on one another would run side by side on XLA's threads and share the kernel's); the count is taken
    while the median of the rounds' time ratios is `FEW_ROWS_MARGIN` below 1. `timer(fn, *args) -> seconds` replaces the clock (tests; then nothing
    is kept). The values agree to float32 summation order. A one-row product padded to two rows goes to the kernel
    too where it takes 2 rows."""
    variable, shape, name = ROWS_KERNEL_MEASURE[dtype]
    setting = envs.optional_bool(variable)
    if jax.default_backend() != "cpu" or not library.available():
        return 0
    if setting is not None:
        return ROWS_KERNEL_COUNTS[-1] if setting else 0

    def measure():
        rng = np.random.default_rng(0)
        weights = tuple(jnp.asarray(rng.standard_normal(shape) * 0.02, dtype) for _ in range(8))
        kernel = _chained(cpu_kernels.rows_product)
        library_form = _chained(lambda x, w: library_weight_left(x, w).T)  # transposed after, as in a step
        clock = timer or seconds_of
        most = 0
        for rows in ROWS_KERNEL_COUNTS:
            x = jnp.asarray(rng.standard_normal((rows, shape[1])), dtype)
            for fn in (kernel, library_form):  # compiled and run once, untimed
                jax.block_until_ready(fn(x, weights))
            ratios = [clock(kernel, x, weights) / clock(library_form, x, weights) for _ in range(FEW_ROWS_ROUNDS)]
            if float(np.median(ratios)) > 1 - FEW_ROWS_MARGIN:
                break
            most = rows
        return most

    return measured_choice(name, measure, lambda v: v in (0, *ROWS_KERNEL_COUNTS), keep=timer is None)


def _chained(product):
    """jitted (x [m, n_in], weights [n_out, n_in] with n_out >= n_in) -> x after each weight in turn:
    x += product(x, w)[:, :n_in] / 1024 (product: -> [m, n_out]), so that every product waits for the one before
    (`rows_kernel_rows`)."""
    def run(x, weights):
        for w in weights:
            x = x + (product(x, w)[:, :x.shape[1]] / 1024).astype(x.dtype)
        return x
    return jax.jit(run)


def decode_vector_bits(dtype: str, forms: Forms | None = None, timer=None) -> int:
    """LLVM's vector width (256 or 512 bits) under which this CPU streams a one-row product of `dtype` weights faster
    (`Forms.decode_vector_bits`): which one wins depends on the CPU and the dtype (docs/benchmarks.md).
    `DECODE_VECTOR_BITS_ENV` if set, else measured once per machine and dtype (`remembered`; 256 off the CPU, where
    the width means nothing). The probe is the step's own form of product (`dense.dense` of one row in `forms`, by
    default this machine's `product_forms(dtype)`, compiled with the LLVM IR emitters at each width) over 8 matrices
    of 4096 x 1024 in `dtype`, more than a CPU's last-level cache, as a model's weights are. The two compiled forms
    run in turn `DECODE_VECTOR_ROUNDS` times; 512 bits only if the median of the rounds' time ratios is
    `DECODE_VECTOR_MARGIN` below 1 (a tie keeps XLA's preference, so that a machine where the widths tie does not
    switch between them, and between stored executables, from one start to the next). `timer(bits, fn, *args) ->
    seconds` replaces the clock (tests; then nothing is kept)."""
    bits = envs.optional_int(DECODE_VECTOR_BITS_ENV)
    if bits is not None:
        return bits
    if jax.default_backend() != "cpu":
        return DECODE_VECTOR_BITS[0]
    forms = forms or product_forms(dtype)

    def measure():
        weights = tuple(jnp.full((4096, 1024), 0.01 * (i + 1), dtype) for i in range(8))
        x = jnp.full((1, 1024), 0.5, dtype)
        lowered = jax.jit(lambda x, ws: [dense(x, w, forms) for w in ws]).lower(x, weights)
        fns = {bits: lowered.compile(vector_width_options(bits)) for bits in DECODE_VECTOR_BITS}
        for fn in fns.values():
            jax.block_until_ready(fn(x, weights))
        ratios = []  # each round's 512-bit time over its 256-bit time: a load that comes and goes hits both alike
        for _ in range(DECODE_VECTOR_ROUNDS):
            t256, t512 = ((timer or _seconds_at)(bits, fns[bits], x, weights) for bits in DECODE_VECTOR_BITS)
            ratios.append(t512 / t256)
        return 512 if np.median(ratios) <= 1 - DECODE_VECTOR_MARGIN else 256

    return measured_choice(f"decode_vector_bits {dtype}", measure, lambda bits: bits in DECODE_VECTOR_BITS,
                           keep=timer is None)


def _seconds_at(bits: int, fn, *args) -> float:
    """Wall seconds of one call of `fn` (compiled at `bits`), its outputs ready."""
    return seconds_of(fn, *args)
