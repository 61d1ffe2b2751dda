"""Inter-token latency of running decodes while a long cold prompt arrives: separate steps against mixed steps.

    .venv/bin/python scripts/bench/bench_itl.py [--model tiny] [--dtype float32] [--decoders 8] [--prompt 2048]
                                                [--runs 3]

Workload (offline `LLMEngine`, in-process): `--decoders` requests (short prompts of their own) decode greedily; once
each has `--lead` tokens, a cold `--prompt`-token request (random ids, never seen) arrives. The decoders keep
going until each has `--max-tokens` tokens. ITL: the gaps between a decoder's consecutive tokens, over the whole run
(the p99 is the stall while the long prompt prefills); TTFT of the long request from its arrival to its first token;
the median time of a step that prefills a chunk of the long prompt of at least half the budget (with the decode
rows, in a mixed step).

Modes: `separate` (`mixed_steps=False`: a step is all-prefill or all-decode, prefill first: the scheduling of the
engine before mixed steps, unchanged) and `mixed` (`mixed_steps=True`: every running decode gets its token in each
step, prefill rows take the rest of `--max-num-batched-tokens`). Each mode builds one engine, runs one unmeasured
pass (compiles every shape the workload uses), then `--runs` measured passes, each with fresh tokens and the prefix
cache reset; a pass that compiled is reported. Prints a table (min / median over the runs) and writes JSON (default
results/bench_itl.json).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from gdn_jax.entrypoints.cli import nonnegative_int, output_file, positive_int

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared helpers in common.py
from common import run_command  # noqa: E402


def one_pass(engine, args, rng) -> dict:
    from gdn_jax import SamplingParams
    vocab = engine.cfg.vocab_size
    decode_sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    long_sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.scheduler.reset_prefix_cache()
    before = engine.cache_stats()["compilations"]
    times: dict[str, list[float]] = {}
    for i in range(args.decoders):
        engine.add_request(f"d{i}", rng.integers(4, vocab, args.short).tolist(), decode_sp)
    arrived = None
    steps = mixed = 0
    durations: dict[str, list[float]] = {"prefill": [], "mixed": [], "decode": []}
    while engine.has_unfinished_requests():
        if arrived is None and all(len(times.get(f"d{i}", ())) >= args.lead for i in range(args.decoders)):
            engine.add_request("long", rng.integers(4, vocab, args.prompt).tolist(), long_sp)
            arrived = time.perf_counter()
        # the long prompt prefills from its arrival to the step that samples its first token; the decoders' own
        # prompts, before it arrives, can take half the budget too, and are no long chunk
        long_prefills = arrived is not None and "long" not in times
        t0 = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        steps += 1
        info = engine.last_step_info
        kind = "decode" if not info["is_prefill"] else "mixed" if info["decode_rows"] else "prefill"
        mixed += kind == "mixed"
        chunk = info["tokens"] - info["decode_rows"]
        if kind == "decode" or (long_prefills and chunk >= args.max_num_batched_tokens // 2):
            durations[kind].append(now - t0)  # prefill and mixed: only steps with a long chunk
        for o in outs:
            times.setdefault(o.request_id, []).append(now)
    itl = [g for rid, ts in times.items() if rid != "long" for g in np.diff(ts).tolist()]
    return {"p50_itl_ms": 1e3 * float(np.percentile(itl, 50)), "p99_itl_ms": 1e3 * float(np.percentile(itl, 99)),
            "max_itl_ms": 1e3 * max(itl), "long_ttft_ms": 1e3 * (times["long"][0] - arrived),
            "steps": steps, "mixed_steps": mixed, "gaps": len(itl),
            **{f"{k}_step_ms": 1e3 * statistics.median(v) if v else None for k, v in durations.items()},
            "compilations": engine.cache_stats()["compilations"] - before}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="bench_itl.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="preset or HF folder (default: %(default)s)")
    ap.add_argument("--dtype", default="float32", help="weights and activations (default: %(default)s)")
    ap.add_argument("--decoders", type=positive_int, default=8, help="decoding requests (default: %(default)s)")
    ap.add_argument("--short", type=positive_int, default=32, help="prompt tokens of each decoder (default: %(default)s)")
    ap.add_argument("--prompt", type=positive_int, default=2048, help="the long cold prompt, tokens (default: %(default)s)")
    ap.add_argument("--lead", type=nonnegative_int, default=4, help="tokens each decoder has when it arrives (default: %(default)s)")
    ap.add_argument("--max-tokens", type=positive_int, default=48, help="tokens per decoder (default: %(default)s)")
    ap.add_argument("--chunk-stride", type=positive_int, default=256, help="tokens between checkpoints (default: %(default)s)")
    ap.add_argument("--max-num-batched-tokens", type=positive_int, default=512, help="token budget per step (default: %(default)s)")
    ap.add_argument("--max-model-len", type=positive_int, default=4096, help="engine max_model_len (default: %(default)s)")
    ap.add_argument("--modes", nargs="+", default=["separate", "mixed"], choices=["separate", "mixed"],
                    help="scheduling modes to measure (default: %(default)s)")
    ap.add_argument("--runs", type=positive_int, default=3, help="measured passes per mode (default: %(default)s)")
    ap.add_argument("--seed", type=nonnegative_int, default=0, help="workload seed (default: %(default)s)")
    ap.add_argument("--out", type=output_file, default="results/bench_itl.json",
                    help="JSON output (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.lead >= args.max_tokens:
        ap.error(f"--lead ({args.lead}) must be below --max-tokens ({args.max_tokens}): the long prompt arrives while "
                 "the decoders still decode")
    # checked before an engine is built: the engine ends a decoder at --max-model-len tokens without a word (its ITL
    # then over fewer tokens, or no long prompt at all when they stop before --lead), and refuses a longer prompt
    # only when it arrives
    if args.short + args.max_tokens > args.max_model_len:
        ap.error(f"--short ({args.short}) + --max-tokens ({args.max_tokens}) exceeds --max-model-len "
                 f"({args.max_model_len}): the decoders would stop early")
    if args.prompt > args.max_model_len:
        ap.error(f"--prompt ({args.prompt}) exceeds --max-model-len ({args.max_model_len})")

    from gdn_jax import LLMEngine
    report = {"config": vars(args), "modes": {}}
    for mode in args.modes:
        engine = None  # the previous mode's engine goes before the next one takes its share of an accelerator
        gc.collect()
        engine = LLMEngine(args.model, dtype=args.dtype, chunk_stride=args.chunk_stride, max_num_seqs=args.decoders + 1,
                           max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                           mixed_steps=mode == "mixed", verbose=False)
        rng = np.random.default_rng(args.seed)
        one_pass(engine, args, rng)  # compiles the shapes of the workload
        runs = [one_pass(engine, args, rng) for _ in range(args.runs)]
        report["modes"][mode] = {"runs": runs, **{f"{k}_{name}": f([r[k] for r in runs]) for k in (
            "p50_itl_ms", "p99_itl_ms", "max_itl_ms", "long_ttft_ms") for name, f in (("min", min),
                                                                                      ("median", statistics.median))}}
        # the table's long chunk step: the median of the runs' medians of the steps prefilling a long chunk (all
        # prefill or mixed); None: no step prefilled half the budget or more (a long prompt shorter than that)
        chunks = [x[k] for x in runs for k in ("prefill_step_ms", "mixed_step_ms") if x[k] is not None]
        report["modes"][mode]["long_chunk_step_ms_median"] = statistics.median(chunks) if chunks else None
        del engine

    print(f"{args.model} {args.dtype}: {args.decoders} decoders, a cold {args.prompt}-token prompt arrives; "
          f"stride {args.chunk_stride}, budget {args.max_num_batched_tokens} tokens/step; {args.runs} runs (min / median)")
    print(f"{'mode':>9} | {'p50 ITL ms':>15} | {'p99 ITL ms':>15} | {'max ITL ms':>15} | {'long TTFT ms':>15} | "
          f"{'steps (mixed)':>13} | long chunk step ms | compiles")
    for mode, r in report["modes"].items():
        cells = " | ".join(f"{r[k + '_min']:6.1f} / {r[k + '_median']:6.1f}"
                           for k in ("p50_itl_ms", "p99_itl_ms", "max_itl_ms", "long_ttft_ms"))
        last = r["runs"][-1]
        chunk = r["long_chunk_step_ms_median"]
        chunk = f"{chunk:18.1f}" if chunk is not None else f"{'-':>18}"
        print(f"{mode:>9} | {cells} | {last['steps']:>5} ({last['mixed_steps']:>3})  | {chunk} | "
              f"{sum(x['compilations'] for x in r['runs'])}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    run_command(main)
