"""Accuracy study: the exact prefix cache against no cache and against the two unsafe reuse paths.

    .venv/bin/python scripts/studies/accuracy_study.py [--model tiny] [--dtype float32] [--out results] [--quick]

One seeded workload (shared prefixes whose lengths fall between checkpoint boundaries, distinct suffixes, and
multi-turn continuations) runs through eight engines on the same weights:
  no_cache      the reference: every position computed from scratch
  exact         the prefix cache: reuse = min(KV match, checkpoint reach) on a checkpoint
  unsafe_cold   the whole KV match with a zero GDN state   (`LLM(unsafe_reuse="cold")`)
  unsafe_stale  the whole KV match with the GDN state of the deepest checkpoint below it (`unsafe_reuse="stale"`)
  ckpt_bfloat16, ckpt_int8, ckpt_float8   exact's reuse from compressed checkpoints (`checkpoint_dtype`), in the
                same pool bytes
  spec          exact with speculative decoding: the model's MTP block drafts 2 tokens a step (`speculative_config`);
                greedy outputs equal exact's, and the JSON records the drafts accepted over the free-running part
                (`spec_acceptance`: accepted / drafted; the teacher-forced pass, with prompt logprobs, drafts none).
                Left out, with a line on stdout, for a model without an MTP block (tiny-random)
Per mode: teacher-forced on the reference continuation, KL(reference || mode) at every position the mode computed
(from whole log-distributions, `prompt_logprobs=-1`), and the largest |delta logprob| of the reference tokens;
free-running greedy agreement with the reference, and where the first token differs. Prints a table, writes
DIR/accuracy_study.json and DIR/accuracy_study.png (KL against the distance from the reuse point, log scale). Whole
log-distributions need a vocabulary of at most 65,536 ids (not Qwen3.5's 248k).
"""

from __future__ import annotations

import statistics
import sys
import warnings
from pathlib import Path

import numpy as np

from gdn_jax import LLM, SamplingParams
from gdn_jax.engine.input_processor import MAX_FULL_ROW_VOCAB
from gdn_jax.entrypoints.cli import nonnegative_int, positive_int

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared helpers in common.py
from common import (check_length, environment, figure, fit_model_len, model_config, parse, pools_of,  # noqa: E402
                    run_command, save, share_of, study_parser, write_json)

MODES = {"no_cache": dict(enable_prefix_caching=False), "exact": dict(enable_prefix_caching=True),
         "unsafe_cold": dict(enable_prefix_caching=True, unsafe_reuse="cold"),
         "unsafe_stale": dict(enable_prefix_caching=True, unsafe_reuse="stale"),
         **{f"ckpt_{name}": dict(enable_prefix_caching=True, checkpoint_dtype=dtype)
            for name, dtype in [("bfloat16", "bfloat16"), ("int8", "int8"), ("float8", "float8_e4m3fn")]},
         "spec": dict(enable_prefix_caching=True, speculative_config={"method": "mtp", "num_speculative_tokens": 2})}
# workload sizes: the full study and --quick (a test and the notebook's reduced mode run the latter)
SIZES = {"full": dict(groups=6, per_group=4, turns=2, max_tokens=24),
         "quick": dict(groups=2, per_group=2, turns=1, max_tokens=12)}
ENGINE = dict(block_size=16, max_num_seqs=4, max_model_len=1024)
OPENINGS = ["The following section of the Python language reference describes",
            "In the standard library documentation, the module",
            "A function definition defines a user-defined function object. The",
            "Exceptions are raised when an error is detected during execution, and"]


def check_stride(chunk_stride: int, block_size: int) -> None:
    """A stride of one KV block leaves no KV match between two checkpoints: the unsafe paths could not be measured."""
    if chunk_stride < 2 * block_size:
        raise ValueError(f"--chunk-stride ({chunk_stride}) must be at least two KV blocks ({2 * block_size}): with "
                         f"one, every KV match ends on a checkpoint and unsafe_stale reuses exactly what exact does")


def make_workload(vocab: int, chunk_stride: int, groups: int, per_group: int, turns: int, rng, tokenizer,
                  block_size: int = ENGINE["block_size"]):
    """Requests as token lists, in the order they run. Each group shares a prefix whose length lies strictly between
    two checkpoint boundaries, at least a KV block past the lower one (so the KV match, in whole blocks, passes the
    deepest checkpoint: else the unsafe paths would reuse what the exact one does), then distinct suffixes; the last
    request of each group is continued for `turns` more turns (its reference answer + a new user line, `user_turns`,
    drawn from `rng` like the rest)."""
    check_stride(chunk_stride, block_size)
    items = []
    for g in range(groups):
        past = int(rng.integers(max(chunk_stride // 4, block_size), 3 * chunk_stride // 4))  # past the boundary
        n = chunk_stride * (1 + g % 3) + past
        base = tokenizer.encode(OPENINGS[g % len(OPENINGS)] + " ")[:n]  # a short stride's prefix: the opening's start
        prefix = (base * (n // max(len(base), 1) + 1))[:n]
        prefix[len(base):] = [int(t) for t in rng.integers(32, min(vocab, 127), n - len(base))]
        for i in range(per_group):
            suffix = [int(t) for t in rng.integers(32, min(vocab, 127), int(rng.integers(8, 24)))]
            items.append({"group": g, "turn": 0, "tokens": prefix + suffix})
    for g in range(groups):  # drawn after the prompts, which are then those of a workload without turns
        last = items[(g + 1) * per_group - 1]
        last["user_turns"] = [[int(t) for t in rng.integers(32, min(vocab, 127), 12)] for _ in range(turns)]
    return items


def run_mode(llm: LLM, items, max_tokens: int, reference=None, bar=None):
    """Per item: free-running greedy on the prompt, then teacher-forced on prompt + reference continuation (whole
    rows). Multi-turn items are appended as they come (the reference decides the continuation text)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    # each mode reads the cache as it would without prompt logprobs: the study compares what it computes
    forced = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=-1,
                            skip_reading_prefix_cache=False)
    results, queue = [], list(items)
    while queue:
        item = queue.pop(0)
        free = llm.generate({"prompt_token_ids": item["tokens"]}, greedy, use_tqdm=False)[0]
        k = len(results)
        cont = reference[k]["free"] if reference is not None else free.outputs[0].token_ids
        tf = llm.generate({"prompt_token_ids": item["tokens"] + cont}, forced, use_tqdm=False)[0]
        rows = {p: np.asarray(e.array, np.float64) for p, e in enumerate(tf.prompt_logprobs) if e is not None}
        results.append({"prompt_len": len(item["tokens"]), "free": free.outputs[0].token_ids,
                        "free_cached": free.num_cached_tokens, "tf_tokens": item["tokens"] + cont,
                        # speculation (0 without): the MTP drafts the greedy generation verified, and those accepted
                        "drafted": free.metrics.spec_draft_tokens, "accepted": free.metrics.spec_accepted_tokens,
                        "tf_cached": tf.num_cached_tokens, "rows": rows})
        if item.get("user_turns"):
            user, *later = item["user_turns"]
            queue.insert(0, {**item, "turn": item["turn"] + 1, "user_turns": later,
                             "tokens": item["tokens"] + cont + user})
        if bar is not None:
            bar.update(1)
    return results


def compare(ref, mode):
    """KL(ref || mode) per computed position, |delta logprob| of the reference token, greedy agreement; with
    speculation, the share of the MTP block's drafts accepted over the free-running greedy generation (None
    without)."""
    kls, by_distance, dlp, agree, total, firsts = [], {}, [], 0, 0, []
    for r, m in zip(ref, mode):
        for p, row in m["rows"].items():
            pr = r["rows"][p]
            kl = float(np.sum(np.exp(pr) * (pr - row)))
            kls.append(max(kl, 0.0))
            by_distance.setdefault(p - m["tf_cached"], []).append(max(kl, 0.0))
            tok = r["tf_tokens"][p]
            dlp.append(abs(pr[tok] - row[tok]))
        same = [a == b for a, b in zip(r["free"], m["free"])]
        agree, total = agree + sum(same), total + len(same)
        if not all(same):
            firsts.append(same.index(False))
    drafted, accepted = sum(m["drafted"] for m in mode), sum(m["accepted"] for m in mode)
    return {"kl_mean": statistics.fmean(kls), "kl_max": max(kls), "greedy_agreement": agree / total,
            "first_divergence_mean": statistics.fmean(firsts) if firsts else None,
            "diverging_requests": len(firsts), "requests": len(mode),
            "max_abs_logprob_diff": float(max(dlp)), "positions": len(kls),
            "mean_cached_tokens": statistics.fmean(m["tf_cached"] for m in mode),  # the teacher-forced pass
            "mean_prompt_cached_tokens": statistics.fmean(m["free_cached"] for m in mode),  # the prompts
            "spec_draft_tokens": drafted, "spec_accepted_tokens": accepted,
            "spec_acceptance": accepted / drafted if drafted else None,
            "kl_by_distance": {int(d): statistics.fmean(v) for d, v in sorted(by_distance.items())}}


def workload_len(chunk_stride: int, turns: int, max_tokens: int) -> int:
    """The workload's longest sequence (`make_workload`'s longest prefix and suffix, each later turn's reference
    answer and user line, the teacher-forced answer and the one token sampled after it), in whole blocks: the least
    max_model_len with which no prompt is refused and no answer cut short."""
    longest = 3 * chunk_stride + 3 * chunk_stride // 4 + 24 + turns * (max_tokens + 12) + max_tokens + 1
    block = ENGINE["block_size"]
    return -(-longest // block) * block


def model_len(model: str, needed: int) -> int:
    """The engines' max_model_len: ENGINE's, or the model's positions where it has fewer (said on stdout), or more if
    the workload needs it (`workload_len`, checked against the model first)."""
    return max(needed, fit_model_len(model, ENGINE["max_model_len"]))


def modes_of(model: str) -> dict[str, dict]:
    """MODES less `spec` for a model without an MTP block to draft with (its engine would refuse to start)."""
    cfg = model_config(model)
    if cfg is not None and not cfg.mtp_num_hidden_layers:
        return {name: mode for name, mode in MODES.items() if "speculative_config" not in mode}
    return dict(MODES)


def pools_for(exact, mode: dict) -> dict:
    """The pools of mode `mode`'s engine: those of the `exact` engine (`pools_of`), and for speculation its draft
    slots (k per sequence) beside them, so that it has exact's checkpoint room."""
    pools = pools_of(exact)
    spec = mode.get("speculative_config")
    if spec and exact.memory.bytes_per_linear_slot:
        pools["num_linear_slots"] += spec["num_speculative_tokens"] * exact.config.scheduling.max_num_seqs
    return pools


def make_engines(model: str, dtype: str, chunk_stride: int, max_model_len: int = ENGINE["max_model_len"]
                 ) -> dict[str, LLM]:
    """One engine per mode of the model (`modes_of`) on the same weights. All get the pools of the `exact` engine:
    their steps have the same shapes and the first engine's compiled steps serve the unsafe ones; the compressed ones,
    with fewer float32 slots (`checkpoint_dtype`), share theirs; `spec`'s hold its draft slots too, and it compiles
    its own steps (they draft)."""
    modes, engines = modes_of(model), {}
    # the accelerator's share per engine: spec's pools are larger (its MTP block's KV and its draft slots), counted
    # as two engines' (at most about twice exact's)
    shares = sum(2 if "speculative_config" in mode else 1 for mode in modes.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the unsafe modes warn by design
        for name in sorted(modes, key=lambda name: name != "exact"):
            pools = pools_for(engines["exact"].engine, modes[name]) if engines else share_of(shares)
            engines[name] = LLM(model, dtype=dtype, chunk_stride=chunk_stride, verbose=False,
                                **{**ENGINE, "max_model_len": max_model_len}, **pools, **modes[name])
    return {name: engines[name] for name in modes}


def num_requests(groups: int, per_group: int, turns: int, **_) -> int:
    return groups * per_group + groups * turns


def run_all(engines: dict[str, LLM], items, max_tokens: int, progress: bool = True):
    """The reference (no_cache) first, then every other mode of `engines` teacher-forced on its continuations."""
    bar = None
    if progress:
        from tqdm.auto import tqdm
        n = len(items) + sum(len(i.get("user_turns", ())) for i in items)  # each user turn is one more request
        bar = tqdm(total=n * len(engines), desc="accuracy study", unit="req")
    ref = run_mode(engines["no_cache"], items, max_tokens, bar=bar)
    runs = {name: run_mode(engines[name], items, max_tokens, reference=ref, bar=bar)
            for name in engines if name != "no_cache"}
    if bar is not None:
        bar.close()
    return ref, runs


def table(summary) -> str:
    # reused: mean tokens per request on the prompts, and on the teacher-forced (scoring) pass
    lines = [f"{'mode':<14}{'reused':>8}{'scoring':>9}{'KL mean':>11}{'KL max':>11}{'max|dlogp|':>12}"
             f"{'greedy agr':>12}{'diverging':>11}{'first div':>10}"]
    for name, s in summary.items():
        fd = "-" if s["first_divergence_mean"] is None else f"{s['first_divergence_mean']:.1f}"
        lines.append(f"{name:<14}{s['mean_prompt_cached_tokens']:>8.1f}{s['mean_cached_tokens']:>9.1f}"
                     f"{s['kl_mean']:>11.2e}{s['kl_max']:>11.2e}"
                     f"{s['max_abs_logprob_diff']:>12.2e}{s['greedy_agreement']:>12.3f}"
                     f"{s['diverging_requests']:>5}/{s['requests']:<5}{fd:>10}")
    for name, s in summary.items():  # speculation: below the table (the other modes draft nothing)
        if s["spec_acceptance"] is not None:
            lines.append(f"{name}: {s['spec_acceptance']:.3f} of the MTP block's drafts accepted over the free-running "
                         f"greedy generation ({s['spec_accepted_tokens']}/{s['spec_draft_tokens']})")
    return "\n".join(lines)


def plot(summary, path: Path | None = None, ax=None):
    """KL against the distance from the reuse point, one line per mode, log scale; drawn on `ax` if given (see
    `common.figure`), saved to `path` if given."""
    fig, ax = figure((7, 4), ax)
    for name, s in summary.items():
        d = np.array(list(s["kl_by_distance"]), float)
        kl = np.maximum(np.array(list(s["kl_by_distance"].values()), float), 1e-16)
        ax.plot(d, kl, marker=".", linewidth=1, label=name,  # spec: dashed, over exact's line (the same pass)
                linestyle="--" if s["spec_acceptance"] is not None else "-")
    ax.set_yscale("log")
    ax.set_xlabel("distance from the reuse point (tokens)")
    ax.set_ylabel("KL(no_cache || mode), mean over requests")
    ax.set_title("Drift after the reuse point")
    ax.legend()
    save(fig, path)
    return fig


def main(argv=None) -> dict:
    ap = study_parser("accuracy_study.py", __doc__, "accuracy_study.json and accuracy_study.png", "a small workload")
    ap.add_argument("--chunk-stride", type=positive_int, default=64, help="tokens between checkpoints")
    ap.add_argument("--max-tokens", type=positive_int, default=SIZES["full"]["max_tokens"],
                    help="reference continuation length (greedy; --quick caps it at 12)")
    ap.add_argument("--seed", type=nonnegative_int, default=0, help="workload seed")
    args = parse(ap, argv, files=("accuracy_study.json", "accuracy_study.png"))
    check_stride(args.chunk_stride, ENGINE["block_size"])  # (make_workload's check, before any engine is built)

    sizes = dict(SIZES["quick" if args.quick else "full"])
    sizes["max_tokens"] = min(args.max_tokens, sizes["max_tokens"]) if args.quick else args.max_tokens
    needed = workload_len(args.chunk_stride, sizes["turns"], sizes["max_tokens"])
    check_length(ap, args.model, needed, f"--chunk-stride {args.chunk_stride} and --max-tokens {sizes['max_tokens']}")
    max_len = model_len(args.model, needed)
    cfg = model_config(args.model)
    if cfg is not None and cfg.vocab_size > MAX_FULL_ROW_VOCAB:  # the engine would refuse the first scoring pass
        ap.error(f"--model {args.model}: a vocabulary of {cfg.vocab_size} ids, above the {MAX_FULL_ROW_VOCAB} whose "
                 f"whole log-distributions (the KL) the engine returns")
    if "spec" not in modes_of(args.model):
        print(f"spec: left out, model {args.model} has no MTP block to draft with")
    engines = make_engines(args.model, args.dtype, args.chunk_stride, max_len)
    tok = engines["no_cache"].get_tokenizer()
    vocab = engines["no_cache"].engine.cfg.vocab_size
    items = make_workload(vocab, args.chunk_stride, sizes["groups"], sizes["per_group"], sizes["turns"],
                          np.random.default_rng(args.seed), tok)
    ref, runs = run_all(engines, items, sizes["max_tokens"])
    summary = {name: compare(ref, r) for name, r in runs.items()}
    print("\n" + table(summary))
    result = {"model": args.model, "dtype": args.dtype,
              "config": {"chunk_stride": args.chunk_stride, **ENGINE, "max_model_len": max_len, **sizes,
                         "requests": num_requests(**sizes), "seed": args.seed, "quick": args.quick,
                         **({"speculative_config": MODES["spec"]["speculative_config"]} if "spec" in engines else {})},
              "modes": summary, "environment": environment()}
    path = write_json(args.out, "accuracy_study.json", result)
    plot(summary, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    run_command(main)
