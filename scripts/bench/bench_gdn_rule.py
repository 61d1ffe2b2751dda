"""The gated delta rule of a prefill step alone, in each of its forms, at a model's shapes.

    .venv/bin/python scripts/bench/bench_gdn_rule.py [--shapes 1x2048x16x64,1x4096x32x128,4x256x16x64] [--key-heads 0]
                                                     [--forms kernel,fused,parallel] [--chunk-size 32] [--repeats 15]
                                                     [--out results/bench_gdn_rule.json]

A shape is ROWSxTOKENSxHEADSxDIM: value heads of DIM (dk = dv), the defaults those of `hybrid-1024` at 2048 tokens,
of Qwen3.5-9B at 4096, and four ragged rows of 256 (row b holds 256 - 7b real tokens). Keys and queries have
`--key-heads` heads (0: half the value heads, as both presets have), l2-normalised, warm random states, decays and
betas as a trained model's lie. Forms (each jitted, on float32 inputs; every row's final state returned):
- `kernel`: the compiled CPU kernel the engine's prefill steps run on the CPU (`cpu_kernels.gdn_prefill`: token by
  token, queries and keys per key head); left out, with a line saying so, where the kernels do not build;
- `fused` and `parallel`: XLA's chunked form (`gated_delta.chunk_gated_delta_rule`, `--chunk-size`), the schedule
  the CPU ran before the kernel and the accelerators' one, on queries and keys repeated to the value heads.
Each form runs once, then `--repeats` times; the table gives min and median ms per form, and each form's time over
the kernel's. Every form's outputs and final states are checked against XLA's token-by-token form
(`recurrent_gated_delta_rule`) first: the largest differences are printed and kept in the JSON. Timings on a shared
machine are noisy: read the minimum, repeat the run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from gdn_jax.backends.cpu import kernels as cpu_kernels, library
from gdn_jax.entrypoints.cli import nonnegative_int, output_file, positive_int
from gdn_jax.model.forms import Forms
from gdn_jax.model.gated_delta import chunk_gated_delta_rule, l2norm, recurrent_gated_delta_rule

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared helpers in common.py
from common import run_command  # noqa: E402

FORMS = ("kernel", "fused", "parallel")
KERNELS = Forms(cpu=True, kernels=True)  # the engine's CPU forms where the kernels load


def parse_shape(text: str) -> tuple[int, int, int, int]:
    parts = text.lower().split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"a shape is ROWSxTOKENSxHEADSxDIM of positive integers, got {text!r}")
    return tuple(int(p) for p in parts)


def shapes_arg(text: str) -> list[tuple[int, int, int, int]]:
    return [parse_shape(s) for s in text.split(",") if s]


def forms_arg(text: str) -> list[str]:
    forms = [f for f in text.split(",") if f]
    unknown = [f for f in forms if f not in FORMS]
    if unknown or not forms:
        raise argparse.ArgumentTypeError(f"forms are some of {', '.join(FORMS)}, got {text!r}")
    return forms


def inputs(shape, key_heads: int, seed: int = 0):
    """(q, k [B, T, Hk, D], v [B, T, H, D], g, beta [B, T, H], s0 [B, H, D, D], lengths [B]), float32."""
    B, T, H, D = shape
    rng = np.random.default_rng(seed)
    q = l2norm(jnp.asarray(rng.standard_normal((B, T, key_heads, D)), jnp.float32)) * D**-0.5
    k = l2norm(jnp.asarray(rng.standard_normal((B, T, key_heads, D)), jnp.float32))
    v = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0.01, 0.3, (B, T, H)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.0, 1.0, (B, T, H)), jnp.float32)
    s0 = jnp.asarray(rng.standard_normal((B, H, D, D)) * 0.1, jnp.float32)
    lengths = jnp.asarray([max(1, T - 7 * b) for b in range(B)], jnp.int32)
    return q, k, v, g, beta, s0, lengths


def expanded(fn, ratio: int):
    """`fn` on queries and keys repeated to the value heads (XLA's forms take them so)."""
    def call(q, k, *rest):
        return fn(jnp.repeat(q, ratio, axis=2), jnp.repeat(k, ratio, axis=2), *rest)
    return call


def timed(fn, args, repeats: int) -> tuple[float, float]:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times), 1e3 * float(np.median(times))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=shapes_arg, default="1x2048x16x64,1x4096x32x128,4x256x16x64",
                    help="ROWSxTOKENSxHEADSxDIM, comma-separated (default: %(default)s)")
    ap.add_argument("--key-heads", type=nonnegative_int, default=0,
                    help="query and key heads (0: half the value heads) (default: %(default)s)")
    ap.add_argument("--forms", type=forms_arg, default="kernel,fused,parallel",
                    help="forms to time, comma-separated (default: %(default)s)")
    ap.add_argument("--chunk-size", type=positive_int, default=32,
                    help="the chunked forms' chunk size (default: %(default)s, the CPU's)")
    ap.add_argument("--repeats", type=positive_int, default=15, help="timed runs per form (default: %(default)s)")
    ap.add_argument("--out", type=output_file, default="results/bench_gdn_rule.json",
                    help="JSON output (default: %(default)s)")
    args = ap.parse_args(argv)
    forms = list(args.forms)
    if "kernel" in forms and not library.available():
        print("kernel: the CPU kernels are not in use here (no C++ compiler, another backend, or "
              f"{library.KERNELS_ENV}=0); timing XLA's forms only")
        forms.remove("kernel")
    results = []
    print(f"{'shape (B x T x H x D)':<22} {'Hk':>3} {'form':<9} {'min ms':>9} {'median ms':>10} {'/ kernel':>9} "
          f"{'max |do|':>10} {'max |dS|':>10}")
    for shape in args.shapes:
        B, T, H, D = shape
        key_heads = args.key_heads or max(1, H // 2)
        if H % key_heads:
            ap.error(f"--key-heads {key_heads} does not divide the {H} value heads of shape {shape}")
        data = inputs(shape, key_heads)
        ratio = H // key_heads
        fns = {"kernel": cpu_kernels.gdn_prefill,
               "fused": expanded(partial(chunk_gated_delta_rule, chunk_size=args.chunk_size, impl="fused"), ratio),
               "parallel": expanded(partial(chunk_gated_delta_rule, chunk_size=args.chunk_size, impl="parallel"),
                                    ratio)}
        o_ref, s_ref = jax.jit(expanded(recurrent_gated_delta_rule, ratio))(*data)
        row = {"shape": list(shape), "key_heads": key_heads, "forms": {}}
        for form in forms:
            if form == "kernel" and not cpu_kernels.prefill_applies(data[1], data[2], KERNELS):
                print(f"{'x'.join(map(str, shape)):<22} {key_heads:>3} kernel    (outside the kernel's limits)")
                continue
            fn = jax.jit(fns[form])
            o, s = fn(*data)
            do, ds = float(jnp.max(jnp.abs(o - o_ref))), float(jnp.max(jnp.abs(s - s_ref)))
            t_min, t_med = timed(fn, data, args.repeats)
            row["forms"][form] = {"min_ms": t_min, "median_ms": t_med, "max_abs_o_diff": do, "max_abs_state_diff": ds}
        base = row["forms"].get("kernel", {}).get("min_ms")
        for form, r in row["forms"].items():
            r["over_kernel"] = r["min_ms"] / base if base else None
            ratio_text = f"{r['over_kernel']:8.2f}x" if base else f"{'-':>9}"
            print(f"{'x'.join(map(str, shape)):<22} {key_heads:>3} {form:<9} {r['min_ms']:9.2f} {r['median_ms']:10.2f} "
                  f"{ratio_text} {r['max_abs_o_diff']:10.1e} {r['max_abs_state_diff']:10.1e}")
        results.append(row)
    result = {"backend": jax.default_backend(), "chunk_size": args.chunk_size, "repeats": args.repeats,
              "results": results}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"(min and median ms over {args.repeats} runs; the differences against XLA's token-by-token form)")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    run_command(main)
