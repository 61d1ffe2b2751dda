"""Randomized soak of the prefix cache's exactness: cache-on engines of random geometries under memory pressure, every
request compared with the same request run alone on a cache-off engine.

    .venv/bin/python scripts/tools/soak_cache.py [--minutes 10] [--seed 0] [--requests 12]
                                                 [--out results/soak_cache.json]

Each round draws an engine geometry (block size 8 or 16; chunk_stride 16, 32 or 64; checkpoint_mode "scan" or
"promote"; in "scan" the checkpoint policy and mixed steps; the accelerators' "parallel" GDN schedule in about 15%
of rounds; 1-4 sequences; KV and checkpoint pools from barely one sequence's worth up, so that preemption,
eviction and fork fallbacks happen) and a workload on the `tiny-random` model in float32: prompts that share system
prompts, repeat earlier prompts, end at, or one or two tokens past, a checkpoint boundary, or continue an earlier
request's prompt and output; greedy or seeded sampling (top-p, top-k, min-p, penalties), n up to 4, max_tokens 1-40
or None, min_tokens, stop token ids and stop strings, logprobs and prompt logprobs. Requests arrive while others run,
and some are aborted partway. The scheduler's invariants are checked after every step; after the round the engine
must hold no sequence and no live slot, and a reset must give back every KV block and checkpoint slot.

Every finished request is then run alone on a cache-off engine of the same block size, chunk_stride and
max_model_len (one per such triple, its results kept): token ids, finish and stop reasons, text, the prompt
logprobs it computed, and the logprobs (within `--tolerance`) must be the same. Float32 only: in bfloat16 a
request's numbers also depend on which other rows share its steps (README, "Accuracy"), with the cache off too.
In float32 they depend, by a rounding (~5e-7 in a logprob), on how a prompt is split into steps: a prompt computed
in one step and the same prompt in two (a smaller token budget, a fork that fell back to its own prefill, a cache
hit) sum in another order. A sampled token drawn at a top-k or top-p boundary can then change (about 1 request in
1400). A request that differs is therefore run again on a cache-off engine with the round's token budget; if that
gives the round's output, the difference is counted as a split-order flip, not a mismatch (both references are
cache-off: a cache error cannot hide there).

Prints a line per round, then the totals (requests checked, cache hits, restores, preemptions, forks); writes JSON
(the totals, and each mismatch with its round's seed and geometry, enough to replay it). Exits 1 if any request
differed or any check failed. `--unsafe-reuse cold|stale` runs the accuracy ablation's unsafe paths instead of the
exact cache: the soak then reports the requests whose reuse changed them.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import traceback
import warnings
from pathlib import Path

import numpy as np

from gdn_jax import LLMEngine, SamplingParams
from gdn_jax.entrypoints.cli import nonnegative_int, nonnegative_number, output_file, positive_int, positive_number

MODEL = "tiny-random"
COUNTERS = ("hits", "checkpoints_restored", "preemptions", "forks", "fork_fallbacks", "checkpoints_evicted",
            "kv_blocks_evicted")


def geometry(rng) -> dict:
    block = int(rng.choice([8, 16]))
    stride = int(rng.choice([16, 32, 64]))
    seqs = int(rng.integers(1, 5))
    max_len = int(rng.choice([128, 192]))
    per_seq = -(-max_len // block)
    g = dict(block_size=block, chunk_stride=stride, checkpoint_mode=str(rng.choice(["scan", "promote"])),
             max_num_seqs=seqs, max_model_len=max_len, num_kv_blocks=per_seq + 1 + int(rng.integers(0, per_seq)),
             num_linear_slots=seqs + 1 + int(rng.integers(1, 6)),
             max_num_batched_tokens=int(rng.choice([stride, 2 * stride, 256])))
    if g["checkpoint_mode"] == "scan":
        g |= dict(checkpoint_policy=str(rng.choice(["all", "last"])), mixed_steps=bool(rng.random() < 0.8))
    if rng.random() < 0.15:
        g["gdn_schedule"] = "parallel"
    return g


def sampling(rng, seen: list[int], stop_texts: list[str]) -> SamplingParams:
    kw = dict(max_tokens=None if rng.random() < 0.05 else int(rng.integers(1, 41)), ignore_eos=bool(rng.random() < 0.5))
    if rng.random() < 0.5:
        kw |= dict(temperature=0.0, n=int(rng.integers(2, 4)) if rng.random() < 0.1 else 1)
    else:
        kw |= dict(temperature=float(rng.choice([0.5, 1.0, 1.5])), seed=int(rng.integers(2**32)),
                   top_p=float(rng.choice([0.8, 1.0])), top_k=int(rng.choice([-1, 5, 20])), n=int(rng.integers(1, 5)))
        if rng.random() < 0.2:
            kw["min_p"] = 0.05
    if rng.random() < 0.6:
        kw["logprobs"] = int(rng.choice([0, 1, 3]))
    if rng.random() < 0.25:
        kw["min_tokens"] = int(rng.integers(0, (kw["max_tokens"] or 40) + 1))
    if rng.random() < 0.3 and seen:
        kw["stop_token_ids"] = [int(t) for t in rng.choice(seen, int(rng.integers(1, 4)))]
    if rng.random() < 0.15 and stop_texts:
        # picked by index: numpy's choice over the list makes a string array, which drops trailing NUL characters
        # (a random model's text "\x00\x00" became the empty stop string, which SamplingParams refuses)
        kw |= dict(stop=[stop_texts[int(rng.integers(len(stop_texts)))]],
                   include_stop_str_in_output=bool(rng.random() < 0.5))
    if rng.random() < 0.15:
        kw |= dict(prompt_logprobs=int(rng.choice([0, 2])), skip_reading_prefix_cache=bool(rng.random() < 0.5))
    if rng.random() < 0.15:
        kw |= dict(repetition_penalty=float(rng.choice([0.8, 1.3])), presence_penalty=float(rng.choice([-0.5, 0.7])))
    return SamplingParams(**kw)


def prompt(rng, g: dict, vocab: int, systems: list, earlier: list, finished: list) -> list[int]:
    def fresh(n):
        return rng.integers(4, vocab, n).tolist()

    u = rng.random()
    if u < 0.15 and earlier:  # an exact repeat
        p = list(earlier[rng.integers(len(earlier))])
    elif u < 0.3 and finished:  # a continuation of an earlier request: its prompt, its output, more
        out = finished[rng.integers(len(finished))]
        p = out.prompt_token_ids + out.outputs[0].token_ids + fresh(int(rng.integers(0, 20)))
    elif u < 0.5:  # at a checkpoint boundary, or one or two tokens past it
        cut = g["chunk_stride"] * int(rng.integers(1, 4)) + int(rng.choice([-1, 0, 1, 2]))
        p = (systems[rng.integers(len(systems))] + fresh(200))[:cut]
    elif u < 0.85:  # a shared system prompt and a suffix
        p = systems[rng.integers(len(systems))] + fresh(int(rng.integers(0, 50)))
    else:
        p = fresh(int(rng.integers(1, 100)))
    return p[:g["max_model_len"] - 1]


def run_round(rng, g: dict, requests: int, unsafe_reuse: str | None = None) -> tuple[list, dict]:
    """One workload on a cache-on engine of geometry `g`: (finished outputs with their params, its counters)."""
    engine = LLMEngine(MODEL, enable_prefix_caching=True, verbose=False, unsafe_reuse=unsafe_reuse, **g)
    vocab = engine.cfg.vocab_size
    systems = [rng.integers(4, vocab, g["chunk_stride"] * int(rng.integers(1, 3)) + int(rng.choice([0, 5]))).tolist()
               for _ in range(2)]
    arrivals = np.cumsum(rng.integers(0, 4, requests))
    aborts = {i: a + int(rng.integers(0, 10)) for i, a in enumerate(arrivals) if rng.random() < 0.12}
    earlier, finished, params, seen, texts = [], [], {}, [], []
    step, added = 0, 0
    while added < requests or engine.has_unfinished_requests():
        while added < requests and arrivals[added] <= step:
            p, sp = prompt(rng, g, vocab, systems, earlier, [o for o, _ in finished]), sampling(rng, seen, texts)
            engine.add_request(f"r{added}", p, sp)
            earlier.append(p)
            params[f"r{added}"] = sp
            added += 1
        for i, at in list(aborts.items()):
            if at == step:
                engine.abort_request(f"r{i}")
                params.pop(f"r{i}", None)
        for out in engine.step():
            if out.finished and out.request_id in params:
                finished.append((out, params.pop(out.request_id)))
                seen += out.outputs[0].token_ids[:4]
                texts += [c.text[:2] for c in out.outputs if c.text.strip()][:1]
        engine.scheduler.check_invariants()
        step += 1
        if step > 20_000:
            raise RuntimeError("the workload did not finish in 20000 steps")
    stats = engine.cache_stats()
    if stats["num_running"] or stats["num_waiting"] or stats["live_slots"]:
        raise RuntimeError(f"an idle engine still holds sequences or live slots: {stats}")
    engine.reset_prefix_cache()
    after = engine.cache_stats()
    if after["kv_blocks_free"] != g["num_kv_blocks"] - 1 or after["checkpoint_slots"]:
        raise RuntimeError(f"a reset left blocks or checkpoints held: {after}")
    return finished, stats


def alone(refs: dict, g: dict, prompt_ids: list[int], params: SamplingParams, budget: int | None = None):
    """The request run alone on a cache-off engine of the same block size, chunk_stride and max_model_len (and with
    `budget`, of that max_num_batched_tokens)."""
    key = (g["block_size"], g["chunk_stride"], g["max_model_len"], budget)
    if key not in refs:
        refs[key] = LLMEngine(MODEL, enable_prefix_caching=False, verbose=False, max_num_seqs=1, **{
            k: g[k] for k in ("block_size", "chunk_stride", "max_model_len")},
            **({} if budget is None else {"max_num_batched_tokens": budget}))
    engine, out = refs[key], None
    engine.add_request("alone", prompt_ids, copy.deepcopy(params))
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.finished), out)
    return out


def differences(got, want, tolerance: float) -> list[str]:
    """What differs between a request's output `got` and its output alone without the cache `want` (empty: none)."""
    found = []
    for a, b in zip(got.outputs, want.outputs, strict=True):
        for field in ("token_ids", "finish_reason", "stop_reason", "text"):
            if getattr(a, field) != getattr(b, field):
                found.append(f"sample {a.index} {field}: {getattr(a, field)!r} != {getattr(b, field)!r}")
        if a.logprobs is not None and a.token_ids == b.token_ids:
            gap = max((abs(x[t].logprob - y[t].logprob) for t, x, y in zip(a.token_ids, a.logprobs, b.logprobs)),
                      default=0.0)
            if gap > tolerance:
                found.append(f"sample {a.index} logprobs {gap:.2e} apart")
    if got.prompt_logprobs is not None:
        for pos, (x, y) in enumerate(zip(got.prompt_logprobs, want.prompt_logprobs)):
            if x is not None and (y is None or max(abs(x[t].logprob - y[t].logprob) if t in y else np.inf
                                                    for t in x) > tolerance):
                found.append(f"prompt logprob at {pos} differs")
                break
    return found


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="soak_cache.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=positive_number, default=10.0,
                    help="start no round after this many minutes (default: %(default)s)")
    ap.add_argument("--rounds", type=positive_int, default=None, help="stop after this many rounds (default: no limit)")
    ap.add_argument("--seed", type=nonnegative_int, default=0, help="the first round's seed; round i uses seed + i")
    ap.add_argument("--requests", type=positive_int, default=12, help="requests per round (default: %(default)s)")
    ap.add_argument("--tolerance", type=nonnegative_number, default=1e-5,
                    help="float32 logprob tolerance (default: %(default)s)")
    ap.add_argument("--unsafe-reuse", choices=("cold", "stale"), default=None,
                    help="run the cache-on engines with the accuracy ablation's unsafe reuse instead of the exact "
                         "cache, to see the soak catch a cache that is not exact")
    ap.add_argument("--out", type=output_file, default="results/soak_cache.json",
                    help="JSON output (default: %(default)s)")
    args = ap.parse_args(argv)
    # the small pools are on purpose: the engine's warnings about them (few checkpoint slots) would fill the output
    warnings.simplefilter("ignore", UserWarning)
    refs, totals, mismatches = {}, dict.fromkeys(("rounds", "requests", "split_order_flips", *COUNTERS), 0), []
    start = time.perf_counter()
    while time.perf_counter() - start < 60 * args.minutes and totals["rounds"] < (args.rounds or sys.maxsize):
        seed = args.seed + totals["rounds"]
        rng = np.random.default_rng(seed)
        g = geometry(rng)
        try:
            finished, stats = run_round(rng, g, args.requests, args.unsafe_reuse)
            for out, params in finished:
                found = differences(out, alone(refs, g, out.prompt_token_ids, params), args.tolerance)
                if found and not differences(out, alone(refs, g, out.prompt_token_ids, params,
                                                        g["max_num_batched_tokens"]), args.tolerance):
                    # the cache-off engine whose token budget splits prompts as the round's engine did gives the
                    # same output: sums in another order (float32 rounding) moved a sampled token across a top-k /
                    # top-p boundary; no cache error, counted apart
                    totals["split_order_flips"] += 1
                    continue
                if found:
                    mismatches.append({"seed": seed, "geometry": g, "request_id": out.request_id,
                                       "prompt_token_ids": out.prompt_token_ids, "params": repr(params),
                                       "num_cached_tokens": out.num_cached_tokens, "differences": found})
        except Exception as e:  # a failed check or a crash: recorded with its seed, the soak goes on
            mismatches.append({"seed": seed, "geometry": g, "error": "".join(traceback.format_exception(e))[-2000:]})
            finished, stats = [], {}
        totals["rounds"] += 1
        totals["requests"] += len(finished)
        for k in COUNTERS:
            totals[k] += stats.get(k, 0)
        print(f"round {totals['rounds']:4d} seed {seed}: {len(finished):3d} requests, hits {stats.get('hits', 0):3d}, "
              f"restores {stats.get('checkpoints_restored', 0):3d}, preemptions {stats.get('preemptions', 0):3d} | "
              f"{json.dumps(g)}", flush=True)
    result = {"model": MODEL, "dtype": "float32", "seed": args.seed, "requests_per_round": args.requests,
              "unsafe_reuse": args.unsafe_reuse,
              "tolerance": args.tolerance, "seconds": time.perf_counter() - start, "totals": totals,
              "mismatches": mismatches}
    print(f"\n{totals['rounds']} rounds, {totals['requests']} requests compared with each alone without the cache: "
          + ", ".join(f"{k} {totals[k]}" for k in COUNTERS) + f"; {len(mismatches)} mismatches"
          + (f" ({totals['split_order_flips']} sampled differently only as a cache-off engine splitting prompts the "
             f"same way samples them too)" if totals["split_order_flips"] else ""))
    for m in mismatches:
        what = (f"{m['differences'][0][:160]}" + (f" (+{len(m['differences']) - 1} more)" if len(m["differences"]) > 1
                                                   else "")) if "differences" in m else m["error"].splitlines()[-1]
        print(f"  seed {m['seed']}, {m.get('request_id', 'the round')}: {what}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    sys.exit(1 if main()["mismatches"] else 0)
