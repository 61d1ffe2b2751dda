"""Checkpoint trade-off: how chunk_stride and checkpoint capacity decide what a multi-turn workload reuses.

    .venv/bin/python scripts/studies/checkpoint_tradeoff.py [--model tiny] [--dtype float32] [--out results] [--quick]

Concurrent conversations (a shared system prompt, then turns that each extend the previous prompt with its answer
and a new user message) compete for checkpoint slots. The sweep crosses `chunk_stride` with the checkpoint capacity
(checkpoint slots per live sequence, beyond each sequence's own live slot). Per configuration: the fraction of prompt
tokens reused, the tokens lost (KV match minus reuse: to the stride's alignment, and to checkpoints that were not
kept), the checkpoint memory, TTFT p50 after a warm-up round, evictions, and saves skipped. A finer stride loses fewer
tokens to alignment but needs more slots: a prefill step that crosses several boundaries saves them shallowest
first, and when the slots run out the deeper boundaries, the ones a later turn would restore, are skipped (an
eviction only takes a checkpoint no step is writing). The table and the heat map show where each effect wins.
The engines' max_model_len is 4096 (--quick: 512), or the model's positions where it has fewer; a workload whose last
turn does not fit is refused before it runs.
"""

from __future__ import annotations

import statistics
import sys
import warnings
from pathlib import Path

import numpy as np

from gdn_jax import LLMEngine, SamplingParams
from gdn_jax.entrypoints.cli import nonnegative_int, positive_int

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared helpers in common.py
from common import environment, figure, fit_model_len, parse, run_command, save, study_parser, write_json  # noqa: E402

# Workload and engine sizes. --quick keeps the sweep 2 x 2 and makes it cheap to compile: each step shape compiles once
# per pool size (per capacity), and compilation, not running, is where a quick sweep's time goes. 64-token blocks keep
# every step in one block-table bucket (for strides that are multiples of 64 the reuse is the same as with 16-token
# blocks: a reuse is a checkpoint boundary; only the KV match, and so `reuse_lost`, is counted in coarser blocks), and
# two conversations keep the row buckets to 1 and 2.
FULL = dict(conversations=4, turns=4, max_tokens=24, user_words=(8, 30), block_size=16, max_model_len=4096)
QUICK = dict(conversations=2, turns=3, max_tokens=8, user_words=(4, 12), block_size=64, max_model_len=512)
SYSTEM = ("You are a helpful assistant that answers questions about the Python standard library. Quote the "
          "documentation where you can, and keep every answer short. ")


def conversation_turns(rng, num_convs: int, turns: int, user_len: tuple[int, int]):
    """Per conversation, per turn, the user message text (random words from a fixed list, seeded)."""
    words = ("list dict set tuple string bytes iterator generator context manager exception module package import "
             "class method attribute descriptor decorator closure scope lambda comprehension slice index key value "
             "file path socket thread lock queue process signal").split()
    return [[" ".join(rng.choice(words, int(rng.integers(*user_len)))) + "?" for _ in range(turns)]
            for _ in range(num_convs)]


def user_tokens(tok, message: str) -> list[int]:
    """What a turn appends to the conversation before the answer."""
    return tok.encode(f"\nUser: {message}\nAssistant:")


def longest_prompt(tok, messages, max_tokens: int) -> int:
    """The longest last-turn prompt of the workload: the system prompt, every user line, and every answer but the
    last (greedy, ignore_eos: each is `max_tokens` long)."""
    return max(len(tok.encode(SYSTEM)) + sum(len(user_tokens(tok, m)) for m in conv) + (len(conv) - 1) * max_tokens
               for conv in messages)


def run_workload(engine: LLMEngine, messages, max_tokens: int):
    """Turn by turn, all conversations submitted together; returns one record per request."""
    tok = engine.tokenizer
    history = [tok.encode(SYSTEM) for _ in messages]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    records = []
    for t in range(len(messages[0])):
        prompts = {f"c{c}t{t}": history[c] + user_tokens(tok, messages[c][t]) for c in range(len(messages))}
        for rid, p in prompts.items():
            engine.add_request(rid, p, params)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        for c in range(len(messages)):
            o = done[f"c{c}t{t}"]
            history[c] = prompts[f"c{c}t{t}"] + o.outputs[0].token_ids
            m = o.metrics
            records.append({"turn": t, "prompt": len(o.prompt_token_ids), "cached": o.num_cached_tokens,
                            "kv_match": m.kv_match, "reuse_lost": m.reuse_lost, "ttft": m.ttft})
    return records


def measure(model: str, dtype: str, stride: int, capacity: int, sizes: dict, seed: int) -> dict:
    """One configuration: a warm-up pass of the workload compiles its step shapes, the prefix cache is emptied, then
    the same workload runs again and is measured (it compiles nothing: the counters say so)."""
    convs = sizes["conversations"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # capacity below one checkpoint per sequence warns by design
        engine = LLMEngine(model, dtype=dtype, chunk_stride=stride, block_size=sizes["block_size"], max_num_seqs=convs,
                           max_model_len=sizes["max_model_len"], num_linear_slots=1 + convs * (1 + capacity),
                           verbose=False)
    messages = conversation_turns(np.random.default_rng(seed), convs, sizes["turns"], sizes["user_words"])
    longest = longest_prompt(engine.tokenizer, messages, sizes["max_tokens"])
    if longest > sizes["max_model_len"]:  # the engine would refuse that turn only after running the earlier ones
        limit = (f"the {sizes['max_model_len']} positions of model {model}"
                 if sizes["max_model_len"] == engine.cfg.max_position_embeddings
                 else f"max_model_len {sizes['max_model_len']}")
        raise ValueError(f"--turns {sizes['turns']} and --max-tokens {sizes['max_tokens']} make a last-turn prompt "
                         f"of {longest} tokens, above {limit}: take fewer turns or shorter answers")
    run_workload(engine, messages, sizes["max_tokens"])
    engine.reset_prefix_cache()
    before = engine.cache_stats()
    recs = run_workload(engine, messages, sizes["max_tokens"])
    after = engine.cache_stats()
    later = [r for r in recs if r["turn"] > 0]      # turn 0 can only share the system prompt
    prompt_tokens, later_tokens = sum(r["prompt"] for r in recs), sum(r["prompt"] for r in later)
    return {"chunk_stride": stride, "capacity_per_seq": capacity,
            "reused_fraction": sum(r["cached"] for r in recs) / prompt_tokens,
            # None with one turn per conversation: there is no later turn to measure
            "reused_fraction_later_turns": sum(r["cached"] for r in later) / later_tokens if later else None,
            "reuse_lost_total": sum(r["reuse_lost"] for r in recs),
            "reuse_lost_per_request": statistics.fmean(r["reuse_lost"] for r in recs),
            "checkpoint_bytes": engine.memory.num_checkpoint_slots * engine.memory.bytes_per_linear_slot,
            "ttft_p50_ms": 1e3 * statistics.median(r["ttft"] for r in recs),
            "evictions": after["checkpoints_evicted"] - before["checkpoints_evicted"],
            "saves_skipped": after["checkpoints_save_skipped"] - before["checkpoints_save_skipped"],
            "compilations": after["compilations"] - before["compilations"],
            "requests": len(recs), "prompt_tokens": prompt_tokens}


def later_cell(fraction: float | None) -> str:
    return f"{'-':>8}" if fraction is None else f"{fraction:>8.1%}"


def conclusion(rows) -> str:
    best = max(rows, key=lambda r: (r["reused_fraction"], -r["checkpoint_bytes"]))
    cheapest = min((r for r in rows if r["reused_fraction"] >= 0.95 * best["reused_fraction"]),
                   key=lambda r: r["checkpoint_bytes"])
    by_cap = {}
    for r in rows:
        by_cap.setdefault(r["capacity_per_seq"], []).append(r["reused_fraction"])
    lo, hi = min(by_cap), max(by_cap)
    return (f"Most reuse: stride {best['chunk_stride']} with {best['capacity_per_seq']} checkpoint slot(s) per "
            f"sequence ({best['reused_fraction']:.1%} of prompt tokens); within 5% of it, the least checkpoint memory "
            f"is stride {cheapest['chunk_stride']} x {cheapest['capacity_per_seq']} "
            f"({cheapest['checkpoint_bytes'] / 2**20:.2f} MiB); going from {lo} to {hi} slot(s) per sequence moves "
            f"the mean reused fraction from {statistics.fmean(by_cap[lo]):.1%} to {statistics.fmean(by_cap[hi]):.1%}.")


def plot(rows, strides, caps, path: Path | None = None, ax=None):
    grid = np.array([[next(r["reused_fraction"] for r in rows if r["chunk_stride"] == s and r["capacity_per_seq"] == c)
                      for c in caps] for s in strides])
    fig, ax = figure((6, 4), ax)
    im = ax.imshow(grid, cmap="viridis", vmin=0, vmax=max(grid.max(), 1e-9), origin="lower")
    ax.set_xticks(range(len(caps)), [str(c) for c in caps])
    ax.set_yticks(range(len(strides)), [str(s) for s in strides])
    ax.set_xlabel("checkpoint slots per live sequence")
    ax.set_ylabel("chunk_stride (tokens)")
    for i in range(len(strides)):
        for j in range(len(caps)):
            ax.text(j, i, f"{grid[i, j]:.0%}", ha="center", va="center", color="w" if grid[i, j] < 0.5 else "k")
    fig.colorbar(im, ax=ax, label="fraction of prompt tokens reused")
    ax.set_title("Reuse under checkpoint pressure")
    save(fig, path)
    return fig


def main(argv=None) -> dict:
    ap = study_parser("checkpoint_tradeoff.py", __doc__, "checkpoint_tradeoff.json and .png",
                      "a 2 x 2 sweep (strides 64, 128; 1 and 4 slots per sequence) on a small workload with 64-token "
                      "blocks; the workload flags do not apply to it")
    # the workload flags default to None, so that one given with --quick (which has its own workload) is refused
    # rather than ignored without a word
    workload = {"conversations": "concurrent conversations (= max_num_seqs)", "turns": "turns per conversation",
                "max_tokens": "tokens per answer (greedy)", "block_size": "KV block size (tokens)"}
    for name, text in workload.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=positive_int, default=None,
                        help=f"{text} (default: {FULL[name]})")
    ap.add_argument("--seed", type=nonnegative_int, default=0, help="workload seed")
    args = parse(ap, argv, files=("checkpoint_tradeoff.json", "checkpoint_tradeoff.png"))
    given = [f"--{name.replace('_', '-')}" for name in workload if getattr(args, name) is not None]
    if args.quick and given:
        ap.error(f"--quick runs its own small workload: {', '.join(given)} would be ignored")
    for name in workload:
        if getattr(args, name) is None:
            setattr(args, name, FULL[name])

    strides, caps = ([64, 128], [1, 4]) if args.quick else ([64, 128, 256, 512], [1, 2, 4, 8])
    if not args.quick and any(s % args.block_size for s in strides):  # else the engine's error names no flag
        ap.error(f"--block-size ({args.block_size}) must divide every chunk_stride of the sweep ({strides})")
    sizes = QUICK if args.quick else {**FULL, "conversations": args.conversations, "turns": args.turns,
                                      "max_tokens": args.max_tokens, "block_size": args.block_size}
    # a model of fewer positions than the fixed max_model_len: its own (the engine would refuse the fixed one,
    # naming a setting this script takes no flag for); whether the conversations fit is checked before they run
    sizes = {**sizes, "max_model_len": fit_model_len(args.model, sizes["max_model_len"])}
    from tqdm.auto import tqdm
    rows = [measure(args.model, args.dtype, s, c, sizes, args.seed)
            for s, c in tqdm([(s, c) for s in strides for c in caps], desc="checkpoint trade-off", unit="config")]
    print(f"\n{'stride':>7}{'slots/seq':>10}{'reused':>9}{'later':>8}{'lost tot':>10}{'lost/req':>10}"
          f"{'ckpt MiB':>10}{'TTFT p50':>10}{'evict':>7}{'skipped':>9}")
    for r in rows:
        print(f"{r['chunk_stride']:>7}{r['capacity_per_seq']:>10}{r['reused_fraction']:>9.1%}"
              f"{later_cell(r['reused_fraction_later_turns'])}{r['reuse_lost_total']:>10}"
              f"{r['reuse_lost_per_request']:>10.1f}"
              f"{r['checkpoint_bytes'] / 2**20:>10.2f}{r['ttft_p50_ms']:>9.1f}ms{r['evictions']:>7}"
              f"{r['saves_skipped']:>9}")
    text = conclusion(rows)
    print("\n" + text)
    result = {"model": args.model, "dtype": args.dtype,
              "config": {"strides": strides, "capacities": caps, **sizes, "seed": args.seed, "quick": args.quick},
              "rows": rows, "conclusion": text, "environment": environment()}
    path = write_json(args.out, "checkpoint_tradeoff.json", result)
    plot(rows, strides, caps, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    run_command(main)
