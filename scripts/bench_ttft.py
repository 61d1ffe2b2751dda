"""TTFT with and without the linear-state prefix cache, and the cost of a restore inside a step.

    python scripts/bench_ttft.py [--preset hybrid-1024] [--prompt 2048] [--shared 1792] [--chunk-stride 256]

Request A (a `--prompt`-token prompt) runs first; request B shares A's first `--shared` tokens and has its own
tail. With the cache on, B restores the checkpoint at `--shared` and prefills only its tail; with it off, B
prefills everything. TTFT is client-side (submission to first token) after warm-up (one untimed round on other
tokens compiles every shape used). Also compares the engine step in which B's tail runs after a warm restore with
the step that runs the same tail shape (same rows, tokens, blocks) without one. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import numpy as np

from gdn_jax import LLMEngine, SamplingParams


def run_request(engine: LLMEngine, rid: str, prompt: list[int]) -> dict:
    """Submits one request and steps until its first token; returns TTFT and the per-step timings."""
    steps = []
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    first = None
    while engine.has_unfinished_requests():
        s0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - s0
        steps.append({"seconds": dt, **engine.last_step_info})
        for o in outs:
            if first is None and o.outputs[0].token_ids:
                first = time.perf_counter() - t0
                cached = o.num_cached_tokens
    return {"ttft_s": first, "num_cached_tokens": cached, "steps": steps}


def main():
    ap = argparse.ArgumentParser(prog="bench_ttft.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="hybrid-1024", help="model preset or HF folder (default: %(default)s)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and activations (default: %(default)s)")
    ap.add_argument("--prompt", type=int, default=2048, help="tokens of each prompt (default: %(default)s)")
    ap.add_argument("--shared", type=int, default=1792, help="tokens request B shares with request A (default: %(default)s)")
    ap.add_argument("--chunk-stride", type=int, default=256, help="tokens between checkpoints (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds after the warm-up round (default: %(default)s)")
    ap.add_argument("--out", default="results/bench_ttft.json", help="JSON output (default: %(default)s)")
    args = ap.parse_args()

    kw = dict(dtype=args.dtype, chunk_stride=args.chunk_stride, block_size=16, max_num_seqs=4,
              max_model_len=args.prompt + 64, num_linear_slots=16, max_num_batched_tokens=args.chunk_stride)
    engines = {"cache on": LLMEngine(args.preset, enable_prefix_caching=True, **kw),
               "cache off": LLMEngine(args.preset, enable_prefix_caching=False, **kw)}
    vocab = engines["cache on"].cfg.vocab_size
    rng = np.random.default_rng(0)
    results = {name: [] for name in engines}
    for rnd in range(args.rounds + 1):  # round 0 is the warm-up
        a = rng.integers(4, vocab, args.prompt).tolist()
        b = a[:args.shared] + rng.integers(4, vocab, args.prompt - args.shared).tolist()
        for name, engine in engines.items():
            run_request(engine, f"a{rnd}", a)
            r = run_request(engine, f"b{rnd}", b)
            if rnd:
                results[name].append(r)

    on, off = results["cache on"], results["cache off"]
    ttft_on = statistics.median(r["ttft_s"] for r in on)
    ttft_off = statistics.median(r["ttft_s"] for r in off)
    # B's tail chunk: with the cache it is B's only prefill step and starts with a warm restore; without the
    # cache it is B's last prefill step (same shape: 1 row, chunk_stride tokens, same block count), no restore.
    restore_step = statistics.median(r["steps"][0]["seconds"] for r in on)
    plain_step = statistics.median(r["steps"][-1]["seconds"] for r in off)
    assert all(r["steps"][0]["warm_restores"] == 1 for r in on)
    assert all(r["steps"][-1]["warm_restores"] == 0 for r in off)
    ratio = ttft_on / ttft_off

    print(f"\n{args.preset} ({args.dtype}), backend {jax.default_backend()}: prompt {args.prompt}, "
          f"shared {args.shared}, chunk_stride {args.chunk_stride}; median of {args.rounds} rounds after warm-up")
    print(f"{'':<28}{'cache on':>12}{'cache off':>12}")
    print(f"{'TTFT of B (ms)':<28}{1e3 * ttft_on:>12.1f}{1e3 * ttft_off:>12.1f}")
    print(f"{'cached tokens of B':<28}{on[0]['num_cached_tokens']:>12}{off[0]['num_cached_tokens']:>12}")
    print(f"{'prefill steps of B':<28}{len(on[0]['steps']):>12}{len(off[0]['steps']):>12}")
    print(f"TTFT ratio on/off: {ratio:.3f} (target <= 0.25)")
    print(f"tail step with restore {1e3 * restore_step:.1f} ms vs without {1e3 * plain_step:.1f} ms: "
          f"{100 * (restore_step / plain_step - 1):+.1f}% (target within 5%)")
    out = {"args": vars(args), "backend": jax.default_backend(), "ttft_on_s": ttft_on, "ttft_off_s": ttft_off,
           "ttft_ratio": ratio, "restore_step_s": restore_step, "plain_step_s": plain_step,
           "restore_step_overhead": restore_step / plain_step - 1, "rounds": results,
           "memory": {n: e.memory.describe() for n, e in engines.items()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
