"""Speculative decoding with the model's MTP block: decode tokens/s, inter-token latency and acceptance per k.

    .venv/bin/python scripts/bench/bench_spec.py [--models tiny,hybrid-1024] [--ks 0,1,2,3] [--batches 1,16]
                                                 [--max-tokens 128] [--runs 3] [--dtype float32]
                                                 [--max-model-len 1024] [--prompt-len 64] [--seed 0]
                                                 [--out results/bench_spec.json]

Workload (offline `LLMEngine`, in-process): for each model of `--models` and each k of `--ks` one engine
(`speculative_config={"method": "mtp", "num_speculative_tokens": k}`; k = 0: none; max_num_seqs the largest of
`--batches`), reused for every batch size. Per batch size: one unmeasured warm-up pass (it compiles every step
shape the workload uses), then `--runs` measured passes. A pass empties the prefix cache
(`engine.reset_prefix_cache()`), adds `batch` greedy requests (temperature 0, ignore_eos, `--max-tokens` tokens
each) at once and steps the engine until they are done, stamping each step's new tokens with the time the step
returned (with speculation one step can give a request several tokens). Prompts: for the trained model `tiny` the
documentation prompts of `python -m gdn_jax` (`SYSTEM + question`, the four questions in turn), for any other model
(random weights: `tiny-random`, `hybrid-1024`, ...) `--prompt-len` random token ids in [4, vocab) per request
(`--seed`). The same prompts for every k, so that greedy outputs can be compared.

Per (model, k, batch), the median over the measured passes of:
- `decode_tok_s`: tokens generated after the last request's first token, over the time from that first token to the
  pass's last token: the batch's decode rate once every request decodes (the prefills, and the decode steps that
  ran beside them in mixed steps, are left out; rows that started first also finish first, so the tail holds fewer
  rows);
- `output_tok_s`: every generated token over the pass's wall time (adding the requests to the last token: prefill
  included);
- `itl_p50_ms`, `itl_p90_ms`: the gaps between a request's consecutive steps that gave it tokens, per emitted token
  (a step that gave n tokens after a gap g counts n gaps of g / n), over every request of the pass;
- `acceptance`: accepted drafts / drafts verified in the pass (the `spec_accepted_tokens` and `spec_draft_tokens`
  deltas of `engine.cache_stats()`); None for k = 0;
- `tokens_per_step`: the mean tokens a request got from a step after its first token (1 without speculation; with it
  1 + the drafts accepted, less where a request reached --max-tokens);
- `compilations`: compilations during the measured passes, summed (`cache_stats()["compilations"]`; should be 0);
- `x_k0`: decode_tok_s over k = 0's at the same model and batch (None when k = 0 was not run); with `--interleave`
  (every k's engine built at once, their passes taken in turns) the median of each round's ratio;
- `same_tokens_as_k0`: whether every pass (warm-up included) generated, request for request, the token ids of k =
  0's first measured pass (greedy: speculation must not change them; a check, reported, not an error). For k = 0
  itself: whether its passes agree with its first. None when k = 0 was not run.

Prints a table and writes JSON (default results/bench_spec.json).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np

from gdn_jax.config import MAX_SPECULATIVE_TOKENS
from gdn_jax.entrypoints.cli import nonnegative_int, output_file, positive_int, positive_ints

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared helpers in common.py
from common import (environment, median, model_config, percentile_ms, run_command,  # noqa: E402
                    write_json)

TEXT_MODEL = "tiny"  # the trained built-in model: text prompts; any other model gets random token ids


def ks(text: str) -> list[int]:
    """An argparse type: comma-separated draft counts in [0, MAX_SPECULATIVE_TOKENS] (0: no speculation), e.g.
    "0,1,2"; returned sorted without repeats, k = 0 first (the reference of the others)."""
    try:
        values = sorted({int(item) for item in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 0,1,2") from None
    wrong = [k for k in values if not 0 <= k <= MAX_SPECULATIVE_TOKENS]
    if wrong:
        raise argparse.ArgumentTypeError(f"{wrong}: each k must be in [0, {MAX_SPECULATIVE_TOKENS}]")
    return values


def names(text: str) -> list[str]:
    """An argparse type: comma-separated model names, e.g. "tiny,hybrid-1024"."""
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(f"{text!r}: an empty model name")
    return items


def prompts(model: str, vocab: int, count: int, args) -> list:
    """`count` prompts for `model`: the documentation prompts in turn for the trained tiny model, else random ids."""
    if model == TEXT_MODEL:
        from gdn_jax.__main__ import QUESTIONS, SYSTEM
        return [SYSTEM + QUESTIONS[i % len(QUESTIONS)] for i in range(count)]
    rng = np.random.default_rng(args.seed)
    return [{"prompt_token_ids": rng.integers(4, vocab, args.prompt_len).tolist()} for _ in range(count)]


def one_pass(engine, batch_prompts: list, args) -> dict:
    """One pass: `batch` requests at once, stepped to their end; its measures (the module docstring) and the token ids
    each request generated."""
    from gdn_jax import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    engine.reset_prefix_cache()
    before = engine.cache_stats()
    start = time.perf_counter()
    for i, prompt in enumerate(batch_prompts):
        engine.add_request(str(i), prompt, sp)
    events: dict[str, list[tuple[float, int]]] = {str(i): [] for i in range(len(batch_prompts))}  # (time, tokens)
    tokens: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        steps += 1
        for o in outs:
            ids = o.outputs[0].token_ids
            n = len(ids) - len(tokens.get(o.request_id, ()))
            if n > 0:
                events[o.request_id].append((now, n))
            tokens[o.request_id] = list(ids)
    after = engine.cache_stats()
    short = {rid: len(ids) for rid, ids in tokens.items() if len(ids) != args.max_tokens}
    if short or len(tokens) != len(batch_prompts):
        raise ValueError(f"requests stopped before --max-tokens ({args.max_tokens}) tokens: {short or 'some gave none'}"
                         f"; raise --max-model-len ({args.max_model_len}) or lower --max-tokens")
    last_first = max(ev[0][0] for ev in events.values())
    end = max(ev[-1][0] for ev in events.values())
    decode_tokens = sum(n for ev in events.values() for t, n in ev if t > last_first)
    gaps, per_step = [], []
    for ev in events.values():
        for (t0, _), (t1, n) in zip(ev, ev[1:]):
            gaps += [(t1 - t0) / n] * n
            per_step.append(n)
    drafts = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    generated = sum(len(ids) for ids in tokens.values())
    return {"decode_tok_s": decode_tokens / (end - last_first) if end > last_first else None,
            "output_tok_s": generated / (end - start),
            "itl_p50_ms": percentile_ms(gaps, 50), "itl_p90_ms": percentile_ms(gaps, 90),
            "acceptance": accepted / drafts if drafts else None, "draft_tokens": drafts, "accepted_tokens": accepted,
            "tokens_per_step": float(np.mean(per_step)) if per_step else None, "decode_tokens": decode_tokens,
            "generated_tokens": generated, "steps": steps, "wall_s": end - start,
            "compilations": after["compilations"] - before["compilations"],
            "token_ids": [tokens[str(i)] for i in range(len(batch_prompts))]}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="bench_spec.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=names, default="tiny,hybrid-1024",
                    help="models (presets, shipped models or HF folders), comma-separated; only tiny gets text "
                         "prompts (default: %(default)s)")
    ap.add_argument("--ks", type=ks, default="0,1,2,3",
                    help=f"draft tokens per step, comma-separated, each in [0, {MAX_SPECULATIVE_TOKENS}]; 0: no "
                         "speculation, the reference of the others (default: %(default)s)")
    ap.add_argument("--batches", type=positive_ints, default="1,16",
                    help="requests per pass, comma-separated (default: %(default)s)")
    ap.add_argument("--max-tokens", type=positive_int, default=128,
                    help="tokens each request generates, at least 2 (default: %(default)s)")
    ap.add_argument("--runs", type=positive_int, default=3, help="measured passes per batch size (default: %(default)s)")
    ap.add_argument("--interleave", action="store_true",
                    help="build every k's engine of a model at once and run their passes in turns, one round after "
                         "another; x k=0 is then the median of each round's ratio to k=0's pass of the same round "
                         "(a machine whose speed drifts moves both sides of a ratio), at the memory of all of them")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="weights and activations (default: %(default)s)")
    ap.add_argument("--max-model-len", type=positive_int, default=1024,
                    help="engine max_model_len: prompt + --max-tokens must fit (default: %(default)s)")
    ap.add_argument("--prompt-len", type=positive_int, default=64,
                    help="tokens of each random prompt (every model but tiny) (default: %(default)s)")
    ap.add_argument("--seed", type=nonnegative_int, default=0, help="random prompts' seed (default: %(default)s)")
    ap.add_argument("--out", type=output_file, default="results/bench_spec.json",
                    help="JSON output (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.max_tokens < 2:
        ap.error("--max-tokens must be at least 2: decode starts after the first token")
    if any(m != TEXT_MODEL for m in args.models) and args.prompt_len + args.max_tokens > args.max_model_len:
        ap.error(f"--prompt-len ({args.prompt_len}) + --max-tokens ({args.max_tokens}) exceeds --max-model-len "
                 f"({args.max_model_len})")
    for m in args.models:
        cfg = model_config(m)
        if cfg is not None and args.max_model_len > cfg.max_position_embeddings:
            ap.error(f"--max-model-len {args.max_model_len} exceeds the {cfg.max_position_embeddings} positions of "
                     f"model {m}")

    from gdn_jax import LLMEngine

    def make_engine(model, k):
        spec = {"speculative_config": {"method": "mtp", "num_speculative_tokens": k}} if k else {}
        return LLMEngine(model, dtype=args.dtype, max_num_seqs=max(args.batches), max_model_len=args.max_model_len,
                         verbose=False, **spec)

    rows, reference = [], {}  # reference: (model, batch) -> k = 0's token ids
    paired = {}  # with --interleave: (model, k, batch) -> each round's pass
    for model in args.models:
        if args.interleave:  # every k's engine at once, their passes in turns: round i of each k, then round i + 1
            engines = {k: make_engine(model, k) for k in args.ks}
            all_prompts = prompts(model, engines[args.ks[0]].cfg.vocab_size, max(args.batches), args)
            for batch in args.batches:
                for k, engine in engines.items():
                    paired[model, k, batch] = [one_pass(engine, all_prompts[:batch], args)]  # the warm-up pass
                for _ in range(args.runs):
                    for k, engine in engines.items():
                        paired[model, k, batch].append(one_pass(engine, all_prompts[:batch], args))
            del engines
        for k in args.ks:
            engine = None  # the previous engine goes before the next one takes its share of an accelerator
            gc.collect()
            if not args.interleave:
                engine = make_engine(model, k)
                all_prompts = prompts(model, engine.cfg.vocab_size, max(args.batches), args)
            for batch in args.batches:
                if args.interleave:
                    warm, *runs = paired[model, k, batch]
                else:
                    warm = one_pass(engine, all_prompts[:batch], args)  # compiles the shapes of the workload
                    runs = [one_pass(engine, all_prompts[:batch], args) for _ in range(args.runs)]
                if k == 0:
                    reference[model, batch] = runs[0]["token_ids"]
                ref = reference.get((model, batch))
                same = None if ref is None else all(r["token_ids"] == ref for r in [warm, *runs])
                row = {"model": model, "k": k, "batch": batch,
                       **{key: median([r[key] for r in runs]) for key in (
                           "decode_tok_s", "output_tok_s", "itl_p50_ms", "itl_p90_ms", "acceptance",
                           "tokens_per_step")},
                       "compilations": sum(r["compilations"] for r in runs), "same_tokens_as_k0": same,
                       "warmup_compilations": warm["compilations"],
                       "runs": [{key: v for key, v in r.items() if key != "token_ids"} for r in runs]}
                rows.append(row)
                print(f"{model} k={k} batch={batch}: {row['decode_tok_s']:.1f} decode tok/s", flush=True)
            del engine
    base = {(r["model"], r["batch"]): r["decode_tok_s"] for r in rows if r["k"] == 0}
    for r in rows:
        b = base.get((r["model"], r["batch"]))
        r["x_k0"] = r["decode_tok_s"] / b if b and r["decode_tok_s"] is not None else None
        if args.interleave and b:  # the median of each round's ratio to k = 0's pass of the same round
            r["x_k0"] = median([None if None in (a["decode_tok_s"], z["decode_tok_s"]) else
                                a["decode_tok_s"] / z["decode_tok_s"] for a, z in
                                zip(paired[r["model"], r["k"], r["batch"]][1:], paired[r["model"], 0, r["batch"]][1:])])

    def cell(value, fmt: str, width: int) -> str:
        return f"{value:{width}{fmt}}" if value is not None else f"{'-':>{width}}"

    print(f"\n{args.dtype}, {args.max_tokens} tokens per request (greedy), median of {args.runs} runs"
          + (", interleaved (x k=0: median of the rounds' ratios)" if args.interleave else ""))
    print(f"{'model':>12} | {'k':>2} | {'batch':>5} | {'decode tok/s':>12} | {'x k=0':>5} | {'out tok/s':>9} | "
          f"{'ITL p50 ms':>10} | {'accept':>6} | {'tok/step':>8} | {'compiles':>8} | same as k=0")
    for r in rows:
        print(f"{r['model']:>12} | {r['k']:>2} | {r['batch']:>5} | {cell(r['decode_tok_s'], '.1f', 12)} | "
              f"{cell(r['x_k0'], '.2f', 5)} | {cell(r['output_tok_s'], '.1f', 9)} | "
              f"{cell(r['itl_p50_ms'], '.2f', 10)} | {cell(r['acceptance'], '.3f', 6)} | "
              f"{cell(r['tokens_per_step'], '.2f', 8)} | {r['compilations']:>8} | {r['same_tokens_as_k0']}")
    if any(r["compilations"] for r in rows):
        print("note: some measured passes compiled (the compiles column): their times include it")
    if any(r["same_tokens_as_k0"] is False for r in rows):
        print("note: some greedy outputs differ from k=0's (the same-as-k=0 column)")
    result, out = {"config": vars(args), "environment": environment(), "rows": rows}, Path(args.out)
    print(f"wrote {write_json(out.parent, out.name, result)}")


if __name__ == "__main__":
    run_command(main)
