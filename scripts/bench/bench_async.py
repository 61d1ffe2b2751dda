"""Async scheduling against step-by-step planning: decode inter-token latency and tokens/s at a batch of rows.

    .venv/bin/python scripts/bench/bench_async.py [--model tiny] [--batches 16,64] [--max-tokens 64] [--runs 5]
                                                  [--prompt-len 32] [--dtype float32] [--seed 0]
                                                  [--out results/bench_async.json]

Workload (offline `LLMEngine`, in-process): two engines of `--model`, `async_scheduling` off and on (max_num_seqs the
largest of `--batches`), built at once. Per batch size: one unmeasured pass of each (it compiles every shape the
workload uses), then `--runs` rounds, each a pass of the engine without async scheduling and one with it, so that a
machine whose speed drifts moves both sides of a round's ratio. A pass empties the prefix cache, adds `batch` greedy
requests of `--prompt-len` random token ids (`--seed`; ignore_eos, `--max-tokens` tokens each) at once and steps
the engine until they are done, stamping each request's new tokens with the time the step returned.

Per (batch, async), the median over the measured passes of:
- `itl_p50_ms`, `itl_p90_ms`: the gaps between a request's consecutive tokens once every request has its first (the
  decode steps, the prefills left out);
- `decode_tok_s`: tokens generated after the last request's first token, over the time from then to the last token;
- `planned_ahead`: steps planned before the samples of the step before were known (`cache_stats()`; 0 without);
- `compilations`: compilations during the measured passes, summed (should be 0);
- `same_tokens`: whether every pass gave the token ids of the first pass without async scheduling (greedy: it must).
And per batch, `itl_ratio`: the median of each round's ITL p50 without over with async scheduling (above 1: faster
with it).

Prints a table and writes JSON (default results/bench_async.json).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from gdn_jax.entrypoints.cli import nonnegative_int, output_file, positive_int, positive_ints

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared helpers in common.py
from common import (environment, median, model_config, percentile_ms, run_command,  # noqa: E402
                    write_json)


def one_pass(engine, prompts: list, args) -> dict:
    """`prompts` added at once and stepped to their end: the pass's measures and each request's token ids."""
    from gdn_jax import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    engine.reset_prefix_cache()
    before = engine.cache_stats()
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": ids}, sp)
    stamps: dict[str, list[float]] = {str(i): [] for i in range(len(prompts))}  # one time per token
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            ids = o.outputs[0].token_ids
            stamps[o.request_id] += [now] * (len(ids) - len(tokens.get(o.request_id, ())))
            tokens[o.request_id] = list(ids)
    after = engine.cache_stats()
    if any(len(tokens.get(str(i), ())) != args.max_tokens for i in range(len(prompts))):
        raise ValueError(f"requests stopped before --max-tokens ({args.max_tokens}) tokens: raise the model's "
                         "max_model_len (--prompt-len + --max-tokens must fit)")
    last_first = max(s[0] for s in stamps.values())
    gaps = [b - a for s in stamps.values() for a, b in zip(s, s[1:]) if a >= last_first]
    decode = sum(1 for s in stamps.values() for t in s if t > last_first)
    end = max(s[-1] for s in stamps.values())
    return {"itl_p50_ms": percentile_ms(gaps, 50), "itl_p90_ms": percentile_ms(gaps, 90),
            "decode_tok_s": decode / (end - last_first) if end > last_first else None,
            "planned_ahead": after["planned_ahead"] - before["planned_ahead"],
            "compilations": after["compilations"] - before["compilations"],
            "token_ids": [tokens[str(i)] for i in range(len(prompts))]}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="bench_async.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="preset, shipped model or HF folder (default: %(default)s)")
    ap.add_argument("--batches", type=positive_ints, default="16,64",
                    help="requests per pass, comma-separated (default: %(default)s)")
    ap.add_argument("--max-tokens", type=positive_int, default=64,
                    help="tokens each request generates, at least 3 (default: %(default)s)")
    ap.add_argument("--runs", type=positive_int, default=5,
                    help="measured rounds per batch size, a pass of each engine (default: %(default)s)")
    ap.add_argument("--prompt-len", type=positive_int, default=32, help="tokens of each random prompt (default: "
                    "%(default)s)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="weights and activations (default: %(default)s)")
    ap.add_argument("--seed", type=nonnegative_int, default=0, help="random prompts' seed (default: %(default)s)")
    ap.add_argument("--out", type=output_file, default="results/bench_async.json",
                    help="JSON output (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.max_tokens < 3:
        ap.error("--max-tokens must be at least 3: the latency is of the tokens after every request's first")
    cfg = model_config(args.model)
    max_model_len = args.prompt_len + args.max_tokens
    if cfg is not None and max_model_len > cfg.max_position_embeddings:
        ap.error(f"--prompt-len + --max-tokens ({max_model_len}) exceeds the {cfg.max_position_embeddings} positions "
                 f"of model {args.model}")

    from gdn_jax import LLMEngine

    engines = {ahead: LLMEngine(args.model, dtype=args.dtype, max_num_seqs=max(args.batches), verbose=False,
                                max_model_len=max_model_len, async_scheduling=ahead) for ahead in (False, True)}
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(4, engines[False].cfg.vocab_size, args.prompt_len).tolist()
               for _ in range(max(args.batches))]
    rows = []
    for batch in args.batches:
        passes = {ahead: [] for ahead in engines}
        for ahead, engine in engines.items():
            one_pass(engine, prompts[:batch], args)  # compiles the shapes of the workload
        for _ in range(args.runs):
            for ahead, engine in engines.items():
                passes[ahead].append(one_pass(engine, prompts[:batch], args))
        reference = passes[False][0]["token_ids"]
        ratio = median([None if None in (a["itl_p50_ms"], b["itl_p50_ms"]) else a["itl_p50_ms"] / b["itl_p50_ms"]
                        for a, b in zip(passes[False], passes[True])])
        for ahead, runs in passes.items():
            row = {"batch": batch, "async_scheduling": ahead,
                   **{key: median([r[key] for r in runs]) for key in ("itl_p50_ms", "itl_p90_ms", "decode_tok_s")},
                   "planned_ahead": sum(r["planned_ahead"] for r in runs),
                   "compilations": sum(r["compilations"] for r in runs),
                   "same_tokens": all(r["token_ids"] == reference for r in runs), "itl_ratio": ratio,
                   "runs": [{key: v for key, v in r.items() if key != "token_ids"} for r in runs]}
            rows.append(row)
            print(f"batch {batch} async={ahead}: ITL p50 {row['itl_p50_ms']:.2f} ms", flush=True)

    print(f"\n{args.model}, {args.dtype}, {args.max_tokens} tokens per request (greedy), median of {args.runs} rounds")
    print(f"{'batch':>5} | {'async':>5} | {'ITL p50 ms':>10} | {'ITL p90 ms':>10} | {'decode tok/s':>12} | "
          f"{'ITL off/on':>10} | {'ahead':>5} | {'compiles':>8} | same tokens")
    for r in rows:
        print(f"{r['batch']:>5} | {str(r['async_scheduling']):>5} | {r['itl_p50_ms']:>10.2f} | "
              f"{r['itl_p90_ms']:>10.2f} | {r['decode_tok_s']:>12.1f} | {r['itl_ratio']:>10.3f} | "
              f"{r['planned_ahead']:>5} | {r['compilations']:>8} | {r['same_tokens']}")
    if any(not r["same_tokens"] for r in rows):
        print("note: some greedy outputs differ from those planned step by step (the same-tokens column)")
    result, out = {"config": vars(args), "environment": environment(), "rows": rows}, Path(args.out)
    print(f"wrote {write_json(out.parent, out.name, result)}")


if __name__ == "__main__":
    run_command(main)
