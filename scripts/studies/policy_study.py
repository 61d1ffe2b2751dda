"""The policy lab: checkpoint eviction policies compared on traces shaped like real workloads, at equal memory.

    .venv/bin/python scripts/studies/policy_study.py [--model tiny] [--dtype float32] [--out results] [--quick]
                                                     [--policies lru,flop_aware,overlap,end_of_turn,lru_int8]
                                                     [--alpha 2.0]
                                                     [--checkpoints 6]

Three workloads, token ids drawn from the model's vocabulary (seeded), lengths scaled down for a CPU:
- `chat`: conversations of several turns, each turn's prompt the conversation so far plus a new user message,
  submitted turn by turn, all conversations at once. Shaped on LMSYS-Chat-1M (Zheng et al., 2023), whose
  conversations have 2.0 turns on average, user messages of 69.5 tokens and answers of 214.5: here 3 turns, messages
  of 20-80 tokens, answers of 32 (--quick: 16).
- `agentic`: a long shared tool prompt; each task's steps extend its own context with an action and an observation
  (the ReAct loop, Yao et al., 2023), and every other task branches from the second step of the task before it, as
  sub-tasks of one job do.
- `fewshot`: one long shared prefix of worked examples and many short questions after it, each answered in a few
  tokens, as in MMLU's 5-shot evaluation (Hendrycks et al., 2021).

Policies: `lru` (every boundary saved, LRU eviction: the default), `flop_aware` (every boundary, Marconi's FLOP-aware
eviction), `overlap` (the boundaries the observed shared-prefix lengths favour, LRU eviction) and `end_of_turn`
(every boundary, and the states at the end of each prompt and of each output so far, LRU eviction), and `lru_int8`
(`lru` with int8 checkpoints, `checkpoint_dtype`: about 4x as many in the same bytes; not exact, its drift is the
accuracy study's).

Each workload runs on one engine per policy and on a cache-off engine, all with the same pools: KV blocks enough for
every sequence (so that only the linear checkpoints compete), and `--checkpoints` checkpoint slots beside the live
ones. Each policy's measured pass follows a first pass on an engine of its own, which compiles the step shapes. Per workload and policy: the token hit rate (prompt tokens reused over prompt tokens), TTFT p50 and p95 (ms),
the prefill FLOPs the hits saved (`ModelConfig.prefill_flops` at each request's reuse), the checkpoint room in bytes,
evictions, checkpoints saved, and `exact`: every request's tokens equal the cache-off engine's.

Then the host tier (`host_checkpoint_bytes`): the TTFT of a prompt whose prefix (--quick: 256 tokens, else 1024) is a
checkpoint on the device, on the host, or recomputed (`host_tier`).

Writes policy_study.json ({"workloads": {name: {policy: {...}}}, "host_tier": {...}}) and policy_study.png (hit rate
and checkpoints saved per workload and policy), and prints a table.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import numpy as np

from gdn_jax import LLMEngine, SamplingParams
from gdn_jax.entrypoints.cli import positive_int
from scheduler.eviction import PrefillCost

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared helpers in common.py
from common import environment, parse, run_command, save, study_parser, write_json  # noqa: E402

FULL = dict(conversations=6, turns=3, message=(20, 80), answer=32, tool_prompt=384, tasks=6, steps=3, action=48,
            shots=512, questions=16, question=(10, 40), chunk_stride=32, max_model_len=2048)
QUICK = dict(conversations=3, turns=3, message=(12, 40), answer=16, tool_prompt=128, tasks=3, steps=3, action=24,
             shots=192, questions=6, question=(8, 24), chunk_stride=32, max_model_len=1024)
MAX_NUM_SEQS = 4
# policy -> its engine settings
POLICIES = {"lru": dict(checkpoint_eviction="lru"), "flop_aware": dict(checkpoint_eviction="flop_aware"),
            "overlap": dict(checkpoint_eviction="lru", checkpoint_placement="overlap"),
            "end_of_turn": dict(checkpoint_eviction="lru", checkpoint_placement="end_of_turn"),
            "lru_int8": dict(checkpoint_eviction="lru", checkpoint_dtype="int8")}


def _ids(rng, vocab: int, n: int) -> list[int]:
    return rng.integers(4, vocab, n).tolist()


def _run(engine, requests) -> dict:
    """Submits (id, prompt, max_tokens) together and steps until they are done: id -> final output."""
    for rid, prompt, max_tokens in requests:
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return done


def _wave(engine, contexts: dict, prompts: dict, name, max_tokens: int) -> dict:
    """Runs prompts[key] together, each under the id name(key); each context becomes its prompt and its answer.
    Returns the outputs by id."""
    done = _run(engine, [(name(k), p, max_tokens) for k, p in prompts.items()])
    for k, p in prompts.items():
        contexts[k] = p + done[name(k)].outputs[0].token_ids
    return done


def chat(engine, size: dict, vocab: int, rng) -> dict:
    system = _ids(rng, vocab, 48)
    history = {c: list(system) for c in range(size["conversations"])}
    messages = {(c, t): _ids(rng, vocab, int(rng.integers(*size["message"])))
                for c in history for t in range(size["turns"])}
    outs = {}
    for t in range(size["turns"]):
        prompts = {c: history[c] + messages[c, t] for c in history}
        outs.update(_wave(engine, history, prompts, lambda c, t=t: f"c{c}t{t}", size["answer"]))
    return outs


def agentic(engine, size: dict, vocab: int, rng) -> dict:
    tools = _ids(rng, vocab, size["tool_prompt"])
    steps = [[_ids(rng, vocab, size["action"]) for _ in range(size["steps"])] for _ in range(size["tasks"])]
    context = {k: tools + _ids(rng, vocab, 16) for k in range(size["tasks"])}
    outs = {}
    for s in range(size["steps"]):
        if s == 2:  # every other task becomes a sub-task branching from the second step of the task before it
            for k in range(1, size["tasks"], 2):
                parent = outs[f"a{k - 1}s1"]
                context[k] = list(parent.prompt_token_ids) + parent.outputs[0].token_ids
        prompts = {k: context[k] + steps[k][s] for k in context}
        outs.update(_wave(engine, context, prompts, lambda k, s=s: f"a{k}s{s}", 8))
    return outs


def fewshot(engine, size: dict, vocab: int, rng) -> dict:
    shots = _ids(rng, vocab, size["shots"])
    questions = [_ids(rng, vocab, int(rng.integers(*size["question"]))) for _ in range(size["questions"])]
    return _run(engine, [(f"q{i}", shots + q, 2) for i, q in enumerate(questions)])


WORKLOADS = {"chat": chat, "agentic": agentic, "fewshot": fewshot}


def measure(outs: dict, engine, cost: PrefillCost) -> dict:
    stats, plan = engine.cache_stats(), engine.memory
    ttft = sorted(o.metrics.ttft * 1e3 for o in outs.values())
    return {"token_hit_rate": stats["reused_tokens"] / max(1, stats["query_tokens"]),
            "ttft_p50_ms": statistics.median(ttft), "ttft_p95_ms": float(np.percentile(ttft, 95)),
            "flops_saved": sum(cost.flops(o.num_cached_tokens) for o in outs.values()),
            "checkpoint_bytes": (plan.num_checkpoint_slots * plan.bytes_per_linear_slot
                                 + plan.num_compressed_checkpoints * plan.bytes_per_compressed_checkpoint),
            "checkpoint_slots": plan.num_checkpoint_slots, "compressed_checkpoints": plan.num_compressed_checkpoints,
            "evictions": stats["checkpoints_evicted"], "checkpoints_saved": stats["checkpoints_saved"],
            "hits": stats["hits"], "queries": stats["queries"],
            "checkpoint_dtype": engine.config.cache.checkpoint_dtype}


def plot(workloads: dict, path: Path | None = None, axes=None):
    """Token hit rate and checkpoints saved, one group of bars per workload and one bar per policy, on two axes
    (`axes`: a notebook's; else a new figure). Saved as PNG to `path` when given."""
    if axes is None:
        from matplotlib.figure import Figure  # no pyplot: a headless script neither needs nor changes a backend
        axes = Figure(figsize=(11, 3.6)).subplots(1, 2)
    names, policies = list(workloads), list(next(iter(workloads.values())))
    width = 0.8 / len(policies)
    for ax, (key, label) in zip(axes, [("token_hit_rate", "token hit rate"), ("checkpoints_saved", "checkpoints saved")]):
        for j, policy in enumerate(policies):
            ax.bar([i + (j - (len(policies) - 1) / 2) * width for i in range(len(names))],
                   [workloads[n][policy][key] for n in names], width, label=policy)
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel(label)
    axes[0].legend()
    axes[0].set_title("Checkpoint policies at equal memory")
    save(axes[0].figure, path)
    return axes[0].figure


def run_study(model: str, dtype: str, size: dict, policies=tuple(POLICIES), alpha: float = 2.0,
              checkpoints: int = 6, progress=print) -> dict:
    """Every workload on a cache-off engine and on one engine per policy, all with the same pools: {workload name:
    {policy: the row `measure` gives, with "exact"}}. `progress` receives each row's line of the table."""
    pools = dict(num_linear_slots=1 + MAX_NUM_SEQS + checkpoints, max_num_seqs=MAX_NUM_SEQS,
                 num_kv_blocks=MAX_NUM_SEQS * size["max_model_len"] // 16 * 2 + 1, block_size=16,
                 chunk_stride=size["chunk_stride"], max_model_len=size["max_model_len"], dtype=dtype, verbose=False)
    progress(f"{'workload':9} {'policy':11} {'hit rate':>8} {'TTFT p50':>9} {'p95':>8} {'FLOPs saved':>12} "
             f"{'evictions':>9} {'saved':>6} exact")
    result = {}
    for name, workload in WORKLOADS.items():
        off = LLMEngine(model, enable_prefix_caching=False, **pools)
        vocab, cost = off.cfg.vocab_size, PrefillCost(*off.cfg.prefill_flops())
        reference = {rid: o.outputs[0].token_ids for rid, o in workload(off, size, vocab,
                                                                           np.random.default_rng(0)).items()}
        rows = result[name] = {}
        for policy in policies:
            settings = dict(POLICIES[policy], eviction_alpha=alpha, **pools)
            # a first pass on an engine of its own compiles every step shape the measured pass runs
            workload(LLMEngine(model, **settings), size, vocab, np.random.default_rng(0))
            engine = LLMEngine(model, **settings)
            outs = workload(engine, size, vocab, np.random.default_rng(0))
            row = rows[policy] = measure(outs, engine, cost)
            row["exact"] = {rid: o.outputs[0].token_ids for rid, o in outs.items()} == reference
            progress(f"{name:9} {policy:11} {row['token_hit_rate']:8.3f} {row['ttft_p50_ms']:9.1f} "
                     f"{row['ttft_p95_ms']:8.1f} {row['flops_saved']:12.3g} {row['evictions']:9d} "
                     f"{row['checkpoints_saved']:6d} {row['exact']}")
    return result


def host_tier(model: str, dtype: str, prefix: int, rounds: int = 5, progress=print) -> dict:
    """The TTFT of a prompt whose `prefix` tokens are cached as a checkpoint on the device, on the host
    (`host_checkpoint_bytes`: the device's one checkpoint slot was taken by two later prompts) or nowhere (the same
    without the host tier: recomputed); KV blocks for every prompt stay cached. Medians over `rounds` prompts, after a compiling round; `exact`: the host
    hits' tokens equal the recomputed ones."""
    kw = dict(max_num_seqs=1, num_linear_slots=3, block_size=16, chunk_stride=32, checkpoint_policy="last",
              max_model_len=prefix + 64, num_kv_blocks=4 * (prefix + 64) // 16 + 1, dtype=dtype, verbose=False)
    engines = {"device_hit": LLMEngine(model, **kw), "host_hit": LLMEngine(model, host_checkpoint_bytes=1 << 30, **kw),
               "recompute": LLMEngine(model, **kw)}
    rng, vocab = np.random.default_rng(1), engines["device_hit"].cfg.vocab_size
    prompts = [(_ids(rng, vocab, prefix), _ids(rng, vocab, 8), [_ids(rng, vocab, prefix) for _ in range(2)])
               for _ in range(rounds + 1)]

    def ttfts(engine, evict: bool):
        out = []
        for i, (shared, tail, others) in enumerate(prompts):
            _run(engine, [(f"a{i}", shared + [3], 1)])
            for j, other in enumerate(others if evict else ()):
                _run(engine, [(f"o{i}.{j}", other, 1)])
            hit = _run(engine, [(f"b{i}", shared + tail, 4)])[f"b{i}"]
            out.append((hit.metrics.ttft * 1e3, hit.num_cached_tokens, hit.outputs[0].token_ids))
        return out[1:]  # the first round compiled

    runs = {name: ttfts(engine, evict=name != "device_hit") for name, engine in engines.items()}
    host, recompute = runs["host_hit"], runs["recompute"]
    row = {"prefix_tokens": prefix}
    for name, runs in runs.items():
        row[f"{name}_ttft_ms"] = statistics.median(t for t, _, _ in runs)
        row[f"{name}_reused_tokens"] = statistics.median(r for _, r, _ in runs)
    row["exact"] = [tokens for *_, tokens in host] == [tokens for *_, tokens in recompute]
    progress(f"host tier, {prefix}-token prefix: TTFT device hit {row['device_hit_ttft_ms']:.1f} ms, host hit "
             f"{row['host_hit_ttft_ms']:.1f} ms, recompute {row['recompute_ttft_ms']:.1f} ms (reused "
             f"{row['device_hit_reused_tokens']:.0f} / {row['host_hit_reused_tokens']:.0f} / "
             f"{row['recompute_reused_tokens']:.0f} tokens), exact {row['exact']}")
    return row


def main(argv=None):
    ap = study_parser("policy_study.py", __doc__, "policy_study.json and .png", "3 small workloads on the tiny model")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help=f"comma-separated, of {', '.join(POLICIES)}")
    ap.add_argument("--alpha", type=float, default=2.0, help="flop_aware: the weight of FLOPs saved against recency")
    ap.add_argument("--checkpoints", type=positive_int, default=6,
                    help="checkpoint slots beside the live ones (the same for every policy)")
    args = parse(ap, argv, files=("policy_study.json", "policy_study.png"))
    policies = args.policies.split(",")
    wrong = [p for p in policies if p not in POLICIES]
    if wrong:
        ap.error(f"--policies: {', '.join(wrong)}: expected some of {', '.join(POLICIES)}")
    workloads = run_study(args.model, args.dtype, QUICK if args.quick else FULL, policies, args.alpha,
                          args.checkpoints)
    plot(workloads, Path(args.out) / "policy_study.png")
    tier = host_tier(args.model, args.dtype, 256 if args.quick else 1024)
    result = {"args": vars(args), "environment": environment(), "workloads": workloads, "host_tier": tier}
    print(f"wrote {write_json(args.out, 'policy_study.json', result)} and policy_study.png")


if __name__ == "__main__":
    run_command(main)
