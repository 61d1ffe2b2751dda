"""Large-model figures on an accelerator: prefill MFU, decode step against the HBM roofline, TTFT hit / off, compile.

    .venv/bin/python scripts/bench/bench_gpu.py [--preset qwen3.5-9b] [--dtype bfloat16] [--prefill-tokens 4096]
                                                [--decode-batch 64] [--shared 8192] [--new 512]
                                                [--out results/bench_gpu.json]

Random weights of the preset (nothing is downloaded), built on the default device. In one process:
1. probes: a large bfloat16 matrix product (the measured matmul peak) and a streaming read (the measured bandwidth);
2. one jitted forward of `--prefill-tokens` tokens (the engine's `forward`, last position's logits): time and model
   FLOP utilisation (matmul work: every projection, the attention products over the causal triangle, the chunked
   GDN rule), against `--peak-tflops` (the datasheet's dense bfloat16 figure) and against the measured peak;
3. through `LLMEngine.step` with the prefix cache on: a cold prompt of `--shared` + `--new` tokens, then prompts that
   share the `--shared` tokens (the hit: `--new` tokens prefilled after a restore); the first call of each shape
   is reported apart (it compiles);
4. a decode step of `--decode-batch` rows at `--decode-prompt` tokens of context, against the bytes it must move
   divided by `--hbm-gbps` (the datasheet) and by the measured read bandwidth;
5. the same cold prompt through an engine with the prefix cache off (the "off" TTFT).
Every figure is written to the JSON as soon as it is measured, so a run cut short keeps what it reached. On a CPU the
script runs too (use a small preset and sizes): the figures then only check the script.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import math
import os
import re
import statistics
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from gdn_jax import LLMEngine, SamplingParams
from gdn_jax.config import get_preset
from gdn_jax.entrypoints.cli import output_file, positive_int
from gdn_jax.model.qwen35 import forward
from gdn_jax.model.state import init_state

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared helpers in common.py
from common import (best_time, decode_bytes, forward_flops, measure_read_bandwidth, one_row_batch,  # noqa: E402
                    op_kind, run_command, trace_events)


def matmul_peak(n: int, dtype, repeats: int = 10) -> float:
    """FLOP/s of an n x n x n product in `dtype` (float32 accumulation), best of `repeats` after a warm-up."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    fn = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(dtype))
    return 2 * n**3 / best_time(fn, a, b, repeats=repeats)


def busy_ms(spans: list[tuple[float, float]]) -> float:
    """The time (ms) covered by at least one of the (start us, duration us) spans: their union's length."""
    total, end = 0.0, -float("inf")
    for start, dur in sorted(spans):
        if start + dur > end:
            total += start + dur - max(start, end)
            end = start + dur
    return total / 1e3


def trace_ops(fn, n: int) -> dict:
    """Runs fn() n times under the JAX profiler; per process of the trace (host, each device stream), the XLA op time
    per call summed by kind, the busiest ops, the time per call during which some op ran (`busy_ms`: the union of
    the ops' spans, so nested and concurrent ops count once) and the wall time per call: on a device, wall - busy is
    the time it waited between kernels (launches, host round trips)."""
    events, wall = trace_events(fn, n)
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    kinds, ops = collections.defaultdict(collections.Counter), collections.defaultdict(collections.Counter)
    spans = collections.defaultdict(list)
    for e in events:
        a = e.get("args") or {}
        if e.get("ph") == "X" and "hlo_op" in a:
            where = names.get(e["pid"], str(e["pid"]))
            kinds[where][op_kind(a["hlo_op"])] += e["dur"] / 1e3 / n
            ops[where][a["hlo_op"]] += e["dur"] / 1e3 / n
            spans[where].append((e["ts"], e["dur"]))
    return {"wall_ms": 1e3 * wall,
            "by_process": {w: {"op_ms_total": sum(k.values()), "busy_ms": busy_ms(spans[w]) / n,
                               "op_ms_by_kind": dict(k.most_common()), "top_ops_ms": dict(ops[w].most_common(15))}
                           for w, k in kinds.items()}}


def traced_or_error(fn) -> dict:
    """trace_ops(fn, 2), or the error that stopped it: the profiler is optional, the timings are kept either way."""
    try:
        return trace_ops(fn, 2)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


def step_hlo_counts(engine: LLMEngine, rows: int) -> dict:
    """What the compiled decode step of `rows` rows holds (compiled again, from its lowering): its `copy` ops, those of
    a whole pool (a pool updated out of place), and its conditionals and while loops (each of which XLA's GPU
    runtime executes by reading a value back to the host), counted in the optimized HLO text."""
    w = engine.worker
    hlo = w.compiled_step(w.step_shape(rows, 1, False)).as_text()
    pools = {x.size for x in jax.tree.leaves(w.state)}
    copies = [math.prod(int(d) for d in dims.split(",") if d)
              for dims in re.findall(r"= \w+\[([\d,]*)\]\{[^}]*\} copy\(", hlo)]
    return {"copies": len(copies), "pool_copies": sum(n in pools for n in copies),
            "conditionals": len(re.findall(r" conditional\(", hlo)), "while_loops": len(re.findall(r" while\(", hlo))}


def run_one(engine: LLMEngine, rid: str, tokens: list[int]) -> dict:
    engine.add_request(rid, tokens, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    t0 = time.perf_counter()
    done = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished and o.request_id == rid:
                done = o
    wall = time.perf_counter() - t0
    return {"ttft_s": done.metrics.ttft, "wall_s": wall, "cached": done.num_cached_tokens}


class Results:
    def __init__(self, path: str, head: dict):
        self.path, self.data = Path(path), dict(head)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.write()

    def put(self, key: str, value) -> None:
        self.data[key] = value
        self.write()
        print(f"[{key}] {json.dumps(value)}", flush=True)

    def write(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=2, default=str))


def stage(results: Results, name: str, fn):
    t0 = time.perf_counter()
    try:
        out = fn()
    except Exception as e:  # keep the other figures: one stage failing must not lose the rest
        traceback.print_exc()
        results.put(name, {"error": f"{type(e).__name__}: {e}"[:2000], "stage_s": time.perf_counter() - t0})
        return None
    if isinstance(out, dict):
        out["stage_s"] = time.perf_counter() - t0
    results.put(name, out)
    return out


def main():
    ap = argparse.ArgumentParser(prog="bench_gpu.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3.5-9b", help="model preset, random weights (default: %(default)s)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="weights and activations (default: %(default)s)")
    ap.add_argument("--prefill-tokens", type=positive_int, default=4096, help="tokens of the one-pass forward (MFU) (default: %(default)s)")
    ap.add_argument("--decode-batch", type=positive_int, default=64, help="rows of the decode step (default: %(default)s)")
    ap.add_argument("--decode-prompt", type=positive_int, default=512, help="context of the decode rows (default: %(default)s)")
    ap.add_argument("--decode-steps", type=positive_int, default=10, help="timed decode steps (default: %(default)s)")
    ap.add_argument("--shared", type=positive_int, default=8192, help="tokens the hit prompts share (default: %(default)s)")
    ap.add_argument("--new", type=positive_int, default=512, help="tokens after the shared part (default: %(default)s)")
    ap.add_argument("--chunk-stride", type=positive_int, default=512, help="tokens between checkpoints (default: %(default)s)")
    ap.add_argument("--rounds", type=positive_int, default=3, help="timed rounds of each TTFT (default: %(default)s)")
    ap.add_argument("--pool-gib", type=float, default=24.0, help="memory budget of the KV + linear-state pools (default: %(default)s)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="datasheet dense bfloat16 TFLOP/s (H200 SXM) (default: %(default)s)")
    ap.add_argument("--hbm-gbps", type=float, default=4800.0, help="datasheet memory bandwidth GB/s (H200) (default: %(default)s)")
    ap.add_argument("--matmul-probe", type=positive_int, default=8192, help="size of the matmul-peak probe (default: %(default)s)")
    ap.add_argument("--skip", default="", help="comma-separated stages to skip: forward,ttft,decode,off")
    ap.add_argument("--profile", action="store_true",
                    help="also trace two forwards and two decode steps: XLA op time by kind, busy and wall time")
    ap.add_argument("--out", type=output_file, default="results/bench_gpu.json",
                    help="JSON output (default: %(default)s)")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    cfg = get_preset(args.preset)
    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[args.dtype]
    res = Results(args.out, {"preset": args.preset, "dtype": args.dtype, "backend": jax.default_backend(),
                             "unroll_layers": os.environ.get("GDN_JAX_UNROLL_LAYERS", ""),
                             "xla_flags": os.environ.get("XLA_FLAGS", ""),
                             "devices": [str(d) for d in jax.devices()], "jax": jax.__version__, "args": vars(args)})

    def probes():
        bw = measure_read_bandwidth(mib=2048 if jax.default_backend() != "cpu" else 256)
        return {"matmul_tflops": matmul_peak(args.matmul_probe, dtype) / 1e12, "read_gbps": bw["sum"] / 1e9,
                "gemv_gbps": bw["gemv"] / 1e9}
    peak = stage(res, "probes", probes) or {}

    ctx = args.shared + args.new
    max_len = -(-max(ctx, args.decode_prompt + args.decode_steps + 8, args.prefill_tokens) // 256) * 256
    kw = dict(dtype=args.dtype, chunk_stride=args.chunk_stride, max_num_seqs=args.decode_batch, max_model_len=max_len,
              max_num_batched_tokens=ctx, memory_budget_bytes=int(args.pool_gib * (1 << 30)), verbose=True)
    t0 = time.perf_counter()
    engine = LLMEngine(args.preset, enable_prefix_caching=True, **kw)
    res.put("engine", {"init_s": time.perf_counter() - t0, "memory": engine.memory.describe(),
                       "params_gib": sum(x.nbytes for x in jax.tree.leaves(engine.worker.params)) / (1 << 30)})
    rng = np.random.default_rng(0)
    words = lambda n: rng.integers(0, cfg.vocab_size, n).tolist()  # noqa: E731

    def fwd():
        T, bs = args.prefill_tokens, 16
        batch, nb = one_row_batch(words(T), bs)
        state = init_state(cfg, nb + 1, bs, 2, dtype)
        fn = jax.jit(partial(forward, forms=engine.worker.forms), static_argnums=(0, 4), donate_argnums=(3,))
        g, p = engine.worker.graphdef, engine.worker.params
        t0 = time.perf_counter()
        logits, state = fn(g, p, batch, state, False)
        logits.block_until_ready()
        first = time.perf_counter() - t0
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            logits, state = fn(g, p, batch, state, False)
            logits.block_until_ready()
            times.append(time.perf_counter() - t0)
        fl = forward_flops(cfg, T)
        best = min(times)
        out = {"tokens": T, "first_call_s": first, "times_s": times, "best_s": best, "flops": fl,
               "tflops": fl["total"] / best / 1e12, "mfu_datasheet": fl["total"] / best / (args.peak_tflops * 1e12),
               "finite": bool(jnp.isfinite(logits).all())}
        if peak.get("matmul_tflops"):
            out["mfu_measured_peak"] = fl["total"] / best / (peak["matmul_tflops"] * 1e12)
        if args.profile:
            def call():
                nonlocal logits, state
                logits, state = fn(g, p, batch, state, False)
                logits.block_until_ready()
            out["profile"] = traced_or_error(call)
        del state
        return out
    if "forward" not in skip:
        stage(res, "forward", fwd)

    shared = words(args.shared)

    def ttft():
        out = {"context": ctx, "shared": args.shared, "new": args.new}
        warm = words(args.shared)  # first calls compile the cold and the hit shapes (other tokens than the rounds')
        out["cold_first_call"] = run_one(engine, "warm-cold", warm + words(args.new))
        out["hit_first_call"] = run_one(engine, "warm-hit", warm + words(args.new))
        cold, hit = [], []
        for r in range(args.rounds):
            engine.reset_prefix_cache()
            cold.append(run_one(engine, f"cold{r}", shared + words(args.new)))
            hit.append(run_one(engine, f"hit{r}", shared + words(args.new)))
        out["cold"], out["hit"] = cold, hit
        out["cold_ttft_ms_median"] = 1e3 * statistics.median(c["ttft_s"] for c in cold)
        out["hit_ttft_ms_median"] = 1e3 * statistics.median(h["ttft_s"] for h in hit)
        out["hit_cached"] = [h["cached"] for h in hit]
        return out
    if "ttft" not in skip:
        stage(res, "ttft", ttft)

    def decode():
        B, P = args.decode_batch, args.decode_prompt
        params = SamplingParams(temperature=0.0, max_tokens=args.decode_steps + 6, ignore_eos=True)
        engine.reset_prefix_cache()
        for i in range(B):
            engine.add_request(f"d{i}", words(P), params)
        t0 = time.perf_counter()
        steps, started = 0, set()  # the requests that have their first token
        while len(started) < B and steps < 10 * B:
            started |= {o.request_id for o in engine.step()}
            steps += 1
        prefill_s = time.perf_counter() - t0
        times = []
        for _ in range(args.decode_steps + 2):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        first, times = times[:2], times[2:]
        by = decode_bytes(engine, B, P + 4)
        med = statistics.median(times)
        out = {"batch": B, "context": P, "prefill_steps": steps, "prefill_s": prefill_s, "first_steps_s": first,
               "times_s": times, "median_ms": 1e3 * med, "min_ms": 1e3 * min(times), "tokens_per_s": B / med,
               "bytes": by, "bound_ms_datasheet": 1e3 * by["total"] / (args.hbm_gbps * 1e9),
               "step_info": {k: v for k, v in engine.last_step_info.items() if isinstance(v, (int, float, str))}}
        out["x_bound_datasheet"] = out["median_ms"] / out["bound_ms_datasheet"]
        if peak.get("read_gbps"):
            out["bound_ms_measured"] = 1e3 * by["total"] / (peak["read_gbps"] * 1e9)
            out["x_bound_measured"] = out["median_ms"] / out["bound_ms_measured"]
        out["hlo"] = step_hlo_counts(engine, B)
        if args.profile:
            out["profile"] = traced_or_error(engine.step)
        while engine.has_unfinished_requests():
            engine.step()
        return out
    if "decode" not in skip:
        stage(res, "decode", decode)

    def off():
        nonlocal engine
        pools = {"num_kv_blocks": engine.memory.num_kv_blocks, "num_linear_slots": engine.memory.num_linear_slots}
        engine = None
        gc.collect()
        eng = LLMEngine(args.preset, enable_prefix_caching=False, **{**kw, **pools})
        out = {"first_call": run_one(eng, "warm-off", words(ctx))}
        runs = [run_one(eng, f"off{r}", shared + words(args.new)) for r in range(args.rounds)]
        out["runs"] = runs
        out["off_ttft_ms_median"] = 1e3 * statistics.median(r["ttft_s"] for r in runs)
        return out
    if "off" not in skip:
        stage(res, "off", off)
    print(json.dumps(res.data, indent=1, default=str)[:6000])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    run_command(main)
