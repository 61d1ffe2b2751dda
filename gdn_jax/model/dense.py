"""Projections: a product's form on each backend, as the step's `Forms` say."""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

from gdn_jax.backends.cpu import kernels as cpu_kernels
from gdn_jax.model.forms import Forms


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


# With the CPU forms, products of this many rows (first, last) put the weight on the left (`_product`), per
# activation dtype.
WEIGHT_LHS_ROWS = {jnp.dtype(jnp.float32): (2, 64), jnp.dtype(jnp.bfloat16): (16, 64)}
# With `Forms.bf16_upcast`, products of a 16-bit float weight with at least this many rows are multiplied in float32
# (`_product`, `dense_all`) when the weight's float32 copy (a temporary of the step) takes at most UPCAST_MAX_BYTES.
UPCAST_ROWS = 256
UPCAST_MAX_BYTES = 1 << 30
# XLA's CPU backend fuses a matrix-vector product into a loop over the matrix only while the vector, in float32, is
# under 16 KiB: one-row products of this many columns or more take another form (`one_row`).
FUSED_MATVEC_COLUMNS = 4096


def one_row(x, kernel):
    """x [n_in] @ kernel[n_out, n_in].T -> [n_out] float32 on XLA's CPU backend: what `_product` does with one row.

    Written with the transpose, the product compiles to XLA's own loop over the weight's rows (a dot inside a loop
    fusion, split over the cores) that converts a bfloat16 weight in registers and streams it once. A bfloat16
    weight is read there as two streams, its rows in the order 0, n/2, 1, n/2 + 1, ... (a transpose that the loop
    folds into its indexing; the small result is put back in order), which the hardware prefetchers keep further
    ahead of. Putting the result back after the switch over the layers instead (one op per call, not per layer) was
    slower: XLA fused the reordering into the consumers.
    XLA fuses that loop only while n_in < `FUSED_MATVEC_COLUMNS`. A wider product would compile to a float32
    transposed copy of the whole weight, then the product, many times slower. There a float32 weight goes to the
    library as it lies; a bfloat16 one is multiplied as two rows (`dense_all` adds a zero row, outside the switch),
    which the library multiplies in bfloat16 without converting the weight first (one row would go to a
    matrix-vector routine that converts it). docs/design.md, "One-row products"; figures in docs/benchmarks.md."""
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


def _product(x, kernel, forms: Forms):
    """x [..., n_in] @ kernel[n_out, n_in].T -> [..., n_out], accumulated and returned in float32.

    With the CPU forms (`forms.cpu`), the form of the product decides its speed at few rows (decode: one row per
    sequence):
    - One row: `one_row`, mostly XLA's own loop over the weight's rows, which streams it once. The contraction
      written without the transpose goes to the library's matrix-vector routine, which first converts a whole
      bfloat16 weight to float32 in memory.
    - 2 to `forms.rows_kernel_rows` bfloat16 rows: the compiled few-row kernel (`cpu_kernels.rows_product`, in place
      of the library's W @ x.T below; each weight row read once for all rows).
    - 2-64 rows (bfloat16: 16-64): W @ x.T, the weight on the left, which the library multiplies faster than
      x @ W.T at these rows (with 2-4 bfloat16 rows no gain, so not used there). Bfloat16 from 2 rows on, and one
      row as two, with `forms.few_rows_weight_left`. The optimisation barrier keeps XLA from folding the transpose
      of the small [n_out, rows] result back into the dot (which would turn it into x @ W.T again).
    - `UPCAST_ROWS` rows or more (prefill) of a bfloat16 weight with `forms.bf16_upcast` (`dense_all`, which picks
      the layer's weight out of the layer switch first): both operands converted to float32, then the library's
      float32 product. Same values: the products of bfloat16 numbers are exact in float32, and both accumulate in
      float32. Below ~200 rows converting the weight on every call costs more than it saves. The float32 copy is a
      temporary of the step; a weight whose copy would pass `UPCAST_MAX_BYTES` (a large vocabulary's LM head,
      multiplied at many rows mainly for prompt logprobs) is multiplied as it is.
    Which of these win depends on the CPU: `backends.cpu.tuning` measures them once per machine. Many rows (prefill)
    amortise the library's packing of the weight either way. Without the CPU forms (GPU, training) the product is
    left alone, at `float32_precision`. Figures in docs/benchmarks.md."""
    lead = x.shape[:-1]
    if forms.cpu and math.prod(lead) == 1:
        return one_row(x.reshape(x.shape[-1]), kernel).reshape(*lead, -1)
    if _weight_left(x, forms):
        x = x.reshape(-1, x.shape[-1])
        return _as_rows(_weight_left_product(x, kernel, forms), x, kernel, forms).reshape(*lead, kernel.shape[0])
    return jnp.einsum("...d,vd->...v", x, kernel, preferred_element_type=jnp.float32,
                      precision=float32_precision(jnp.result_type(x, kernel)))


def _weight_left(x, forms: Forms) -> bool:
    """Whether `_product` multiplies x as W @ x.T (CPU forms, WEIGHT_LHS_ROWS rows of the activation's dtype;
    bfloat16 from 2 rows on with `few_rows_weight_left`, or where the few-row kernel takes them)."""
    if not forms.cpu:
        return False
    lo, hi = WEIGHT_LHS_ROWS.get(jnp.dtype(x.dtype), (0, -1))
    rows = math.prod(x.shape[:-1])
    if jnp.dtype(x.dtype) == jnp.bfloat16 and (forms.few_rows_weight_left or 2 <= rows <= forms.rows_kernel_rows):
        lo = 2
    return lo <= rows <= hi


def _weight_left_product(x, kernel, forms: Forms):
    """x [m, n_in] by kernel [n_out, n_in], float32: [m, n_out] by the compiled few-row kernel where it takes these
    rows (`_rows_kernel`), else [n_out, m] by XLA's library with the weight on the left (`library_weight_left`),
    whose result the caller transposes after the layer switch (one transpose per call site): `_as_rows`."""
    if _rows_kernel(x, kernel, forms):
        return cpu_kernels.rows_product(x, kernel)
    return library_weight_left(x, kernel)


def _as_rows(y, x, kernel, forms: Forms):
    """A `_weight_left_product(x, kernel)` result as [m, n_out]: the library's transposed, the kernel's as it is (it
    writes the rows' outputs in place, where a transposing convert after it cost more; docs/benchmarks.md)."""
    return y if _rows_kernel(x, kernel, forms) else y.T


def library_weight_left(x, kernel):
    """kernel [n_out, n_in] @ x[m, n_in].T -> [n_out, m] float32 by XLA. The optimisation barrier keeps XLA from
    folding the transpose that follows (`_product`) back into the dot."""
    return jax.lax.optimization_barrier(jnp.einsum("vd,md->vm", kernel, x, preferred_element_type=jnp.float32))


def _rows_kernel(x, kernel, forms: Forms) -> bool:
    """Whether the compiled kernel multiplies this product (`cpu_kernels.rows_product`): x [m, n_in] and kernel
    [n_out, n_in] of one dtype, with the kernels, 2 <= m <= `forms.rows_kernel_rows` (bfloat16) or
    `forms.f32_rows_kernel_rows` (float32)."""
    most = {jnp.dtype(jnp.bfloat16): forms.rows_kernel_rows, jnp.dtype(jnp.float32): forms.f32_rows_kernel_rows}
    return (forms.kernels and x.ndim == 2 and kernel.ndim == 2 and x.dtype == kernel.dtype
            and 2 <= x.shape[0] <= most.get(jnp.dtype(x.dtype), 0))


@partial(jax.jit, static_argnums=2)
def _products(x, kernels: tuple, forms: Forms) -> tuple:
    """_product(x, k) for each kernel. Jitted so that the switch branches of `LayerKernel` (one per layer, same
    shapes) reuse one trace."""
    return tuple(_product(x, k, forms) for k in kernels)


@partial(jax.jit, static_argnums=2)
def _weight_left_products(x, kernels: tuple, forms: Forms) -> tuple:
    """_weight_left_product(x, k) for each kernel, jitted for the same reason as `_products`."""
    return tuple(_weight_left_product(x, k, forms) for k in kernels)


def dense(x, kernel, forms: Forms):
    """x [..., n_in] @ kernel.T, kernel [n_out, n_in] (the HF layout) -> [..., n_out] float32, accumulated in
    float32 (see `_product` for the forms it takes on CPU). `kernel` may be a `LayerKernel`: the matrix of the
    layer the loop is at."""
    return dense_all(x, (kernel,), forms)[0]


def _as_two_rows(x, kernel, forms: Forms) -> bool:
    """Whether a one-row product is multiplied as two rows, the row and a zero row (see `one_row`): with the CPU
    forms, a weight narrower than float32 and an input too wide for XLA's fused loop, or a bfloat16 weight with
    `forms.few_rows_weight_left`."""
    return (forms.cpu and math.prod(x.shape[:-1]) == 1 and kernel.dtype != jnp.float32
            and (x.shape[-1] >= FUSED_MATVEC_COLUMNS or (kernel.dtype == jnp.bfloat16 and forms.few_rows_weight_left)))


def _upcast(x, kernel, forms: Forms) -> bool:
    """Whether a product is multiplied in float32 (see `_product`): with `forms.bf16_upcast` (CPU forms),
    `UPCAST_ROWS` rows or more of a weight narrower than float32 whose float32 copy takes at most
    `UPCAST_MAX_BYTES`."""
    w = kernel.kernels[0] if isinstance(kernel, LayerKernel) else kernel
    return (forms.cpu and forms.bf16_upcast and math.prod(x.shape[:-1]) >= UPCAST_ROWS and w.dtype != jnp.float32
            and 4 * w.size <= UPCAST_MAX_BYTES)


def _together(kernels) -> LayerKernel:
    """`LayerKernel`s of one layer loop as one, whose matrix per layer is the tuple of theirs: one switch picks all."""
    return LayerKernel(tuple(zip(*(k.kernels for k in kernels))), kernels[0].layer)


def dense_all(x, kernels, forms: Forms) -> list:
    """[dense(x, k, forms) for k in kernels]; `LayerKernel`s (of one layer loop) are picked by one switch for all."""
    if _upcast(x, kernels[0], forms):
        # The switch only copies the layer's matrices out (a copy, no generated code), so that the step compiles one
        # conversion per call site and not one per layer and call site.
        if isinstance(kernels[0], LayerKernel):
            kernels = _together(kernels).select(_identity)
        xf = x.astype(jnp.float32)
        return [jnp.einsum("...d,vd->...v", xf, k.astype(jnp.float32)) for k in kernels]
    if _as_two_rows(x, kernels[0], forms):  # padded outside the switch: one pad and one slice per call, not per layer
        lead, x = x.shape[:-1], x.reshape(1, x.shape[-1])
        return [y[0].reshape(*lead, -1) for y in dense_all(jnp.concatenate([x, jnp.zeros_like(x)]), kernels, forms)]
    if not isinstance(kernels[0], LayerKernel):
        return list(_products(x, tuple(kernels), forms))
    if _weight_left(x, forms):
        # the transposes of the results follow the switch: one per call site, not one per layer and call site in
        # its branches (each a kernel of the step for XLA to generate)
        lead, x = x.shape[:-1], x.reshape(-1, x.shape[-1])
        ys = _together(kernels).select(lambda ks, x: _weight_left_products(x, ks, forms), x)
        return [_as_rows(y, x, k.kernels[0], forms).reshape(*lead, -1) for y, k in zip(ys, kernels)]
    return list(_together(kernels).select(lambda ks, x: _products(x, ks, forms), x))
