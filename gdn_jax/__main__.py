"""`python -m gdn_jax`: a small generation workload with prefix caching on, then the cache statistics."""

from __future__ import annotations

import argparse
import time

from gdn_jax import LLM, SamplingParams

SYSTEM = "You are a careful research assistant. Answer briefly and cite the prefix cache when it helps. " * 2


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="tiny", help="preset name or HF folder")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--chunk-stride", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--no-prefix-caching", action="store_true")
    args = ap.parse_args(argv)

    llm = LLM(args.model, dtype=args.dtype, chunk_stride=args.chunk_stride, max_model_len=1024, max_num_seqs=8,
              enable_prefix_caching=not args.no_prefix_caching)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    questions = ["What is a Gated DeltaNet?", "Why copy a checkpoint instead of sharing it?",
                 "What does chunk_stride control?", "What is reused on a hit?"]

    def workload(system: str):
        turn1 = [system + q for q in questions]
        first = llm.generate(turn1, params, use_tqdm=False)                     # concurrent, shared system prompt
        follow = [p + o.outputs[0].text + " Tell me more." for p, o in zip(turn1, first)]
        second = llm.generate(follow, params, use_tqdm=False)                   # multi-turn continuation
        again = llm.generate(turn1[:2], params, use_tqdm=False)                 # repeated prompts
        return first, second, again

    print("warm-up round (compiles the step shapes this workload uses) ...")
    workload(SYSTEM.upper())
    compiled = llm.cache_stats()["compilations"]
    t0 = time.perf_counter()
    first, second, again = workload(SYSTEM)
    elapsed = time.perf_counter() - t0

    print(f"\n{'request':<10}{'prompt':>8}{'cached':>8}{'ttft ms':>10}  output ids")
    for name, outs in (("turn1", first), ("turn2", second), ("repeat", again)):
        for i, o in enumerate(outs):
            print(f"{name}[{i}]".ljust(10) + f"{len(o.prompt_token_ids):>8}{o.num_cached_tokens:>8}"
                  f"{1e3 * o.metrics.ttft:>10.1f}  {o.outputs[0].token_ids[:8]}")
    s = llm.cache_stats()
    print(f"\nwall {elapsed:.2f} s | queries {s['queries']} hits {s['hits']} hit rate {s['hit_rate']:.2f} | "
          f"reused {s['reused_tokens']} of {s['query_tokens']} prompt tokens | checkpoints saved "
          f"{s['checkpoints_saved']} restored {s['checkpoints_restored']} evicted {s['checkpoints_evicted']} | "
          f"compilations {s['compilations']} ({s['compilations'] - compiled} after warm-up)")


if __name__ == "__main__":
    main()
