"""gdn-jax against transformers on one random Qwen3.5 checkpoint made here by transformers (needs the reference extra).

    .venv/bin/python scripts/bench/bench_vs_transformers.py [--model hybrid-1024] [--dtype float32] [--out results]
                                                            [--quick]

transformers builds a random `Qwen3_5ForCausalLM` with the shapes of `--model` (a preset, or a model folder's
config.json) and saves it (`save_pretrained`); the engine loads that folder. Two measurements, both greedy, outputs
compared:
  forward      one prefill of `--tokens` tokens: transformers' forward (no cache, last logits) vs the engine's
               time to first token with the cache off (after warm-up)
  end to end   `--requests` requests sharing a `--system`-token system prompt, each with its own `--suffix` tokens,
               each generating `--max-tokens` tokens: transformers' batched `generate` with its own cache vs the
               engine with the prefix cache on (the first request, then the rest, as a client with a warm system
               prompt would send them)
Prints the times, the ratios and the greedy agreement; writes DIR/bench_vs_transformers.json.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from gdn_jax import LLM, ModelConfig, SamplingParams, get_preset
from gdn_jax.entrypoints.cli import nonnegative_int, positive_int
from gdn_jax.model.weights import model_folder
from scheduler.sampling_params import MAX_LOGPROBS

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared helpers in common.py
from common import import_reference, run_command, study_parser, write_json  # noqa: E402


def shapes_of(model: str) -> ModelConfig:
    """The config of a preset, or of a model folder's config.json (only its shapes are used)."""
    folder = model_folder(model)
    return get_preset(model) if folder is None else ModelConfig.from_pretrained(folder)


def make_checkpoint(cfg: ModelConfig, folder: Path, seed: int):
    """A random `Qwen3_5ForCausalLM` of `cfg`'s shapes, saved to `folder`. It has no end-of-sequence token, so both
    sides generate every requested token."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    hf_cfg = Qwen3_5TextConfig(**{**cfg.to_hf_config(), "eos_token_id": None})
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(hf_cfg).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model


def timed(fn, repeats: int):
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def main(argv=None) -> dict:
    ap = study_parser("bench_vs_transformers.py", __doc__, "bench_vs_transformers.json",
                      "tiny-random shapes (unless --model says otherwise) and small sizes", model_default=None,
                      model_aliases=("--preset",), dtypes=("float32",),
                      model_help="shapes of the random checkpoint: a preset or a model folder (default: hybrid-1024; "
                                 "tiny-random with --quick)")
    ap.add_argument("--tokens", type=positive_int, default=2048, help="tokens of the forward measurement")
    ap.add_argument("--requests", type=positive_int, default=32, help="requests of the end-to-end measurement")
    ap.add_argument("--system", type=positive_int, default=1024, help="tokens of the shared system prompt")
    ap.add_argument("--suffix", type=positive_int, default=32, help="tokens of each request's own part")
    ap.add_argument("--max-tokens", type=positive_int, default=32, help="tokens each request generates (greedy)")
    ap.add_argument("--repeats", type=positive_int, default=2, help="timed repeats; the minimum is reported")
    ap.add_argument("--seed", type=nonnegative_int, default=0, help="weights and prompt seed")
    args = ap.parse_args(argv)
    args.model = args.model or ("tiny-random" if args.quick else "hybrid-1024")
    if args.quick:
        args.tokens, args.requests, args.system, args.suffix, args.max_tokens = 256, 4, 96, 8, 8

    torch, _ = import_reference("bench_vs_transformers.py")
    torch.set_num_threads(torch.get_num_threads())
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_checkpoint(shapes_of(args.model), Path(tmp), args.seed)
        vocab = model.config.vocab_size
        kw = dict(dtype=args.dtype, block_size=16, max_model_len=max(args.tokens, args.system + args.suffix +
                                                                      args.max_tokens) + 16, verbose=False)
        # ---- forward ----------------------------------------------------------------------------------------
        prompt = rng.integers(4, vocab, args.tokens).tolist()
        off = LLM(tmp, enable_prefix_caching=False, chunk_stride=args.tokens, max_num_seqs=1,
                  max_num_batched_tokens=args.tokens, **kw)
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=MAX_LOGPROBS)
        off.generate({"prompt_token_ids": rng.integers(4, vocab, args.tokens).tolist()}, one, use_tqdm=False)
        ours_fwd, out = timed(lambda: off.generate({"prompt_token_ids": prompt}, one, use_tqdm=False)[0],
                              args.repeats)
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            model(ids[:, :64], use_cache=False, logits_to_keep=1)
            hf_fwd, logits = timed(lambda: model(ids, use_cache=False, logits_to_keep=1).logits, args.repeats)
        fwd_same = int(logits[0, -1].argmax()) == out.outputs[0].token_ids[0]
        ref = torch.log_softmax(logits[0, -1].double(), -1)  # the engine's top logprobs against transformers'
        fwd_diff = max(abs(lp.logprob - float(ref[t])) for t, lp in out.outputs[0].logprobs[0].items())
        off = None  # its pools freed before the next engine's are made
        # ---- end to end -------------------------------------------------------------------------------------
        system = rng.integers(4, vocab, args.system).tolist()
        prompts = [system + rng.integers(4, vocab, args.suffix).tolist() for _ in range(args.requests)]
        greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        on = LLM(tmp, enable_prefix_caching=True, chunk_stride=64, max_num_seqs=min(args.requests, 32), **kw)

        def engine_run(ps):
            first = on.generate({"prompt_token_ids": ps[0]}, greedy, use_tqdm=False)
            return first + on.generate([{"prompt_token_ids": p} for p in ps[1:]], greedy, use_tqdm=False)

        warm = [rng.integers(4, vocab, args.system + args.suffix).tolist() for _ in range(args.requests)]
        engine_run(warm)  # compiles the shapes
        on.reset_prefix_cache()
        ours_e2e, outs = timed(lambda: (on.reset_prefix_cache(), engine_run(prompts))[1], args.repeats)
        batch = torch.tensor(prompts)
        with torch.inference_mode():
            hf_e2e, gen = timed(lambda: model.generate(batch, attention_mask=torch.ones_like(batch),
                                                       max_new_tokens=args.max_tokens, do_sample=False,
                                                       eos_token_id=None, pad_token_id=0), args.repeats)
        hf_tokens = gen[:, batch.shape[1]:].tolist()
        ours_tokens = [o.outputs[0].token_ids for o in outs]
        agree = float(np.mean([a == b for x, y in zip(hf_tokens, ours_tokens) for a, b in zip(x, y)]))
        same_requests = sum(x == y for x, y in zip(hf_tokens, ours_tokens))
        cached = sum(o.num_cached_tokens for o in outs)

    result = {"model": args.model, "dtype": args.dtype, "torch_threads": torch.get_num_threads(),
              "forward": {"tokens": args.tokens, "gdn_jax_s": ours_fwd, "transformers_s": hf_fwd,
                          "speedup": hf_fwd / ours_fwd, "same_next_token": fwd_same,
                          "max_abs_logprob_diff": fwd_diff},
              "end_to_end": {"requests": args.requests, "system": args.system, "suffix": args.suffix,
                             "max_tokens": args.max_tokens, "gdn_jax_s": ours_e2e, "transformers_s": hf_e2e,
                             "speedup": hf_e2e / ours_e2e, "greedy_token_agreement": agree,
                             "identical_requests": same_requests, "cached_tokens": cached}}
    print(f"\n{args.model} ({args.dtype}), transformers on {torch.get_num_threads()} threads, min of {args.repeats}")
    print(f"{'':<34}{'gdn-jax':>10}{'transformers':>14}{'speed-up':>10}")
    print(f"{f'forward, {args.tokens} tokens (s)':<34}{ours_fwd:>10.3f}{hf_fwd:>14.3f}{hf_fwd / ours_fwd:>9.2f}x")
    print(f"{f'{args.requests} requests x {args.max_tokens} tokens (s)':<34}{ours_e2e:>10.3f}{hf_e2e:>14.3f}"
          f"{hf_e2e / ours_e2e:>9.2f}x")
    print(f"forward: top-{MAX_LOGPROBS} logprobs within {fwd_diff:.1e} of transformers'")
    print(f"greedy agreement: forward next token {'same' if fwd_same else 'DIFFERENT'}; end to end "
          f"{agree:.1%} of tokens, {same_requests}/{args.requests} requests identical; engine reused {cached} tokens")
    print(f"wrote {write_json(args.out, 'bench_vs_transformers.json', result)}")
    return result


if __name__ == "__main__":
    run_command(main)
