"""`python -m gdn_jax`: a small workload (shared system prompt, multi-turn follow-ups, repeats) with the prefix cache
on and off: per-request reuse and TTFT of the measured round, the cache counters, and whether outputs agree."""

from __future__ import annotations

import argparse
import statistics
import time

from gdn_jax import LLM, SamplingParams
from gdn_jax.entrypoints.cli import HelpFormatter, add_engine_args, engine_config, positive_int

SYSTEM = ("The Python Language Reference describes the syntax and core semantics of the language. Each section "
          "below explains one statement or concept, with its grammar and an example.\n\n")
QUESTIONS = ['The "while" statement is used for', 'The "import" statement', 'A function definition defines',
             'The "with" statement is used to']
COUNTERS = ("queries", "hits", "query_tokens", "reused_tokens", "readmissions", "checkpoints_saved",
            "checkpoints_restored", "rotation_copies", "checkpoints_evicted", "preemptions", "compilations")


def _workload(llm: LLM, system: str, params: SamplingParams):
    """Round: 4 questions under one system prompt (concurrent), their follow-ups (multi-turn), 2 repeats."""
    turn1 = [system + q for q in QUESTIONS]
    first = llm.generate(turn1, params, use_tqdm=False)
    follow = [p + o.outputs[0].text + "\n\nFor example," for p, o in zip(turn1, first)]
    second = llm.generate(follow, params, use_tqdm=False)
    again = llm.generate(turn1[:2], params, use_tqdm=False)
    return [("turn1", first), ("turn2", second), ("repeat", again)]


def _measured(llm: LLM, params: SamplingParams):
    """Warm-up round (compiles every shape the workload uses, and runs its saves and restores once), an emptied
    prefix cache, then the same round measured; returns the measured round's outputs, its counter deltas and the
    warm-up's."""
    s0 = llm.cache_stats()
    _workload(llm, SYSTEM, params)
    llm.reset_prefix_cache()
    s1 = llm.cache_stats()
    t0 = time.perf_counter()
    rounds = _workload(llm, SYSTEM, params)
    wall = time.perf_counter() - t0
    s2 = llm.cache_stats()
    return rounds, wall, {k: s2[k] - s1[k] for k in COUNTERS}, {k: s1[k] - s0[k] for k in COUNTERS}


def _show(text: str, width: int) -> str:
    r = repr(text)
    return r if len(r) <= width else r[:width - 1] + "…"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m gdn_jax", description=__doc__, formatter_class=HelpFormatter)
    add_engine_args(ap, only=("model", "dtype", "chunk_stride"))
    ap.add_argument("--max-tokens", type=positive_int, default=32, help="tokens generated per request (greedy)")
    ap.add_argument("--width", type=positive_int, default=60, help="characters of output text shown per request")
    args = ap.parse_args(argv)
    try:
        _run(args)
    except ValueError as e:  # a setting the engine refused (it names it): one line, not a traceback
        ap.error(str(e))


def _run(args) -> None:

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    results = {}
    for caching in (True, False):
        llm = LLM(engine_config(args, enable_prefix_caching=caching, max_model_len=1024, max_num_seqs=8, verbose=False))
        if caching:
            print(f"[gdn_jax] {llm.engine.cfg.name}: {llm.engine.memory.describe()}")
            print("warm-up round (compiles the step shapes this workload uses), then the measured round; "
                  "then both again with the cache off ...")
        results[caching] = _measured(llm, params)

    rounds, wall, delta, warm = results[True]
    off_rounds, off_wall = results[False][:2]
    cs, n1 = args.chunk_stride, len(rounds[0][1][0].prompt_token_ids)
    print(f"\nmeasured round, cache on, checkpoints every {cs} tokens (after a warm-up round and an emptied cache)")
    print(f"  cached: tokens reused = min(KV match, checkpoint reach), always on a checkpoint boundary. The turn1 "
          f"requests share a system prompt but run in the same step, so none finds another's checkpoint. turn2 "
          f"extends turn1[0]'s {n1} tokens and reuses {(n1 - 1) // cs * cs}: the deepest {cs}-token boundary below "
          f"them; repeats reuse the same boundary. ttft: submission to first token, ms, cache on / off.")
    print(f"{'request':<10}{'prompt':>7}{'cached':>7}{'ttft on':>9}{'ttft off':>9}  output (greedy, "
          f"{args.max_tokens} tokens)")
    ttft_on, ttft_off, same = [], [], True
    for (name, outs), (_, offs) in zip(rounds, off_rounds):
        for i, (o, f) in enumerate(zip(outs, offs)):
            ttft_on.append(o.metrics.ttft)
            ttft_off.append(f.metrics.ttft)
            same &= o.outputs[0].token_ids == f.outputs[0].token_ids
            print(f"{name}[{i}]".ljust(10) + f"{len(o.prompt_token_ids):>7}{o.num_cached_tokens:>7}"
                  f"{1e3 * o.metrics.ttft:>9.1f}{1e3 * f.metrics.ttft:>9.1f}  {_show(o.outputs[0].text, args.width)}")
    d = delta
    print(f"\nmeasured round: wall {wall:.2f} s (cache off {off_wall:.2f} s) | queries {d['queries']} hits {d['hits']} "
          f"hit rate {d['hits'] / max(d['queries'], 1):.2f} | reused {d['reused_tokens']} of {d['query_tokens']} "
          f"prompt tokens | checkpoints saved {d['checkpoints_saved']} restored {d['checkpoints_restored']} "
          f"evicted {d['checkpoints_evicted']} | rotation copies {d['rotation_copies']} | "
          f"compilations {d['compilations']}")
    print(f"warm-up round: compilations "
          f"{warm['compilations']}, queries {warm['queries']}, hits {warm['hits']}")
    print(f"outputs identical with and without the cache: {'yes' if same else 'NO'} | "
          f"mean TTFT cache on / off: {statistics.fmean(ttft_on) / statistics.fmean(ttft_off):.2f}")


if __name__ == "__main__":
    main()
