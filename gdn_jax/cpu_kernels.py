"""Compiled kernels for XLA's CPU backend: for one-token steps the GDN decode update (`gdn_decode`, source
csrc/gdn_decode.cc), decode attention (`attention_decode`, csrc/attention_decode.cc) and few-row bfloat16 products
(`rows_product`, csrc/rows_product.cc; used where `model.rows_kernel_rows` measured it faster); for prefill steps the
GDN rule over the step's tokens (`gdn_prefill`, csrc/gdn_prefill.cc).

XLA compiles a one-token step's GDN update (`model.advance_in_pool`) to a gathered copy of each row's state, a
product, and an in-place write that runs on one thread: 72-93 us per row and layer at hybrid-1024's 256 KiB states,
where the kernel takes 28-31 (`scripts/bench_kernel_ceiling.py`; docs/benchmarks.md). The kernel reads each state
once for its products with k and q and writes the new one once, sharing the (row, head) pairs among XLA's CPU
threads (an XLA FFI custom call, the pool aliased to its result: updated in place, as before). XLA's form of decode
attention copies each chunk of a row's paged keys and values into a contiguous block before its two products; the
attention kernel reads every key and value row once where it lies, for all the query heads of its KV head, with an
online softmax in float32. XLA's bfloat16 products of 2-16 rows stream the weights at about half the speed of one
row on a CPU without matrix units; the product kernel reads each weight row once for all the rows, with the CPU's
bfloat16 dot-product instruction where it has one. XLA's form of a prefill step's rule is the chunked one
(`gated_delta.chunk_gated_delta_rule`), a chain of small products and loops one chunk after the other; the prefill
kernel runs the rule token by token with each (row, head) state in the core's cache, one pass over it per token for
the update and the next token's products, the (row, head) pairs shared among the threads: 3-4x faster at
hybrid-1024's shapes, ~2.3x at Qwen3.5-9B's (docs/design.md, "The GDN rule of prefill steps as a compiled CPU
kernel").

They are built, one library, on first use by the system's C++ compiler (`c++`, `g++` or `clang++`, or `$CXX`)
against the FFI headers jaxlib ships, `-O3 -march=native`, into `kernels/` beside JAX's persistent compilation cache
(else a per-user folder under the system's temporary folder), one file per set of sources, jaxlib version, compiler
and CPU (`executables.host_cpu`; each source compiled in a process of its own, side by side, then linked), written
under a temporary name and renamed, so that processes building at once do not collide; later processes load it (a few seconds to build, milliseconds to load). `KERNELS_ENV`: "0" never uses
them, "1" requires them (an error names what failed), unset uses them when they build, and otherwise runs XLA's
forms after one RuntimeWarning that says why. Either way the values agree to float32 rounding (in bfloat16,
attention's to the rounding of XLA's probabilities to bfloat16; tests/gdn_jax/test_cpu_kernels.py); the executable
store keeps the two apart (`executables`: whether the kernels are in use is part of the key).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib

from gdn_jax.gated_delta import _inert, _valid_mask

KERNELS_ENV = "GDN_JAX_CPU_KERNELS"  # "0": never, "1": required, unset: when it builds
TARGET = "gdn_jax_gdn_decode"
PREFILL_TARGET = "gdn_jax_gdn_prefill"
ATTENTION_TARGET = "gdn_jax_attention_decode"
SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
ROWS_TARGET = "gdn_jax_rows_product"
# (and their headers, parallel.h and lanes.h)
SOURCES = ("gdn_decode.cc", "gdn_prefill.cc", "attention_decode.cc", "rows_product.cc")
MAX_DIM = 256  # the kernels' largest head dimension (their per-head buffers)
MAX_GROUP = 16  # attention: the most query heads per KV head
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")


def _setting() -> str:
    env = os.environ.get(KERNELS_ENV, "").strip()
    if env not in ("", "0", "1"):
        raise ValueError(f"{KERNELS_ENV} must be 0 (never), 1 (required) or unset (when it builds), got {env!r}")
    return env


def compiler() -> str | None:
    """The C++ compiler the kernels are built with: `$CXX` if set (it must exist), else c++, g++ or clang++."""
    if os.environ.get("CXX"):
        return shutil.which(os.environ["CXX"])
    return next((path for name in ("c++", "g++", "clang++") if (path := shutil.which(name))), None)


def folder() -> Path:
    """Where built kernels are kept: `kernels/` in JAX's persistent cache folder, else in a per-user folder under the
    system's temporary folder."""
    cache = jax.config.jax_compilation_cache_dir
    base = Path(cache) if cache else Path(tempfile.gettempdir(), f"gdn-jax-{os.getuid()}")
    return base / "kernels"


def build(cxx: str, out_folder: Path) -> Path:
    """The kernel library for these sources, jaxlib, compiler and CPU, built into `out_folder` unless it is there.
    Each source compiles in a process of its own, all at once (2.3-3.2 s each on the 2-core development machines,
    most of it the FFI headers: 8.1 s in one command, ~4.5 s side by side), then one link."""
    from gdn_jax.executables import host_cpu  # (executables imports the model, which imports this module)

    texts = [path.read_bytes() for path in sorted(SOURCE_DIR.iterdir()) if path.suffix in (".cc", ".h")]
    key = hashlib.sha256(b"\0".join([*texts, jaxlib.__version__.encode(), cxx.encode(), host_cpu().encode(),
                                     " ".join(FLAGS).encode()])).hexdigest()[:16]
    lib = out_folder / f"gdn_jax_kernels-{key}.so"
    if lib.exists():
        return lib
    out_folder.mkdir(parents=True, exist_ok=True)
    # one folder per build under way (objects and the library before its rename), gone whatever happens
    with tempfile.TemporaryDirectory(prefix=f".{lib.name}.", dir=out_folder) as work:
        objects = [str(Path(work, Path(name).stem + ".o")) for name in SOURCES]
        compile_flags = [flag for flag in FLAGS if flag != "-shared"]
        jobs = [subprocess.Popen([cxx, *compile_flags, f"-I{jax.ffi.include_dir()}", "-c", str(SOURCE_DIR / name),
                                  "-o", obj], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for name, obj in zip(SOURCES, objects)]
        try:
            errors = [job.communicate(timeout=300)[1] for job in jobs]
        finally:
            for job in jobs:  # after a timeout (or an interrupt) no compiler is left running
                if job.poll() is None:
                    job.kill()
                    job.wait()
        for job, err in zip(jobs, errors):
            _succeeded(cxx, job.returncode, err)
        tmp = str(Path(work, lib.name))
        link = subprocess.run([cxx, *FLAGS, *objects, "-o", tmp], capture_output=True, text=True, timeout=300)
        _succeeded(cxx, link.returncode, link.stderr)
        os.replace(tmp, lib)
    return lib


def _succeeded(cxx: str, code: int, messages: str) -> None:
    """Raises an error with the end of the compiler's messages if its run (exit `code`) failed."""
    if code:
        raise RuntimeError(f"{cxx} failed (exit {code}): {messages.strip()[-600:]}")


@functools.cache
def available() -> bool:
    """Whether steps on this process's CPU backend run the compiled kernels: built (or found) and
    registered with XLA once per process. See the module's docstring for `KERNELS_ENV`."""
    setting = _setting()
    if setting == "0" or jax.default_backend() != "cpu":
        return False
    try:
        cxx = compiler()
        if cxx is None:
            named = f": {os.environ['CXX']!r}" if os.environ.get("CXX") else ""
            raise RuntimeError(f"no C++ compiler on PATH (c++, g++ or clang++; or name one in CXX{named})")
        lib = ctypes.CDLL(str(build(cxx, folder())))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.GdnJaxGdnDecode), platform="cpu")
        jax.ffi.register_ffi_target(PREFILL_TARGET, jax.ffi.pycapsule(lib.GdnJaxGdnPrefill), platform="cpu")
        jax.ffi.register_ffi_target(ATTENTION_TARGET, jax.ffi.pycapsule(lib.GdnJaxAttentionDecode), platform="cpu")
        jax.ffi.register_ffi_target(ROWS_TARGET, jax.ffi.pycapsule(lib.GdnJaxRowsProduct), platform="cpu")
    except Exception as exc:
        if setting == "1":
            raise RuntimeError(f"{KERNELS_ENV}=1, but the CPU kernels could not be built or loaded: {exc}") from exc
        warnings.warn(f"gdn_jax: the CPU kernels could not be built or loaded ({exc}); steps run XLA's forms of "
                      f"the GDN rule (prefill: the chunked \"fused\" schedule), decode attention and few-row "
                      f"products (slower; {KERNELS_ENV}=0 says so without trying)",
                      RuntimeWarning, stacklevel=2)
        return False
    return True


def applies(pool) -> bool:
    """Whether `gdn_decode` updates this pool: a float32 [layers, slots, H, D, D] pool (D <= MAX_DIM) on the CPU
    backend, with the kernel available."""
    return (pool.dtype == jnp.float32 and pool.ndim == 5 and pool.shape[-1] == pool.shape[-2] <= MAX_DIM
            and jax.default_backend() == "cpu" and available())


def gdn_decode(pool, src, live, warm, lengths, q, k, v, g, beta, layer):
    """`model.advance_in_pool` by the kernel: (o [B, 1, H, dv] in v's dtype, the pool updated in place). Padding
    rows (`lengths` 0) are made inert first, as `gated_delta.decode_token` does: their new state is their old one."""
    B = q.shape[0]
    out_dtype = v.dtype
    q, k, v, g, beta = (a[:, 0] for a in _inert(_valid_mask(B, 1, lengths), q, k, v, g, beta))
    call = jax.ffi.ffi_call(TARGET, (jax.ShapeDtypeStruct(pool.shape, pool.dtype),
                                     jax.ShapeDtypeStruct(v.shape, jnp.float32)), input_output_aliases={0: 0})
    pool, o = call(pool, jnp.asarray(layer, jnp.int32).reshape(1), src.astype(jnp.int32), live.astype(jnp.int32),
                   warm.astype(jnp.bool_), q, k, v, g, beta)  # (`_inert` made q, k, v, g, beta float32)
    return o[:, None].astype(out_dtype), pool


def prefill_applies(k, v) -> bool:
    """Whether `gdn_prefill` runs the rule for keys k [B, T, Hk, dk] and values v [B, T, H, dv]: dk = dv <= MAX_DIM,
    Hk dividing H, on the CPU backend, with the kernels available."""
    return (k.ndim == v.ndim == 4 and k.shape[:2] == v.shape[:2] and k.shape[-1] == v.shape[-1] <= MAX_DIM
            and v.shape[2] % k.shape[2] == 0 and jax.default_backend() == "cpu" and available())


def gdn_prefill(q, k, v, g, beta, initial_state, lengths, saves=None):
    """The gated delta rule over a prefill step's tokens by the kernel, token by token: q, k [B, T, Hk, D] (normed;
    value head h reads key head h // (H / Hk), as `jnp.repeat` would expand them), v [B, T, H, D], g, beta
    [B, T, H]; initial_state [B, H, D, D]; lengths [B] (None: every token is real) -> (o [B, T, H, D] in v's dtype,
    the final states float32 [B, H, D, D]), and with `saves` = (rows, counts) [S] each, also the states of those
    rows after that many of their tokens, [S, H, D, D]. The same inputs and outputs as
    `gated_delta.chunk_gated_delta_rule` (with its chunk-end saves given as token counts). Only where
    `prefill_applies` said so: that registers the kernel with XLA."""
    B, T, H, D = v.shape
    out_dtype = v.dtype
    lengths = jnp.full((B,), T, jnp.int32) if lengths is None else jnp.asarray(lengths).astype(jnp.int32)
    rows, counts = (jnp.zeros((0,), jnp.int32),) * 2 if saves is None else (a.astype(jnp.int32) for a in saves)
    f32 = jax.ShapeDtypeStruct
    call = jax.ffi.ffi_call(PREFILL_TARGET, (f32(v.shape, jnp.float32), f32((B, H, D, D), jnp.float32),
                                             f32((rows.shape[0], H, D, D), jnp.float32)))
    o, state, saved = call(*(a.astype(jnp.float32) for a in (q, k, v, g, beta, initial_state)), lengths, rows, counts)
    o = o.astype(out_dtype)
    return (o, state) if saves is None else (o, state, saved)


def attention_applies(k_cache, heads: int) -> bool:
    """Whether `attention_decode` runs a one-token step's attention over this paged cache ([kv_heads, layers, blocks,
    block_size, D], uint16 bfloat16 bits or float32) for `heads` query heads: within the kernel's limits (D at most
    MAX_DIM, at most MAX_GROUP query heads per KV head), on the CPU backend, with the kernels available."""
    if k_cache.ndim != 5 or k_cache.dtype not in (jnp.uint16, jnp.float32):
        return False
    kvh, hd = k_cache.shape[0], k_cache.shape[4]
    return (hd <= MAX_DIM and heads % kvh == 0 and heads // kvh <= MAX_GROUP
            and jax.default_backend() == "cpu" and available())


def attention_decode(k_cache, v_cache, layer, q, block_tables, keys):
    """A one-token step's attention by the kernel: q [B, H, D] (normed, rotated) against each row's first `keys` [B]
    positions, its blocks `block_tables` [B, width] of this layer's paged caches -> [B, H, D] float32. Only where
    `attention_applies` said so: that registers the kernel with XLA."""
    call = jax.ffi.ffi_call(ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(k_cache, v_cache, jnp.asarray(layer, jnp.int32).reshape(1), q.astype(jnp.float32),
                block_tables.astype(jnp.int32), keys.astype(jnp.int32))


def rows_product(x, kernel):
    """x [m, n_in] @ kernel[n_out, n_in].T -> [m, n_out] float32 for bfloat16 x and kernel, by the few-row product
    kernel (float32 products and sums; a row's result depends only on whether its batch has 2-8 rows or 9-16, the
    kernel's two forms, not on the other rows). Only where `available()` said so: that registers the kernel with
    XLA."""
    return jax.ffi.ffi_call(ROWS_TARGET, jax.ShapeDtypeStruct((x.shape[0], kernel.shape[0]), jnp.float32))(x, kernel)
