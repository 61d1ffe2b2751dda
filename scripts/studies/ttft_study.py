"""TTFT study: time to first token with the prefix cache on and off, on the workloads a prefix cache is for.

    .venv/bin/python scripts/studies/ttft_study.py [--model tiny] [--dtype float32] [--out results] [--quick]
    .venv/bin/python scripts/studies/ttft_study.py --ab [--model hybrid-1024] [--prompt 2048] [--shared 1792]
                                                   [--chunk-stride 256]
    .venv/bin/python scripts/studies/ttft_study.py --prefill [--model hybrid-1024] [--prompt 2048] [--shared 1792]
                                                   [--chunk-stride 256]

Study (the default). Seeded workloads: a shared system prompt with distinct questions, multi-turn conversations
(each turn extends the previous prompt and its answer), identical repeats, and a no-sharing control. Each runs with
the cache on and off, serially (one request at a time) and concurrently (a wave submitted together through
`LLMEngine`), after a warm-up pass of the same shapes on other tokens (the prefix cache is emptied after it). TTFT is
client-side: from `add_request` to the step that returns the first token. Reports p50 / p90 / mean TTFT, hit rate,
reused tokens and the counters; plots TTFT against the shared-prefix length, cache on vs off. Writes
DIR/ttft_study.json and DIR/ttft_study.png. The engines' max_model_len is 2048 (--quick: 512), or the model's
positions where it has fewer and the study's sequences (up to 1088 tokens; --quick: 284) fit them.

A/B (`--ab`). Request A (a `--prompt`-token prompt) runs first; request B shares A's first `--shared` tokens and has
its own tail. With the cache on, B restores the checkpoint at `--shared` and prefills only its tail; with it off, B
prefills everything. Also compares the engine step in which B's prefill starts after a warm restore with the
cache-off step of B that starts at the same position (same rows, tokens, blocks) without one. Writes
DIR/ttft_study_ab.json.

Prefill (`--prefill`). One jitted forward of `--prompt` tokens, then per checkpoint mode and policy ("scan" with
"all" and "last", "promote") a cold request of that length and a hit that shares `--shared` tokens with it, with a
token budget of `--prompt`: cold TTFT and its ratio to the forward, prefill steps of the cold prompt, hit TTFT and
reused tokens, checkpoints and bytes written. Writes DIR/ttft_study_prefill.json.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import jax
import numpy as np

from gdn_jax import LLMEngine, SamplingParams
from gdn_jax.entrypoints.cli import nonnegative_int, positive_int

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared helpers in common.py
from common import (check_length, environment, figure, fit_model_len, one_row_batch, parse, pools_of,  # noqa: E402
                    run_command, save, share_of, study_parser, write_json)


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


def step_at(steps: list[dict], start: int) -> dict:
    """The step of a one-row prefill that begins at prompt position `start` (steps as `run_request` records them)."""
    pos = 0
    for step in steps:
        if pos == start:
            return step
        pos += step["tokens"]
    raise ValueError(f"no prefill step begins at position {start}")


def ab(args) -> dict:
    kw = dict(dtype=args.dtype, chunk_stride=args.chunk_stride, block_size=16, max_num_seqs=4,
              max_model_len=args.prompt + 64, num_linear_slots=16, max_num_batched_tokens=args.chunk_stride)
    engines = {"cache on": LLMEngine(args.model, enable_prefix_caching=True, **kw, **share_of(2)),
               "cache off": LLMEngine(args.model, enable_prefix_caching=False, **kw, **share_of(2))}
    vocab = engines["cache on"].cfg.vocab_size
    rng = np.random.default_rng(args.seed)
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
    # With the cache, B's first prefill step starts at its deepest checkpoint with a warm restore; without the
    # cache, the step of B that starts at the same position computes the same tokens (same shape: 1 row, the same
    # token count and block count) from the state the previous step left in the live slot, with no restore.
    if not all(r["steps"][0]["warm_restores"] == 1 for r in on):
        raise ValueError(f"request B's first step restored no checkpoint: --shared ({args.shared}) must reach a "
                         f"checkpoint boundary (--chunk-stride {args.chunk_stride})")
    pairs = [(a["steps"][0], step_at(b["steps"], a["num_cached_tokens"])) for a, b in zip(on, off)]
    assert all(x["tokens"] == y["tokens"] and y["warm_restores"] == 0 for x, y in pairs)
    restore_step = statistics.median(x["seconds"] for x, _ in pairs)
    plain_step = statistics.median(y["seconds"] for _, y in pairs)
    ratio = ttft_on / ttft_off

    print(f"\n{args.model} ({args.dtype}), backend {jax.default_backend()}: prompt {args.prompt}, "
          f"shared {args.shared}, chunk_stride {args.chunk_stride}; median of {args.rounds} rounds after warm-up")
    print(f"{'':<28}{'cache on':>12}{'cache off':>12}")
    print(f"{'TTFT of B (ms)':<28}{1e3 * ttft_on:>12.1f}{1e3 * ttft_off:>12.1f}")
    print(f"{'cached tokens of B':<28}{on[0]['num_cached_tokens']:>12}{off[0]['num_cached_tokens']:>12}")
    print(f"{'prefill steps of B':<28}{len(on[0]['steps']):>12}{len(off[0]['steps']):>12}")
    print(f"TTFT ratio on/off: {ratio:.3f} (target <= 0.25)")
    print(f"step of {pairs[0][0]['tokens']} tokens at position {on[0]['num_cached_tokens']}: with restore "
          f"{1e3 * restore_step:.1f} ms vs without {1e3 * plain_step:.1f} ms: "
          f"{100 * (restore_step / plain_step - 1):+.1f}% (target within 5%)")
    out = {"args": vars(args), "backend": jax.default_backend(), "ttft_on_s": ttft_on, "ttft_off_s": ttft_off,
           "ttft_ratio": ratio, "restore_step_s": restore_step, "plain_step_s": plain_step,
           "restore_step_overhead": restore_step / plain_step - 1, "rounds": results,
           "memory": {n: e.memory.describe() for n, e in engines.items()}, "environment": environment()}
    print(f"wrote {write_json(args.out, 'ttft_study_ab.json', out)}")
    return out


def prefill(args) -> dict:
    """Cold and hit TTFT of one long prompt against one jitted forward of the same tokens, per checkpoint mode and
    policy, in one run: "scan" (all, last) prefills as many strides per step as the budget allows and writes the
    checkpoints from the scan; "promote" takes one stride per step. Same weights for every engine."""
    from gdn_jax.model.qwen35 import forward
    from gdn_jax.model.state import init_state

    variants = {"scan / all": dict(checkpoint_mode="scan"), "scan / last": dict(checkpoint_mode="scan",
                                                                                checkpoint_policy="last"),
                "promote": dict(checkpoint_mode="promote")}
    kw = dict(dtype=args.dtype, chunk_stride=args.chunk_stride, block_size=16, max_num_seqs=2,
              max_model_len=args.prompt + 64, max_num_batched_tokens=args.prompt, verbose=False)
    engines = {name: LLMEngine(args.model, **kw, **v, **share_of(len(variants))) for name, v in variants.items()}
    worker = next(iter(engines.values())).worker
    # one jitted forward of the same tokens: the engine's model, one row, fresh pools, last-position logits
    fwd = jax.jit(partial(forward, forms=worker.forms), static_argnums=(0, 4), donate_argnums=(3,))
    batch, nb = one_row_batch([5] * args.prompt, 16)
    state = init_state(worker.cfg, nb + 1, 16, 2, worker.dtype)
    fwd_times = []
    for _ in range(args.rounds + 1):
        t0 = time.perf_counter()
        logits, state = fwd(worker.graphdef, worker.params, batch, state, False)
        logits.block_until_ready()
        fwd_times.append(time.perf_counter() - t0)
    forward_s = statistics.median(fwd_times[1:])
    vocab = worker.cfg.vocab_size
    rng = np.random.default_rng(args.seed)
    rows, rounds = {}, {name: [] for name in engines}
    for rnd in range(args.rounds + 1):  # round 0 compiles every shape the later rounds use
        a = rng.integers(4, vocab, args.prompt).tolist()
        b = a[:args.shared] + rng.integers(4, vocab, args.prompt - args.shared).tolist()
        for name, engine in engines.items():
            saved0 = engine.scheduler.stats()["checkpoints_saved"]
            cold, hit = run_request(engine, f"a{rnd}", a), run_request(engine, f"b{rnd}", b)
            saves = engine.scheduler.stats()["checkpoints_saved"] - saved0
            if rnd:
                rounds[name].append({"cold": cold, "hit": hit, "checkpoints_saved": saves})
    print(f"\n{args.model} ({args.dtype}), backend {jax.default_backend()}: cold prompt {args.prompt} tokens, hit "
          f"shares {args.shared}, chunk_stride {args.chunk_stride}, budget {args.prompt}; median of {args.rounds} "
          f"rounds after a warm-up round; one jitted forward of {args.prompt} tokens: {1e3 * forward_s:.1f} ms")
    print(f"{'variant':<13}{'cold TTFT ms':>13}{'x forward':>10}{'steps':>7}{'hit TTFT ms':>12}{'reused':>8}"
          f"{'ckpts':>7}{'ckpt MiB':>10}")
    for name, rs in rounds.items():
        slot_mib = engines[name].memory.bytes_per_linear_slot / 2**20
        cold = statistics.median(r["cold"]["ttft_s"] for r in rs)
        hit = statistics.median(r["hit"]["ttft_s"] for r in rs)
        saves = rs[0]["checkpoints_saved"]
        rows[name] = {"cold_ttft_s": cold, "cold_over_forward": cold / forward_s,
                      "cold_steps": len(rs[0]["cold"]["steps"]), "hit_ttft_s": hit,
                      "hit_cached_tokens": rs[0]["hit"]["num_cached_tokens"], "checkpoints_saved": saves,
                      "checkpoint_bytes_written": saves * engines[name].memory.bytes_per_linear_slot}
        r = rows[name]
        print(f"{name:<13}{1e3 * cold:>13.1f}{r['cold_over_forward']:>10.2f}{r['cold_steps']:>7}{1e3 * hit:>12.1f}"
              f"{r['hit_cached_tokens']:>8}{saves:>7}{saves * slot_mib:>10.1f}")
    out = {"args": vars(args), "backend": jax.default_backend(), "forward_s": forward_s, "forward_times_s": fwd_times,
           "variants": rows, "rounds": rounds, "environment": environment()}
    path = write_json(args.out, "ttft_study_prefill.json", out)
    print(f"wrote {path}")
    return out


# ---- the study ------------------------------------------------------------------------------------------------
def _words(rng, tok, n: int) -> list[int]:
    """n tokens of random lowercase words (readable; no sharing beyond what a workload adds on purpose). Words are
    drawn until their text is n tokens long: a byte-level tokenizer needs about n // 4 of them, one whose tokens are
    longer more."""
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words, ids = [], []
    while len(ids) < n:
        words += ["".join(rng.choice(letters, int(rng.integers(2, 9)))) for _ in range(n // 4 + 2)]
        ids = tok.encode(" ".join(words))
    return ids[:n]


# the workloads' sizes (--quick: True): requests per wave, system prompt and question tokens, conversations and turns
WORKLOAD = {True: dict(requests=4, system=256, question=24, conversations=3, turns=3),
            False: dict(requests=8, system=1024, question=48, conversations=4, turns=4)}
SWEEP_QUESTION = 24  # tokens after the shared prefix in the prefix-length sweep


def workloads(rng, tok, q: bool):
    """name -> list of waves; a wave is a list of prompts submitted together in concurrent mode. Multi-turn waves
    are callables that build the next turn from the previous answers."""
    n_req, sys_len, q_len = (WORKLOAD[q][k] for k in ("requests", "system", "question"))
    system = _words(rng, tok, sys_len)
    out = {"shared system prompt": [[system + _words(rng, tok, q_len) for _ in range(n_req)]],
           "repeats": [[system[:sys_len // 2] + _words(rng, tok, q_len)] * n_req],
           "no sharing": [[_words(rng, tok, sys_len // 2 + q_len) for _ in range(n_req)]]}
    convs, turns = WORKLOAD[q]["conversations"], WORKLOAD[q]["turns"]
    firsts = [system[:sys_len // 4] + _words(rng, tok, q_len) for _ in range(convs)]
    users = [[_words(rng, tok, q_len) for _ in range(turns - 1)] for _ in range(convs)]
    out["multi-turn"] = [firsts] + [lambda prev, t=t: [p + a + users[c][t] for c, (p, a) in enumerate(prev)]
                                     for t in range(turns - 1)]
    return out


def run_waves(engine: LLMEngine, waves, concurrent: bool, max_tokens: int) -> list[dict]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    records, prev, n = [], None, 0
    for wave in waves:
        prompts = wave(prev) if callable(wave) else wave
        done = {}
        groups = [list(enumerate(prompts))] if concurrent else [[(i, p)] for i, p in enumerate(prompts)]
        for group in groups:
            for i, p in group:
                engine.add_request(f"r{n}-{i}", p, params)
            while engine.has_unfinished_requests():
                done.update({o.request_id: o for o in engine.step() if o.finished})
        outs = [done[f"r{n}-{i}"] for i in range(len(prompts))]
        n += 1
        prev = [(p, o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
        records += [{"ttft_s": o.metrics.ttft, "prompt": len(o.prompt_token_ids), "cached": o.num_cached_tokens}
                    for o in outs]
    return records


def summarize(records, delta) -> dict:
    t = np.array([r["ttft_s"] for r in records])
    return {"requests": len(records), "ttft_p50_ms": 1e3 * float(np.percentile(t, 50)),
            "ttft_p90_ms": 1e3 * float(np.percentile(t, 90)), "ttft_mean_ms": 1e3 * float(t.mean()),
            "hit_rate": delta["hits"] / max(delta["queries"], 1), "reused_tokens": delta["reused_tokens"],
            "prompt_tokens": sum(r["prompt"] for r in records), "counters": delta}


COUNTERS = ("queries", "hits", "query_tokens", "reused_tokens", "checkpoints_saved", "checkpoints_restored",
            "rotation_copies", "checkpoints_evicted", "preemptions", "compilations")


def measured(engine: LLMEngine, make, concurrent: bool, max_tokens: int, passes: int = 1):
    """A warm-up pass of the same shapes on other tokens, then `passes` measured passes, each on its own tokens from
    an emptied prefix cache: percentiles over the requests of all passes, and each pass's p50 (its spread; a
    concurrent pass is one batch, so one pass is one sample of the machine's state). The counters are summed over the
    measured passes, each from just after its cache reset (whose evictions are not the workload's)."""
    run_waves(engine, make(1), concurrent, max_tokens)
    delta, recs, p50s = dict.fromkeys(COUNTERS, 0), [], []
    for p in range(passes):
        engine.reset_prefix_cache()
        before = engine.cache_stats()
        got = run_waves(engine, make(0 if p == 0 else p + 1), concurrent, max_tokens)
        after = engine.cache_stats()
        delta = {k: delta[k] + after[k] - before[k] for k in COUNTERS}
        p50s.append(1e3 * float(np.percentile([r["ttft_s"] for r in got], 50)))
        recs += got
    return {**summarize(recs, delta), "ttft_p50_ms_per_pass": p50s}


# Engine and sweep sizes. Compiling the step shapes, not running them, is where a quick study's time goes: the
# cache-off engine gets the cache-on engine's pools (same shapes, so it runs the steps the other compiled), and
# --quick uses blocks of up to 64 tokens with max_model_len 512, one block-table bucket. Reuse is a checkpoint
# boundary (a multiple of chunk_stride) either way, so the block size does not change what is reused.
FULL = dict(block_size=16, max_model_len=2048, max_tokens=16, prefix_lengths=[128, 256, 512, 1024])
QUICK = dict(max_model_len=512, max_tokens=4, prefix_lengths=[64, 256])


def study_length(q: bool) -> int:
    """The longest sequence, prompt and answer, of the study's workloads and sweep: the system prompt with a question,
    the last turn of a conversation (every earlier answer and question in it), the longest swept prefix."""
    w, sizes = WORKLOAD[q], QUICK if q else FULL
    conversation = w["system"] // 4 + w["question"] + (w["turns"] - 1) * (sizes["max_tokens"] + w["question"])
    prompt = max(w["system"] + w["question"], conversation, max(sizes["prefix_lengths"]) + SWEEP_QUESTION)
    return prompt + sizes["max_tokens"]


def study(args) -> dict:
    from tqdm.auto import tqdm
    q = args.quick
    sizes = {**QUICK, "block_size": math.gcd(64, args.chunk_stride)} if q else dict(FULL)
    sizes["max_model_len"] = args.max_model_len  # the model's positions where it has fewer (main)
    kw = dict(dtype=args.dtype, chunk_stride=args.chunk_stride, block_size=sizes["block_size"], max_num_seqs=8,
              max_model_len=sizes["max_model_len"], verbose=False)
    on = LLMEngine(args.model, enable_prefix_caching=True, **kw, **share_of(2))
    engines = {"on": on, "off": LLMEngine(args.model, enable_prefix_caching=False, **kw, **pools_of(on))}
    tok = on.tokenizer
    names = list(workloads(np.random.default_rng(args.seed), tok, q))
    max_tokens, lengths = sizes["max_tokens"], sizes["prefix_lengths"]
    bar = tqdm(total=len(names) * 4 + len(lengths) * 2, desc="TTFT study", unit="run")
    rows = []
    for name in names:
        for mode in ("serial", "concurrent"):
            for cache, engine in engines.items():
                s = measured(engine, lambda r: workloads(np.random.default_rng(1000 * args.seed + r + 1), tok, q)[name],
                             mode == "concurrent", max_tokens, args.passes)
                rows.append({"workload": name, "mode": mode, "cache": cache, **s})
                bar.update(1)
    sweep = []  # serial TTFT against the shared-prefix length
    for n in lengths:
        def make(seed, n=n):
            rng = np.random.default_rng(1000 * args.seed + 100 + seed)
            system = _words(rng, tok, n)
            return [[system + _words(rng, tok, SWEEP_QUESTION) for _ in range(3)]]
        for cache, engine in engines.items():
            s = measured(engine, make, False, max_tokens, args.passes)
            sweep.append({"shared_prefix": n, "cache": cache, **s})
            bar.update(1)
    bar.close()

    print(f"\n{args.model} ({args.dtype}), chunk_stride {args.chunk_stride}; TTFT after warm-up, ms, over "
          f"{args.passes} pass(es); spread: lowest and highest p50 of a pass")
    print(f"{'workload':<22}{'mode':<12}{'cache':<7}{'p50':>8}{'spread':>14}{'p90':>8}{'mean':>8}{'hit rate':>10}"
          f"{'reused':>8}{'of':>7}")
    for r in rows:
        spread = f"{min(r['ttft_p50_ms_per_pass']):.1f}-{max(r['ttft_p50_ms_per_pass']):.1f}"
        print(f"{r['workload']:<22}{r['mode']:<12}{r['cache']:<7}{r['ttft_p50_ms']:>8.1f}{spread:>14}"
              f"{r['ttft_p90_ms']:>8.1f}{r['ttft_mean_ms']:>8.1f}{r['hit_rate']:>10.2f}{r['reused_tokens']:>8}"
              f"{r['prompt_tokens']:>7}")
    print(f"\n{'shared prefix':<15}" + "".join(f"{'p50 ' + c:>12}" for c in engines))
    for n in lengths:
        print(f"{n:<15}" + "".join(f"{r['ttft_p50_ms']:>12.1f}" for r in sweep if r["shared_prefix"] == n))
    result = {"model": args.model, "dtype": args.dtype, "backend": jax.default_backend(),
              "config": {"chunk_stride": args.chunk_stride, "quick": q, "seed": args.seed, "passes": args.passes,
                         **sizes,
                         "engine": {k: v for k, v in kw.items() if k not in ("dtype", "verbose")},
                         "memory": on.memory.describe()}, "rows": rows,
              "prefix_sweep": sweep, "environment": environment()}
    path = write_json(args.out, "ttft_study.json", result)
    fig, ax = figure((6, 4))
    for cache in engines:
        pts = [(r["shared_prefix"], r["ttft_p50_ms"]) for r in sweep if r["cache"] == cache]
        ax.plot(*zip(*pts), marker="o", label=f"cache {cache}")
    ax.set_xlabel("shared prefix (tokens)")
    ax.set_ylabel("TTFT p50 (ms), serial")
    ax.set_title(f"TTFT vs shared prefix ({args.model}, {args.dtype})")
    ax.legend()
    save(fig, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return result


def main(argv=None) -> dict:
    ap = study_parser("ttft_study.py", __doc__,
                      "ttft_study.json and .png (ttft_study_ab.json with --ab, ttft_study_prefill.json with --prefill)",
                      "smaller workloads, blocks of up to 64 tokens", model_default=None, model_aliases=("--preset",),
                      model_help="preset or HF folder (default: tiny for the study, hybrid-1024 for --ab / --prefill)")
    ap.add_argument("--ab", action="store_true", help="the A/B restore comparison instead of the study")
    ap.add_argument("--prefill", action="store_true",
                    help="cold and hit TTFT per checkpoint mode and policy against one jitted forward")
    ap.add_argument("--prompt", type=positive_int, default=None,
                    help="--ab / --prefill: tokens of each prompt (default: 2048)")
    ap.add_argument("--shared", type=positive_int, default=None,
                    help="--ab / --prefill: tokens request B shares with request A (default: 1792)")
    ap.add_argument("--chunk-stride", type=positive_int, default=None,
                    help="tokens between checkpoints (default: 64 for the study, 256 for --ab / --prefill)")
    ap.add_argument("--rounds", type=positive_int, default=None,
                    help="--ab / --prefill: timed rounds after the warm-up round (default: 3)")
    ap.add_argument("--seed", type=nonnegative_int, default=0, help="workload seed")
    ap.add_argument("--passes", type=positive_int, default=None,
                    help="the study: measured passes per cell, each on fresh tokens (default: 1 with --quick, else 3)")
    args = parse(ap, argv, files=("ttft_study.json", "ttft_study.png", "ttft_study_ab.json", "ttft_study_prefill.json"))
    long = args.ab or args.prefill
    if args.ab and args.prefill:
        ap.error("--ab and --prefill are two different runs: pass one")
    if long and args.quick:
        ap.error("--quick shrinks the study only; --ab / --prefill take --prompt, --shared and --rounds")
    # a flag of the other kind of run would be ignored: the run would not be the one asked for
    other = ["--passes"] if long else ["--prompt", "--shared", "--rounds"]
    given = [flag for flag in other if getattr(args, flag[2:]) is not None]
    if given:
        ap.error(f"{', '.join(given)}: for {'the study' if long else '--ab / --prefill'} only")
    args.prompt, args.shared, args.rounds = args.prompt or 2048, args.shared or 1792, args.rounds or 3
    if long and args.shared >= args.prompt:
        ap.error(f"--shared ({args.shared}) must be below --prompt ({args.prompt}): request B adds tokens of its own")
    args.model = args.model or ("hybrid-1024" if long else "tiny")
    args.chunk_stride = args.chunk_stride or (256 if long else 64)
    if args.ab and args.shared < args.chunk_stride:  # B would restore nothing: found at once, not after the rounds
        ap.error(f"--shared ({args.shared}) is below --chunk-stride ({args.chunk_stride}): request B must share a "
                 f"checkpoint boundary with A for the A/B to compare a restoring step")
    # the engines' own errors would name settings this script takes no flag for (block_size 16, and a prefill
    # budget of --prompt tokens)
    if not args.quick and args.chunk_stride % 16:  # (--quick takes blocks that divide it)
        ap.error(f"--chunk-stride ({args.chunk_stride}) must be a multiple of 16, the KV block size of "
                 f"{'--ab / --prefill' if long else 'the study without --quick'}")
    if args.prefill and args.prompt < args.chunk_stride:
        ap.error(f"--prompt ({args.prompt}) must be at least --chunk-stride ({args.chunk_stride}): --prefill "
                 f"computes each prompt in one step of --prompt tokens, and a step holds a whole stride")
    if long:  # passes are the study's: the A/B and prefill runs time rounds, and their JSON records their settings
        del args.passes
        check_length(ap, args.model, args.prompt + 64, f"--prompt {args.prompt} (and 64 tokens of room)")
    else:  # the study's sizes are fixed: a model of fewer positions gets a max_model_len of its own if they fit
        args.passes = args.passes or (1 if args.quick else 3)
        check_length(ap, args.model, study_length(args.quick),
                     "--quick" if args.quick else "the study without --quick (--quick: shorter sequences)")
        args.max_model_len = fit_model_len(args.model, (QUICK if args.quick else FULL)["max_model_len"])
    return ab(args) if args.ab else prefill(args) if args.prefill else study(args)


if __name__ == "__main__":
    run_command(main)
