"""What a hand-written CPU product could reach at decode's shapes, against XLA's: the evidence for (or against) a
custom kernel for the decode step on an AVX-512 BF16 CPU.

    .venv/bin/python scripts/bench/bench_kernel_ceiling.py [--k 1024] [--n 4096] [--matrices 8] [--rows 1 16]
                                                           [--threads 2] [--repeats 30] [--gdn-rows 16 64]
                                                           [--gdn-layers 6] [--gdn-slots 326] [--gdn-heads 16]
                                                           [--gdn-dim 64] [--out results/bench_kernel_ceiling.json]

It compiles a small C file with the system's C compiler (`cc -O3 -march=native -fopenmp`, into a temporary folder;
nothing is installed, the package never uses it) and measures, on this machine:
- the peak rate of one core's register-only loops of `vdpbf16ps` (bfloat16 pairs into float32) and of float32 FMA:
  the compute ceilings a decode step's products have on this CPU;
- `--matrices` bfloat16 matrices of `--k` x `--n` (together larger than the L3 cache, as a model's weights are)
  multiplied by `rows` rows: by a hand-written kernel (weights repacked once as bfloat16 pairs, a register tile of
  8 rows x 3 blocks of 16 columns, `--threads` OpenMP threads over the column blocks) and by the engine's own
  product (`model.dense`, jitted: the forms its decode steps compile to on this backend), in turn, `--repeats` times
  each; the kernel's results are checked against float32 products first;
- the GDN layers' decode update (`--gdn-rows`, 0 to leave it out): one token of the gated delta rule for that many
  rows on `--gdn-layers` stacked pools of `--gdn-slots` float32 states of `--gdn-heads` x `--gdn-dim`^2
  (hybrid-1024's by default), each row reading its state from one slot and writing the new one to another, as the
  engine's one-token step does: `model.advance_in_pool` in a jitted loop over the layers in XLA's form (`engine`)
  and, where it builds, with the package's compiled kernel (`package_kernel`, gdn_jax/cpu_kernels.py and
  gdn_jax/csrc/gdn_decode.cc: one pass per (row, head) on XLA's threads), in turn; the kernel's outputs and new states
  are checked against XLA's first. (Earlier versions of this script carried their own OpenMP loop for the update, the
  prototype of that kernel.)
Prints a table per part (min and median ms; GB/s of weights, GFLOP/s; GB/s of states read and written) and writes
JSON. A CPU without AVX-512 BF16, or a machine without a C compiler, is refused with a message that says which.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from gdn_jax.entrypoints.cli import nonnegative_int, output_file, positive_int
from gdn_jax.backends.cpu import kernels as cpu_kernels, tuning
from gdn_jax.model.dense import dense
from gdn_jax.model.forms import Forms
from gdn_jax.model.qwen35 import advance_in_pool

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared helpers in common.py
from common import min_median_time  # noqa: E402

KERNEL_C = r"""
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <time.h>

void set_threads(int n) { omp_set_num_threads(n); }

static double now(void) {
  struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* GFLOP/s of one core: 16 independent chains of vdpbf16ps (64 flops each) or of float32 FMA (32 flops each). */
double peak_bf16(long n) {
  __m512 acc[16];
  for (int i = 0; i < 16; i++) acc[i] = _mm512_set1_ps((float)i);
  __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = (__m512bh)_mm512_set1_epi32(0x00010001);
  double t0 = now();
  for (long i = 0; i < n; i++) {
#pragma GCC unroll 16
    for (int m = 0; m < 16; m++) acc[m] = _mm512_dpbf16_ps(acc[m], a, b);
    __asm__ volatile("" : "+v"(a));
  }
  double s = now() - t0;
  float sink = 0; for (int i = 0; i < 16; i++) sink += _mm512_reduce_add_ps(acc[i]);
  __asm__ volatile("" : : "x"(sink));
  return n * 16.0 * 64 / s / 1e9;
}

double peak_f32(long n) {
  __m512 acc[16];
  for (int i = 0; i < 16; i++) acc[i] = _mm512_set1_ps((float)i);
  __m512 x = _mm512_set1_ps(0.999f), y = _mm512_set1_ps(0.001f);
  double t0 = now();
  for (long i = 0; i < n; i++) {
#pragma GCC unroll 16
    for (int m = 0; m < 16; m++) acc[m] = _mm512_fmadd_ps(acc[m], x, y);
    __asm__ volatile("" : "+v"(x));
  }
  double s = now() - t0;
  float sink = 0; for (int i = 0; i < 16; i++) sink += _mm512_reduce_add_ps(acc[i]);
  __asm__ volatile("" : : "x"(sink));
  return n * 16.0 * 32 / s / 1e9;
}

/* Y[16][N] = X[16][K] W[K][N], bfloat16 in, float32 out. Wp: W repacked as [N/16][K/2][16][2] (the pairs
   vdpbf16ps multiplies); Xt: X as bfloat16 pairs, [K/2][16] (rows beyond the caller's are zeros). */
#define R 8
#define NBK 3
static void tile(const uint32_t* xt, const uint16_t* w0, size_t wstride, int KP, float* Y, int N, int r0, int rows,
                 int nb0) {
  __m512 acc[NBK][R];
  for (int j = 0; j < NBK; j++) for (int m = 0; m < R; m++) acc[j][m] = _mm512_setzero_ps();
  for (int kp = 0; kp < KP; kp++) {
    __m512bh w[NBK];
    for (int j = 0; j < NBK; j++) w[j] = (__m512bh)_mm512_loadu_si512((const void*)(w0 + j * wstride + (size_t)kp * 32));
    const uint32_t* x = xt + (size_t)kp * 16 + r0;
#pragma GCC unroll 8
    for (int m = 0; m < R; m++) {
      __m512bh b = (__m512bh)_mm512_set1_epi32(x[m]);
#pragma GCC unroll 3
      for (int j = 0; j < NBK; j++) acc[j][m] = _mm512_dpbf16_ps(acc[j][m], b, w[j]);
    }
  }
  for (int j = 0; j < NBK; j++)
    for (int m = 0; m < R && r0 + m < rows; m++) _mm512_storeu_ps(Y + (size_t)(r0 + m) * N + (nb0 + j) * 16, acc[j][m]);
}

void gemm_bf16(const uint32_t* Xt, const uint16_t* Wp, float* Y, int rows, int K, int N) {
  int NB = N / 16, KP = K / 2, G = (NB + NBK - 1) / NBK;
  size_t ws = (size_t)KP * 32;
#pragma omp parallel for schedule(static)
  for (int g = 0; g < G; g++) {
    int nb0 = g * NBK;
    if (nb0 + NBK > NB) nb0 = NB - NBK;  /* the last group overlaps the one before: the same values again */
    for (int r0 = 0; r0 < rows; r0 += R) tile(Xt, Wp + (size_t)nb0 * ws, ws, KP, Y, N, r0, rows, nb0);
  }
}
"""


def cpu_has_avx512_bf16() -> bool:
    try:
        return "avx512_bf16" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def build(folder: Path) -> ctypes.CDLL:
    """The kernel, compiled by the system's C compiler into `folder`."""
    if not cpu_has_avx512_bf16():
        raise SystemExit("bench_kernel_ceiling: this CPU has no AVX-512 BF16 (avx512_bf16 in /proc/cpuinfo); the "
                         "kernel is written for it")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("bench_kernel_ceiling: no C compiler (cc or gcc) on PATH")
    src, lib = folder / "kernel.c", folder / "kernel.so"
    src.write_text(KERNEL_C)
    subprocess.run([cc, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(src), "-o", str(lib), "-lm"],
                   check=True)
    so = ctypes.CDLL(str(lib))
    so.peak_bf16.restype = so.peak_f32.restype = ctypes.c_double
    so.peak_bf16.argtypes = so.peak_f32.argtypes = [ctypes.c_long]
    so.gemm_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 3
    so.set_threads.argtypes = [ctypes.c_int]
    return so


def pack_weights(w: np.ndarray) -> np.ndarray:
    """[K, N] bfloat16 -> [N/16, K/2, 16, 2]: for each block of 16 columns, the K/2 pairs of rows in order."""
    K, N = w.shape
    return np.ascontiguousarray(w.reshape(K // 2, 2, N // 16, 16).transpose(2, 0, 3, 1))


def pack_rows(x: np.ndarray) -> np.ndarray:
    """[rows, K] bfloat16 (rows <= 16) -> [K/2, 16] uint32 pairs, zero rows below."""
    padded = np.zeros((16, x.shape[1]), x.dtype)
    padded[:len(x)] = x
    return np.ascontiguousarray(padded.view(np.uint32).T)


def gdn_update(a, rows: int, rng) -> list[dict]:
    """The GDN decode update of `rows` rows by the engine in XLA's form (`model.advance_in_pool` over the layers) and,
    where it builds, by the package's compiled kernel, after checking the kernel's outputs and new states against
    XLA's from the same pool."""
    L, slots, H, D = a.gdn_layers, a.gdn_slots, a.gdn_heads, a.gdn_dim
    pool = (rng.standard_normal((L, slots, H, D, D)) * 0.1).astype(np.float32)
    # rows continue their own slots, but every fifth starts cold and every fourth restores from another slot
    live = rng.permutation(np.arange(1, slots))[:2 * rows].astype(np.int32)
    src, live = np.where(np.arange(rows) % 4 == 1, live[rows:], live[:rows]).astype(np.int32), live[:rows].copy()
    warm = (np.arange(rows) % 5 != 3)
    k = rng.standard_normal((rows, 1, H, D)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q = rng.standard_normal((rows, 1, H, D)).astype(np.float32)
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.sqrt(D)
    v = rng.standard_normal((rows, 1, H, D)).astype(np.float32)
    g = -np.abs(rng.standard_normal((rows, 1, H))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((rows, 1, H))))).astype(np.float32)
    lengths = np.ones(rows, np.int32)

    def layers(forms, pool, src, live, warm, q, k, v, g, beta):
        def body(j, carry):
            pool, outs = carry
            o, pool = advance_in_pool(pool, src, live, warm, jnp.asarray(lengths), q, k, v, g, beta, layer=j,
                                      forms=forms)
            return pool, outs.at[j].set(o[:, 0])
        return jax.lax.fori_loop(0, L, body, (pool, jnp.zeros((L, rows, H, D), jnp.float32)))

    args = [jnp.asarray(x) for x in (src, live, warm, q, k, v, g, beta)]
    # XLA's form of the update, whatever the engine would use here: the CPU forms without the kernels
    engine = jax.jit(partial(layers, Forms(cpu=True)), donate_argnums=0).lower(jnp.asarray(pool), *args).compile()
    want_pool, want_out = engine(jnp.asarray(pool), *args)
    want_pool, want_out = np.asarray(want_pool)[:, live], np.asarray(want_out)
    state = [jnp.asarray(pool)]

    def xla():
        state[0], o = engine(state[0], *args)
        jax.block_until_ready(o)

    impls, err = [("engine", xla)], None
    forms = tuning.product_forms(jnp.float32)  # the engine's: its kernels where they load
    if cpu_kernels.applies(state[0], forms):  # the package's own compiled kernel (backends/cpu/kernels.py), as it runs
        package = jax.jit(partial(layers, forms), donate_argnums=0)
        got_pool, got_out = package(jnp.asarray(pool), *args)
        err = max(float(np.abs(np.asarray(got_out) - want_out).max() / np.abs(want_out).max()),
                  float(np.abs(np.asarray(got_pool)[:, live] - want_pool).max() / np.abs(want_pool).max()))
        if err > 1e-5:
            raise SystemExit(f"bench_kernel_ceiling: the package's GDN update kernel is wrong "
                             f"(relative error {err:.2e})")
        shipped = [got_pool]

        def package_kernel():
            shipped[0], o = package(shipped[0], *args)
            jax.block_until_ready(o)

        impls.append(("package_kernel", package_kernel))
    moved = 2 * L * rows * H * D * D * 4  # each row's state read once and written once per layer
    result = []
    for name, fn in impls:
        t_min, t_med = min_median_time(fn, a.repeats)
        result.append({"gdn_rows": rows, "impl": name, "ms_min": 1e3 * t_min, "ms_median": 1e3 * t_med,
                       "state_gb_per_s": moved / t_min / 1e9, "us_per_row_and_layer": 1e6 * t_med / (rows * L),
                       **({"max_relative_error": err} if name == "package_kernel" else {})})
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="bench_kernel_ceiling.py", description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=positive_int, default=1024, help="inner dimension, even (default: %(default)s)")
    ap.add_argument("--n", type=positive_int, default=4096, help="columns, a multiple of 48 or of 16 from 48 (default: %(default)s)")
    ap.add_argument("--matrices", type=positive_int, default=8, help="weight matrices per call (default: %(default)s)")
    ap.add_argument("--rows", type=positive_int, nargs="+", default=[1, 16], help="rows multiplied, at most 16 (default: 1 16)")
    ap.add_argument("--threads", type=positive_int, default=2, help="kernel threads (default: %(default)s)")
    ap.add_argument("--repeats", type=positive_int, default=30, help="timed calls of each (default: %(default)s)")
    ap.add_argument("--peak-iterations", type=positive_int, default=100_000_000,
                    help="iterations of the register-only peak loops (default: %(default)s)")
    ap.add_argument("--gdn-rows", type=nonnegative_int, nargs="+", default=[16, 64],
                    help="rows of the GDN decode update, 0: none (default: 16 64)")
    ap.add_argument("--gdn-layers", type=positive_int, default=6, help="GDN layers (default: %(default)s)")
    ap.add_argument("--gdn-slots", type=positive_int, default=326,
                    help="state slots per layer, more than twice the rows (default: %(default)s)")
    ap.add_argument("--gdn-heads", type=positive_int, default=16, help="value heads (default: %(default)s)")
    ap.add_argument("--gdn-dim", type=positive_int, default=64,
                    help="key and value head dimension (the package's kernel takes up to 256; above, XLA's form "
                         "alone) (default: %(default)s)")
    ap.add_argument("--out", type=output_file, default="results/bench_kernel_ceiling.json",
                    help="JSON output (default: %(default)s)")
    a = ap.parse_args(argv)
    if a.k % 2 or a.n % 16 or a.n < 48:
        ap.error(f"--k must be even and --n a multiple of 16 of at least 48, got {a.k} and {a.n}")
    if max(a.rows) > 16:
        ap.error(f"--rows must be at most 16, got {max(a.rows)}")
    gdn_rows = [r for r in a.gdn_rows if r]
    if gdn_rows and a.gdn_slots <= 2 * max(gdn_rows):
        ap.error(f"--gdn-slots ({a.gdn_slots}) must be more than twice --gdn-rows ({max(gdn_rows)})")
    with tempfile.TemporaryDirectory() as folder:
        so = build(Path(folder))
        so.set_threads(a.threads)
        peaks = {"bf16_dot_gflops_per_core": so.peak_bf16(a.peak_iterations),
                 "f32_fma_gflops_per_core": so.peak_f32(a.peak_iterations)}
        rng = np.random.default_rng(0)
        # the HF layout [n_out, n_in] = [N, K], as the engine holds its weights
        weights = [(rng.standard_normal((a.n, a.k)) * 0.02).astype(ml_dtypes.bfloat16) for _ in range(a.matrices)]
        packed = [pack_weights(np.ascontiguousarray(w.T)) for w in weights]
        device = [jnp.asarray(w) for w in weights]
        forms = tuning.product_forms(jnp.bfloat16)  # the engine's forms of a bfloat16 product on this machine
        xla = jax.jit(lambda x, ws: [dense(x, w, forms) for w in ws])
        weight_bytes = a.matrices * a.k * a.n * 2
        rows_out = []
        for rows in a.rows:
            x = rng.standard_normal((rows, a.k)).astype(ml_dtypes.bfloat16)
            xt, y = pack_rows(x), np.zeros((rows, a.n), np.float32)

            def kernel(xt=xt, y=y, rows=rows):
                for wp in packed:
                    so.gemm_bf16(xt.ctypes.data, wp.ctypes.data, y.ctypes.data, rows, a.k, a.n)

            so.gemm_bf16(xt.ctypes.data, packed[0].ctypes.data, y.ctypes.data, rows, a.k, a.n)
            want = x.astype(np.float32) @ weights[0].astype(np.float32).T
            err = float(np.abs(y - want).max() / np.abs(want).max())
            if err > 1e-4:
                raise SystemExit(f"bench_kernel_ceiling: the kernel's products are wrong (relative error {err:.2e})")
            xd = jnp.asarray(x)
            flops = 2 * rows * a.k * a.n * a.matrices
            for name, fn in (("kernel", kernel), ("engine", lambda: jax.block_until_ready(xla(xd, device)))):
                t_min, t_med = min_median_time(fn, a.repeats)
                rows_out.append({"rows": rows, "impl": name, "ms_min": 1e3 * t_min, "ms_median": 1e3 * t_med,
                                 "gb_per_s": weight_bytes / t_min / 1e9, "gflop_per_s": flops / t_min / 1e9,
                                 **({"max_relative_error": err} if name == "kernel" else {})})
        gdn_out = [r for rows in gdn_rows for r in gdn_update(a, rows, rng)]
    print(f"peaks, one core: bfloat16 pairs (vdpbf16ps) {peaks['bf16_dot_gflops_per_core']:.1f} GFLOP/s, "
          f"float32 FMA {peaks['f32_fma_gflops_per_core']:.1f} GFLOP/s")
    print(f"{a.matrices} bfloat16 matrices of {a.k} x {a.n} ({weight_bytes / 2**20:.0f} MiB), kernel on {a.threads} threads")
    print(f"{'rows':>4}  {'impl':<6} {'min ms':>8} {'median ms':>10} {'GB/s':>7} {'GFLOP/s':>8}")
    for r in rows_out:
        print(f"{r['rows']:>4}  {r['impl']:<6} {r['ms_min']:8.2f} {r['ms_median']:10.2f} {r['gb_per_s']:7.1f} "
              f"{r['gflop_per_s']:8.1f}")
    if gdn_out:
        print(f"GDN decode update: {a.gdn_layers} layers of {a.gdn_slots} float32 states of {a.gdn_heads} x "
              f"{a.gdn_dim} x {a.gdn_dim}, the package's kernel on XLA's threads")
        print(f"{'rows':>4}  {'impl':<14} {'min ms':>8} {'median ms':>10} {'GB/s':>7} {'us/row/layer':>13}")
        for r in gdn_out:
            print(f"{r['gdn_rows']:>4}  {r['impl']:<14} {r['ms_min']:8.2f} {r['ms_median']:10.2f} "
                  f"{r['state_gb_per_s']:7.1f} {r['us_per_row_and_layer']:13.1f}")
    result = {"k": a.k, "n": a.n, "matrices": a.matrices, "threads": a.threads, "peaks": peaks, "rows": rows_out,
              "gdn": {"layers": a.gdn_layers, "slots": a.gdn_slots, "heads": a.gdn_heads, "dim": a.gdn_dim,
                      "rows": gdn_out},
              "jax": jax.__version__, "cpus": os.cpu_count()}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")
    return result


if __name__ == "__main__":
    main()
