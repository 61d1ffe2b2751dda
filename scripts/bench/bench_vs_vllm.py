"""TTFT and decode step of gdn-jax measured the way the vLLM-CPU comparison measures vLLM, on the same HF folder.

    .venv/bin/python scripts/bench/bench_vs_vllm.py --model FOLDER [--shared 1536] [--suffix 512] [--n 5]
                                                    [--vllm RESULTS]

Through `LLM.generate`, bfloat16, prefix caching on, random token ids (no tokenizer), greedy:
- cold: `shared + suffix` fresh random tokens, `max_tokens=1`, median of `--n` after one warm-up prompt;
- hit: one fixed `shared`-token prefix followed by `suffix` fresh tokens, median of `--n` after two warm-up prompts
  (the first caches the prefix, the second compiles the hit's step shape: the engine compiles per shape, which a
  serving engine does once at start, `LLMEngine.warm_up`); the tokens reused in each timed round are reported;
- decode: `(time of 65 new tokens - time of 1) / 64` for a batch of 1 and of 16 `--decode-prompt`-token prompts
  (512), the medians of `--n` rounds of each length after one warm-up round of each (a round's prefill steps vary by
  a few hundred ms from round to round, which one round of each would divide by 64 into the figure). It is not the
  engine's decode step time: with mixed steps the rows that finish their prefill first decode while the others
  prefill, and the decode tokens take part of each step's token budget, so the 65-token round's prefill takes longer
  than the 1-token round's (at 16 rows x 512 tokens: one more, padded prefill step), which this difference counts as
  decoding. vLLM's figure counts the same effect at its own budget (4096 on the CPU): `--max-num-batched-tokens 4096`
  gives this engine the same. Beside it, `decode_engine_step_s_B*` (the "engine step inside" rows): the median
  `LLMEngine.step` of the 65-token rounds, 64 of whose steps decode only (scripts/bench/bench_decode.py measures that
  step on its own).
`--vllm FILE`: lines `RESULT {...}` printed by vLLM's side (its TTFT and decode runs on the same folder), to print
the ratio table. Writes JSON (`--out`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

from gdn_jax import LLM, SamplingParams
from gdn_jax.entrypoints.cli import output_file, positive_int

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared helpers in common.py
from common import run_command  # noqa: E402


def measure(args) -> dict:
    L, S = args.shared, args.suffix
    budget = {} if args.max_num_batched_tokens is None else dict(max_num_batched_tokens=args.max_num_batched_tokens)
    llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=True, max_model_len=max(2048, L + S + 16),
              max_num_seqs=16, seed=0, **budget)
    V = llm.engine.cfg.vocab_size
    rng = np.random.default_rng(99)
    one = SamplingParams(max_tokens=1, temperature=0.0)

    def run(ids: list[int]) -> tuple[float, int]:
        t = time.perf_counter()
        out = llm.generate([ids], one, use_tqdm=False)[0]
        return time.perf_counter() - t, out.metrics.num_cached_tokens

    run(rng.integers(0, V, L + S).tolist())
    cold = [run(rng.integers(0, V, L + S).tolist())[0] for _ in range(args.n)]
    prefix = rng.integers(0, V, L).tolist()
    for _ in range(2):  # the first caches the prefix, the second compiles the hit's step shape
        run(prefix + rng.integers(0, V, S).tolist())
    hits = [run(prefix + rng.integers(0, V, S).tolist()) for _ in range(args.n)]

    steps = []  # wall seconds of each engine step while a decode round runs
    engine_step = llm.engine.step

    def step():
        t = time.perf_counter()
        out = engine_step()
        steps.append(time.perf_counter() - t)
        return out

    def decode_step(B: int) -> tuple[float, float]:
        def timed(n: int) -> float:
            prompts = [rng.integers(0, V, args.decode_prompt).tolist() for _ in range(B)]
            t = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
            return time.perf_counter() - t

        timed(65), timed(1)  # both compile their step shapes here (a one-token request ends with its prefill)
        long, short, inside = [], [], []
        llm.engine.step = step
        try:
            for _ in range(args.n):
                steps.clear()
                long.append(timed(65))
                inside.append(statistics.median(steps))  # 64 of a round's steps are decode steps (the rest prefill)
                short.append(timed(1))
        finally:
            llm.engine.step = engine_step
        return (statistics.median(long) - statistics.median(short)) / 64, statistics.median(inside)

    return {"shared": L, "suffix": S, "dtype": args.dtype, "chunk_stride": llm.engine.worker.stride,
            "max_num_batched_tokens": llm.engine.scheduler_config.max_num_batched_tokens,
            "cold_s": statistics.median(cold), "cold_all_s": cold,
            "hit_s": statistics.median(h[0] for h in hits), "hit_all_s": [h[0] for h in hits],
            "cached": sorted({h[1] for h in hits}),
            **{key: value for B in (1, 16)
               for key, value in zip((f"decode_step_s_B{B}", f"decode_engine_step_s_B{B}"), decode_step(B))}}


def read_vllm(path: str) -> dict:
    """Merges the `RESULT {...}` lines of vLLM's TTFT and decode runs into one dict."""
    merged = {}
    for line in Path(path).read_text().splitlines():
        if line.startswith("RESULT "):
            rec = json.loads(line[len("RESULT "):])
            merged.update(rec.pop("apc_on", {}))
            merged.update(rec)
    return merged


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="bench_vs_vllm.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF folder (or preset name)")
    ap.add_argument("--shared", type=positive_int, default=1536, help="tokens of the cached prefix (default: %(default)s)")
    ap.add_argument("--suffix", type=positive_int, default=512, help="new tokens after it (default: %(default)s)")
    ap.add_argument("--n", type=positive_int, default=5, help="timed rounds per figure (default: %(default)s)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="(default: %(default)s)")
    ap.add_argument("--vllm", help="file with vLLM's RESULT lines for the same folder and shapes")
    ap.add_argument("--out", type=output_file, default="results/bench_vs_vllm.json",
                    help="JSON output (default: %(default)s)")
    ap.add_argument("--decode-prompt", type=positive_int, default=512, help="prompt tokens of the decode rounds (default: %(default)s)")
    ap.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                    help="the engine's token budget per step (default: the engine's, 2048). vLLM-CPU's default is 4096 "
                         "(its start-up log says so): with the same budget both prefill the decode rounds' prompts "
                         "in as many steps, which the decode figure counts")
    args = ap.parse_args(argv)
    ours = measure(args)
    peer = read_vllm(args.vllm) if args.vllm else {}
    rows = [("cold TTFT, shared + suffix tokens", "cold_s", "cold"), ("hit TTFT, shared cached + suffix new", "hit_s", "hit"),
            ("decode step, batch 1", "decode_step_s_B1", "decode_step_s_B1"),
            ("decode step, batch 16", "decode_step_s_B16", "decode_step_s_B16"),
            ("  engine step inside, batch 1", "decode_engine_step_s_B1", None),
            ("  engine step inside, batch 16", "decode_engine_step_s_B16", None)]
    print(f"\n{args.model}: {args.shared} + {args.suffix} tokens, {args.dtype}, backend {jax.default_backend()}, "
          f"cached in the hit rounds: {ours['cached']}")
    print(f"{'':40s}{'gdn-jax ms':>12s}{'vLLM ms':>10s}{'ratio':>8s}")
    table = []
    for label, key, peer_key in rows:
        mine, theirs = 1e3 * ours[key], (1e3 * peer[peer_key] if peer_key in peer else None)
        ratio = mine / theirs if theirs else None
        table.append({"figure": label, "gdn_jax_ms": mine, "vllm_ms": theirs, "ratio": ratio})
        print(f"{label:40s}{mine:12.1f}{theirs if theirs else float('nan'):10.1f}{ratio if ratio else float('nan'):8.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"gdn_jax": ours, "vllm": peer, "table": table}
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    run_command(main)
