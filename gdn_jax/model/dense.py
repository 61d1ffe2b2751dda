"""Projections: a product's form on each backend (the CPU's forms chosen by the machine's measured choices)."""

from __future__ import annotations

import functools
import math
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from gdn_jax import envs
from gdn_jax.backends.cpu import kernels as cpu_kernels


class LayerKernel:
    """A projection matrix of the layer the layer loop is at (`Qwen35Model.scan_layers`): every layer's own matrix
    (separate buffers, never stacked) and the loop's layer index. `dense` multiplies by the layer's matrix inside a
    `lax.switch` over the layers, whose branches read their matrix where it lies.

    Slicing a stacked [layers, n_in, n_out] array instead copies the layer's matrix on XLA's CPU backend (its
    matmuls read whole buffers), on every step, and a bfloat16 stack is converted to float32 whole (see
    docs/design.md, "Layer loop")."""

    def __init__(self, kernels: tuple, layer):
        self.kernels, self.layer = kernels, layer

    def __getitem__(self, index):  # how an nnx.Variable reads its value: `kernel[...]`
        if index is not Ellipsis:
            raise TypeError("a LayerKernel is read whole (kernel[...])")
        return self

    @property
    def dtype(self):
        return self.kernels[0].dtype

    def select(self, fn, *args):
        """fn(the layer's matrix, *args), through a switch over the layers unless the layer is known when tracing.
        `fn` is traced once per layer (a branch each): keep it a call of a jitted function, whose trace is cached."""
        if isinstance(self.layer, int):
            return fn(self.kernels[self.layer], *args)
        return jax.lax.switch(self.layer, [partial(fn, k) for k in self.kernels], *args)


@jax.jit
def _identity(a):  # a branch of the switch that picks a layer's small parameters (one trace for every branch)
    return a


# On CPU, products of this many rows (first, last) put the weight on the left (`_product`), per activation dtype.
WEIGHT_LHS_ROWS = {jnp.dtype(jnp.float32): (2, 64), jnp.dtype(jnp.bfloat16): (16, 64)}
# On CPU, products of a 16-bit float weight with at least this many rows are multiplied in float32 (`_product`,
# `dense_all`), when the weight's float32 copy (a temporary of the step) takes at most UPCAST_MAX_BYTES and the
# float32 routine is the faster one on this machine (`upcast_is_faster`).
UPCAST_ROWS = 256
UPCAST_MAX_BYTES = 1 << 30
UPCAST_ENV = "GDN_JAX_BF16_UPCAST"  # "1": always, "0": never, unset: measured (`upcast_is_faster`)


def _best_seconds(fn, *args, repeats: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


@functools.cache
def upcast_is_faster(timer=_best_seconds) -> bool:
    """Whether this CPU multiplies a many-row bfloat16 product faster with both operands converted to float32 (the
    conversion included) than with XLA's bfloat16 routine (float32 accumulation). Which one wins depends on the
    machine: on the 2-core AVX-512 Xeons without AMX the converted product (1024 x 6144 weight: 231 against 149
    GFLOP/s at 2048 rows), on a 2-core AMD EPYC with AVX-512 BF16 the bfloat16 routine, by about 2x (the bfloat16
    2048-token forward of hybrid-1024 in 1.8 s against 3.1-3.6 s). So it is measured once per machine
    (`executables.remembered`: kept beside JAX's persistent cache, else measured once per process; a `timer` other
    than the default keeps nothing), on a prefill-sized product (1024 rows of a 1024 x 2048 weight, best of 5 each,
    ~0.4 s with compiling), unless `UPCAST_ENV` says "1" or "0". The values agree either way to float32 rounding (exact
    products, float32 sums in another order)."""
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

    from gdn_jax.worker import executable_store as executables  # (it imports this module
    return executables.measured_choice("bf16_upcast", measure, lambda faster: isinstance(faster, bool),
                                       keep=timer is _best_seconds)


# XLA's CPU backend fuses a matrix-vector product into a loop over the matrix only while the vector, in float32, is
# under 16 KiB: one-row products of this many columns or more take another form (`_one_row`).
FUSED_MATVEC_COLUMNS = 4096


def _one_row(x, kernel):
    """x [n_in] @ kernel[n_out, n_in].T -> [n_out] float32 on XLA's CPU backend: what `_product` does with one row.

    Written with the transpose, the product compiles to XLA's own loop over the weight's rows (a dot inside a loop
    fusion, split over the cores) that converts a bfloat16 weight in registers and streams it once. A bfloat16
    weight is read there as two streams, its rows in the order 0, n/2, 1, n/2 + 1, ... (a transpose that the loop
    folds into its indexing; the small result is put back in order), which the hardware prefetchers keep further
    ahead of: 17.6 -> 20 GB/s on the development machine (float32 streams faster as it is). Putting the result back
    after the switch over the layers instead (one op per call, not per layer) was slower: XLA fused the reordering
    into the consumers.
    XLA fuses that loop only while n_in < `FUSED_MATVEC_COLUMNS`. A wider product (a model 4096 wide) would compile
    to a float32 transposed copy of the whole weight, then the product: 0.3-0.6 GB/s in bfloat16, 1.2 in float32.
    There a float32 weight goes to the library as it lies (31 GB/s); a bfloat16 one is multiplied as two rows
    (`dense_all` adds a zero row, outside the switch), which the library multiplies in bfloat16 without converting
    the weight first (17 GB/s; one row would go to a matrix-vector routine that converts it: 1.8). docs/design.md,
    "One-row products"."""
    n, k = kernel.shape
    x = x.reshape(1, k)
    if k >= FUSED_MATVEC_COLUMNS:
        return jnp.einsum("md,vd->mv", x, kernel, preferred_element_type=jnp.float32)[0]
    if kernel.dtype == jnp.float32 or n % 2:
        return jnp.dot(x, kernel.T, preferred_element_type=jnp.float32)[0]
    y = jnp.dot(x, kernel.reshape(2, n // 2, k).transpose(1, 0, 2).reshape(n, k).T, preferred_element_type=jnp.float32)
    return y.reshape(n // 2, 2).T.reshape(n)


def float32_precision(dtype):
    """The precision of a product of `dtype` operands: HIGHEST for float32, which XLA's GPU backend otherwise
    multiplies in TensorFloat-32 (10-bit mantissas) on Ampere and later GPUs; the CPU ignores it. The default (None)
    for 16-bit operands."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _product(x, kernel):
    """x [..., n_in] @ kernel[n_out, n_in].T -> [..., n_out], accumulated and returned in float32.

    On XLA's CPU backend the form of the product decides its speed at few rows (decode: one row per sequence):
    - One row: `_one_row`, mostly XLA's own loop over the weight's rows, which streams it once. The contraction
      written without the transpose goes to the library's matrix-vector routine, which first converts a whole
      bfloat16 weight to float32 in memory (measured on a 6144 x 1024 matrix on the development machine: 0.42
      against 1.37 ms in bfloat16; float32 0.52 against 0.60 ms).
    - 2 to `rows_kernel_rows()` bfloat16 rows, on a CPU where it is measured faster: the compiled few-row kernel
      (`cpu_kernels.rows_product`, in place of the library's W @ x.T below; each weight row read once for all rows).
    - 2-64 rows (bfloat16: 16-64): W @ x.T, the weight on the left (float32 with 2-64 rows: 1.4-4x less CPU time
      than x @ W.T; bfloat16 from 16 rows on: 15-35% less; with 2-4 rows no gain, so not used there). Bfloat16
      from 2 rows on, and one row as two, on a CPU where that is faster (`few_rows_weight_left`, measured). The
      optimisation barrier keeps XLA from folding the transpose of the small [n_out, rows] result back into the dot
      (which would turn it into x @ W.T again).
    - `UPCAST_ROWS` rows or more (prefill) of a bfloat16 weight (`dense_all`, which picks the layer's weight out of
      the layer switch first), on a CPU where that is faster (`upcast_is_faster`, measured): both operands
      converted to float32, then the library's float32 product. On the development machine's AVX-512 Xeon its
      bfloat16 routine (float32 accumulation) is the slower of the two: 149 against 231 GFLOP/s at 2048 rows of a
      1024 x 6144 weight, conversion included (256 rows: 152 against 172); on an AMD EPYC with AVX-512 BF16 it is
      about twice as fast as the converted product. Same values: the products of bfloat16 numbers are exact in float32,
      and both accumulate in float32. Below ~200 rows converting the weight on every call costs more than it
      saves. The float32 copy is a temporary of the step (Qwen3.5-9B's largest projection: 400 MB); a weight whose
      copy would pass `UPCAST_MAX_BYTES` (the 9B's 248k-token LM head: 4 GB, multiplied at many rows mainly for
      prompt logprobs) is multiplied as it is.
    Many rows (prefill) amortise the library's packing of the weight either way. Elsewhere (GPU) the product is left
    alone, at `float32_precision`."""
    lead = x.shape[:-1]
    if jax.default_backend() == "cpu" and math.prod(lead) == 1:
        return _one_row(x.reshape(x.shape[-1]), kernel).reshape(*lead, -1)
    if _weight_left(x):
        x = x.reshape(-1, x.shape[-1])
        return _as_rows(_weight_left_product(x, kernel), x, kernel).reshape(*lead, kernel.shape[0])
    return jnp.einsum("...d,vd->...v", x, kernel, preferred_element_type=jnp.float32,
                      precision=float32_precision(jnp.result_type(x, kernel)))


def _weight_left(x) -> bool:
    """Whether `_product` multiplies x as W @ x.T (on CPU, WEIGHT_LHS_ROWS rows of the activation's dtype; bfloat16
    from 2 rows on where `few_rows_weight_left`, or where the few-row kernel takes them: `rows_kernel_rows`)."""
    if jax.default_backend() != "cpu":
        return False
    lo, hi = WEIGHT_LHS_ROWS.get(jnp.dtype(x.dtype), (0, -1))
    rows = math.prod(x.shape[:-1])
    if jnp.dtype(x.dtype) == jnp.bfloat16 and (few_rows_weight_left() or 2 <= rows <= rows_kernel_rows()):
        lo = 2
    return lo <= rows <= hi


FEW_ROWS_ENV = "GDN_JAX_BF16_FEW_ROWS_WEIGHT_LEFT"  # "1": always, "0": never, unset: measured (`few_rows_weight_left`)
FEW_ROWS_ROUNDS, FEW_ROWS_MARGIN = 15, 0.05


@functools.cache
def few_rows_weight_left(timer=None) -> bool:
    """Whether this CPU multiplies bfloat16 products of 1-15 rows (decode steps) faster in XLA's library with the
    weight on the left, W @ x.T, one row padded to two with a zero row, than in the forms below.

    On the machines this was developed on, a one-row product ran fastest as XLA's own loop over the weight
    (`_one_row`) and 2-15 rows as x @ W.T. On a Xeon with AMX the library's bfloat16 routine with the weight on the
    left streams the weight far faster at any few rows: 32 matrices of 4096 x 1024 (268 MB, from memory), one row
    18.7 GB/s as the loop (512-bit vectors, its faster width there) against 26.4 GB/s as two rows, weight left;
    2, 4 and 8 rows 15.0, 24.3 and 18.9 GB/s as x @ W.T against 28.7, 38.7 and 32.9 (12 matrices, 100 MB). So it
    is measured once per machine (`executables.measured_choice`: kept beside JAX's persistent cache, else once per
    process), unless `FEW_ROWS_ENV` says "1" or "0": a one-row product over 8 bfloat16 matrices of 4096 x 1024, as
    the loop (at 256 and at 512 bits, the faster of the two each round) and as two rows with the weight on the left,
    in turn `FEW_ROWS_ROUNDS` times; the library form is chosen when the median of the rounds' time ratios is
    `FEW_ROWS_MARGIN` below 1 (a tie keeps the loop). `timer(fn, *args) -> seconds` replaces the clock (tests; then
    nothing is kept). Either way the values agree to float32 summation order (exact products of bfloat16 numbers,
    float32 sums)."""
    setting = envs.optional_bool(FEW_ROWS_ENV)
    if setting is not None:
        return setting
    if jax.default_backend() != "cpu":
        return False

    def measure():
        # the decode steps' XLA options (it imports this module)
        from gdn_jax.worker.compilation import DECODE_VECTOR_BITS, LLVM_IR_CPU_COMPILER_OPTIONS, vector_width_options

        rng = np.random.default_rng(0)
        weights = tuple(jnp.asarray(rng.standard_normal((4096, 1024)) * 0.02, jnp.bfloat16) for _ in range(8))
        x = jnp.asarray(rng.standard_normal((1, 1024)), jnp.bfloat16)
        loops = [jax.jit(lambda x, ws: [_one_row(x[0], w) for w in ws], compiler_options=vector_width_options(bits))
                 for bits in DECODE_VECTOR_BITS]
        library = jax.jit(lambda x, ws: [_library_weight_left(jnp.concatenate([x, jnp.zeros_like(x)]), w)
                                         for w in ws], compiler_options=LLVM_IR_CPU_COMPILER_OPTIONS)
        for fn in (*loops, library):  # compiled and run once, untimed
            jax.block_until_ready(fn(x, weights))
        clock = timer or seconds_of
        ratios = []
        for _ in range(FEW_ROWS_ROUNDS):
            loop = min(clock(fn, x, weights) for fn in loops)
            ratios.append(clock(library, x, weights) / loop)
        return float(np.median(ratios)) <= 1 - FEW_ROWS_MARGIN

    from gdn_jax.worker import executable_store as executables  # (it imports this module
    return executables.measured_choice("bf16_few_rows_weight_left", measure, lambda v: isinstance(v, bool),
                                       keep=timer is None)


def seconds_of(fn, *args) -> float:
    """Wall seconds of one call of `fn`, its outputs ready."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def _weight_left_product(x, kernel):
    """x [m, n_in] by kernel [n_out, n_in], float32: [m, n_out] by the compiled few-row kernel where it takes these
    rows (`_rows_kernel`), else [n_out, m] by XLA's library with the weight on the left (`_library_weight_left`),
    whose result the caller transposes after the layer switch (one transpose per call site): `_as_rows`."""
    if _rows_kernel(x, kernel):
        return cpu_kernels.rows_product(x, kernel)
    return _library_weight_left(x, kernel)


def _as_rows(y, x, kernel):
    """A `_weight_left_product(x, kernel)` result as [m, n_out]: the library's transposed, the kernel's as it is (it
    writes the rows' outputs in place; XLA's transposing convert after a 16-row product took 1.2-1.3 ms per step
    more than a plain one, docs/benchmarks.md)."""
    return y if _rows_kernel(x, kernel) else y.T


def _library_weight_left(x, kernel):
    """kernel [n_out, n_in] @ x[m, n_in].T -> [n_out, m] float32 by XLA. The optimisation barrier keeps XLA from
    folding the transpose that follows (`_product`) back into the dot."""
    return jax.lax.optimization_barrier(jnp.einsum("vd,md->vm", kernel, x, preferred_element_type=jnp.float32))


def _rows_kernel(x, kernel) -> bool:
    """Whether the compiled kernel multiplies this product (`cpu_kernels.rows_product`): bfloat16 x [m, n_in] and
    kernel [n_out, n_in] on the CPU backend, 2 <= m <= `rows_kernel_rows()`."""
    return (jax.default_backend() == "cpu" and x.ndim == 2 and kernel.ndim == 2 and x.dtype == jnp.bfloat16
            and kernel.dtype == jnp.bfloat16 and 2 <= x.shape[0] <= rows_kernel_rows() and cpu_kernels.available())


ROWS_KERNEL_ENV = "GDN_JAX_BF16_ROWS_KERNEL"  # "1": 2-16 rows, "0": never, unset: measured (`rows_kernel_rows`)
ROWS_KERNEL_COUNTS = (4, 8, 16)  # the row counts measured: 2-4 rows take the kernel if it wins at 4, 5-8 at 8, ...


@functools.cache
def rows_kernel_rows(timer=None) -> int:
    """The most rows of a bfloat16 product (from 2 on) that the compiled few-row kernel multiplies
    (`cpu_kernels.rows_product`) instead of XLA's library with the weight on the left: 0 (none) or one of
    `ROWS_KERNEL_COUNTS`.

    On a 2-core AMD EPYC (Zen 4, AVX-512 BF16, no matrix units) XLA multiplies 2-16 bfloat16 rows at 13-14 GB/s of
    weight where one row streams 30, so a decode step of 2 rows took twice as long as one of 1 row; the kernel reads
    each weight row once for all the rows: on a 201 MB weight, 4 rows 6.6-7.3 against 14.1-15.9 ms, 16 rows
    10.9-13.4 against 14.2-16.5 (min; docs/benchmarks.md). A Xeon with AMX multiplies them in its matrix units. So
    it is measured once per machine (`executables.measured_choice`), unless `ROWS_KERNEL_ENV` says "1" (16) or "0"
    (0), where the kernels are available (`cpu_kernels.available`; else 0): for each of `ROWS_KERNEL_COUNTS`, in
    turn `FEW_ROWS_ROUNDS` times over 8 bfloat16 matrices of 4096 x 1024, the kernel against the library's form,
    each product's rows feeding the next's (`_chained`, as a decode step's products follow one another); the count
    is taken while the median of the rounds' time ratios is `FEW_ROWS_MARGIN` below 1. `timer(fn, *args) ->
    seconds` replaces the clock (tests; then nothing is kept). The values agree to float32 summation order. A
    one-row product that `_as_two_rows` pads to two rows goes to the kernel too where it takes 2 rows.

    Products that do not depend on one another run side by side on XLA's threads, each kernel call then sharing
    its blocks with threads the other holds: measured so on the EPYC, 16 rows came out near the margin (kernel
    4.1-5.3 ms against 5.1-5.8 ms for the 8 products, ratio 0.78-0.96) and the stored choice was 8, where a 16-row
    decode step ran 23.5-24.6 ms on the library and 20.4-21.0 ms on the kernel; in turn the ratio is 0.76-0.87
    (docs/benchmarks.md)."""
    setting = envs.optional_bool(ROWS_KERNEL_ENV)
    if jax.default_backend() != "cpu" or not cpu_kernels.available():
        return 0
    if setting is not None:
        return ROWS_KERNEL_COUNTS[-1] if setting else 0

    def measure():
        rng = np.random.default_rng(0)
        weights = tuple(jnp.asarray(rng.standard_normal((4096, 1024)) * 0.02, jnp.bfloat16) for _ in range(8))
        kernel = _chained(cpu_kernels.rows_product)
        library = _chained(lambda x, w: _library_weight_left(x, w).T)  # transposed after, as in a step
        clock = timer or seconds_of
        most = 0
        for rows in ROWS_KERNEL_COUNTS:
            x = jnp.asarray(rng.standard_normal((rows, 1024)), jnp.bfloat16)
            for fn in (kernel, library):  # compiled and run once, untimed
                jax.block_until_ready(fn(x, weights))
            ratios = [clock(kernel, x, weights) / clock(library, x, weights) for _ in range(FEW_ROWS_ROUNDS)]
            if float(np.median(ratios)) > 1 - FEW_ROWS_MARGIN:
                break
            most = rows
        return most

    from gdn_jax.worker import executable_store as executables  # (it imports this module
    return executables.measured_choice("bf16_rows_kernel_chained", measure, lambda v: v in (0, *ROWS_KERNEL_COUNTS),
                                       keep=timer is None)


def _chained(product):
    """jitted (x [m, n_in], weights [n_out, n_in] with n_out >= n_in) -> x after each weight in turn:
    x += product(x, w)[:, :n_in] / 1024 (product: -> [m, n_out]), so that every product waits for the one before
    (`rows_kernel_rows`)."""
    def run(x, weights):
        for w in weights:
            x = x + (product(x, w)[:, :x.shape[1]] / 1024).astype(x.dtype)
        return x
    return jax.jit(run)


@jax.jit
def _products(x, kernels: tuple) -> tuple:
    """_product(x, k) for each kernel. Jitted so that the switch branches of `LayerKernel` (one per layer, same
    shapes) reuse one trace."""
    return tuple(_product(x, k) for k in kernels)


@jax.jit
def _weight_left_products(x, kernels: tuple) -> tuple:
    """_weight_left_product(x, k) for each kernel, jitted for the same reason as `_products`."""
    return tuple(_weight_left_product(x, k) for k in kernels)


def dense(x, kernel):
    """x [..., n_in] @ kernel.T, kernel [n_out, n_in] (the HF layout) -> [..., n_out] float32, accumulated in
    float32 (see `_product` for the forms it takes on CPU). `kernel` may be a `LayerKernel`: the matrix of the
    layer the loop is at."""
    return dense_all(x, (kernel,))[0]


def _as_two_rows(x, kernel) -> bool:
    """Whether a one-row product is multiplied as two rows, the row and a zero row (see `_one_row`): on CPU, a
    weight narrower than float32 and an input too wide for XLA's fused loop, or a bfloat16 weight on a CPU that
    multiplies few rows faster in the library (`few_rows_weight_left`)."""
    return (jax.default_backend() == "cpu" and math.prod(x.shape[:-1]) == 1 and kernel.dtype != jnp.float32
            and (x.shape[-1] >= FUSED_MATVEC_COLUMNS or (kernel.dtype == jnp.bfloat16 and few_rows_weight_left())))


def _upcast(x, kernel) -> bool:
    """Whether a product is multiplied in float32 (see `_product`): on CPU, `UPCAST_ROWS` rows or more of a weight
    narrower than float32 whose float32 copy takes at most `UPCAST_MAX_BYTES`, where that is the faster routine
    (`upcast_is_faster`)."""
    w = kernel.kernels[0] if isinstance(kernel, LayerKernel) else kernel
    return (jax.default_backend() == "cpu" and math.prod(x.shape[:-1]) >= UPCAST_ROWS and w.dtype != jnp.float32
            and 4 * w.size <= UPCAST_MAX_BYTES and upcast_is_faster())


def _together(kernels) -> LayerKernel:
    """`LayerKernel`s of one layer loop as one, whose matrix per layer is the tuple of theirs: one switch picks all."""
    return LayerKernel(tuple(zip(*(k.kernels for k in kernels))), kernels[0].layer)


def dense_all(x, kernels) -> list:
    """[dense(x, k) for k in kernels]; `LayerKernel`s (of one layer loop) are picked by one switch for all of them."""
    if _upcast(x, kernels[0]):
        # The switch only copies the layer's matrices out (a copy, no generated code), so that the step compiles one
        # conversion per call site and not one per layer and call site (~1 s more per 9B prefill shape).
        if isinstance(kernels[0], LayerKernel):
            kernels = _together(kernels).select(_identity)
        xf = x.astype(jnp.float32)
        return [jnp.einsum("...d,vd->...v", xf, k.astype(jnp.float32)) for k in kernels]
    if _as_two_rows(x, kernels[0]):  # padded outside the switch: one pad and one slice per call, not per layer
        lead, x = x.shape[:-1], x.reshape(1, x.shape[-1])
        return [y[0].reshape(*lead, -1) for y in dense_all(jnp.concatenate([x, jnp.zeros_like(x)]), kernels)]
    if not isinstance(kernels[0], LayerKernel):
        return list(_products(x, tuple(kernels)))
    if _weight_left(x):
        # the transposes of the results follow the switch: one per call site, not one per layer and call site in
        # its branches (each a kernel of the step for XLA to generate: 128 of Qwen3.5-9B's 16-row decode step)
        lead, x = x.shape[:-1], x.reshape(-1, x.shape[-1])
        ys = _together(kernels).select(lambda ks, x: _weight_left_products(x, ks), x)
        return [_as_rows(y, x, k.kernels[0]).reshape(*lead, -1) for y, k in zip(ys, kernels)]
    return list(_together(kernels).select(lambda ks, x: _products(x, ks), x))
