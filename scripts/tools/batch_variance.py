"""Where a request's logprobs move between alone, batched and a prefix-cache hit, part by part.

    .venv/bin/python scripts/tools/batch_variance.py [--preset hybrid-1024] [--dtype bfloat16] [--prompt 1024]
                                                     [--hit 768] [--others 8] [--chunk-stride 128]
                                                     [--variants default,deterministic,...]
                                                     [--out results/batch_variance.json]

One request (`--prompt` random tokens, 16 greedy tokens, top-5 logprobs) runs alone, then inside
a batch of `--others` other requests (not reading the prefix cache), then with its first `--hit` tokens from the
prefix cache (a first request shares exactly those). Variants:
- `default`: the engine's forms;
- `deterministic`: `deterministic=True` (every part batch-invariant: no difference expected);
- `rows`, `attention`, `gdn`, `loops`: the deterministic forward in the engine's forms (`tuning.resolve_forms`:
  its products' forms, its CPU kernels) with one part put back in its default form, so that the differences left
  are that part's:
  - `rows`: norms, projections, the MLP, the LM head and the log-softmax over the step's rows at once (the product
    forms follow the row count: one row, the weight on the left, the float32 upcast), not in tiles of 16 rows;
  - `attention`: the default attention (`Attention.attend_heads`: query tiles from the step's first token, key
    chunks counted over the batch, rows grouped, the CPU decode kernel);
  - `gdn`: the default GDN (`GatedDeltaNet.mix`: the CPU prefill kernel or the chunked rule over a prefill's tokens
    from its start, the decode token step over all rows at once);
  - `loops`: tiles and token loops without their spare entry, where XLA hoists the parts an axis of one entry makes
    loop-invariant out of the loop and fuses them there.
Per variant and comparison: the largest |logprob difference| over the decode steps whose context is still common
(the tokens before them equal) and the top-5 ids in common, and the first greedy token that differs (None: all
equal).

Prints a table and writes JSON (default results/batch_variance.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
from pathlib import Path

import jax
import numpy as np

from gdn_jax import SamplingParams, sampling
from gdn_jax.engine import LLMEngine
from gdn_jax.entrypoints.cli import output_file, positive_int
from gdn_jax.model import deterministic
from gdn_jax.model.attention import Attention
from gdn_jax.backends.cpu import tuning
from gdn_jax.worker import step as worker_step

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared helpers in common.py
from common import environment  # noqa: E402

VARIANTS = ("default", "deterministic", "rows", "attention", "gdn", "loops")
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, logprobs=5, ignore_eos=True)


def _forms(dtype):
    return tuning.resolve_forms(dtype)


def _rows_at_once(fn, lead, *arrays):
    """`deterministic.rowwise` without tiles: fn on all the rows in one call."""
    R = int(np.prod(lead))
    ys = fn(*(a.reshape(R, *a.shape[len(lead):]) for a in arrays))
    return jax.tree.map(lambda y: y.reshape(*lead, *y.shape[1:]), ys)


def _default_attention(cfg, q, k_cache, v_cache, layer, positions, block_tables):
    extent = positions[:, -1] + 1
    return Attention.attend_heads(types.SimpleNamespace(cfg=cfg), q, k_cache, v_cache, layer, positions,
                                  block_tables, extent, _forms(q.dtype))


def _default_gdn(gdn, mixed, z, b, a, conv_in, ssm_in, lengths, saves=None):
    out = gdn.mix(mixed, z, b, a, conv_in, ssm_in, lengths, saves=saves, forms=_forms(mixed.dtype))
    return (*out, None) if saves is None else out


PATCHES = {
    "rows": [(deterministic, "rowwise", _rows_at_once), (sampling, "rowwise", _rows_at_once),
             (worker_step, "rowwise", _rows_at_once)],
    "attention": [(deterministic, "attend", _default_attention)],
    "gdn": [(deterministic, "gdn_mixer", _default_gdn)],
    "loops": [(deterministic, "_spare", lambda a, axis=0: a)],
}


def _run(engine, requests):
    """Adds the (id, prompt, params) requests and steps until they are done: id -> final output."""
    for request in requests:
        engine.add_request(*request)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    return finals


def _compare(a, b) -> dict:
    """Largest |logprob difference| while the contexts agree, and the first differing token."""
    ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
    worst, first = 0.0, None
    for i, (da, db) in enumerate(zip(a.outputs[0].logprobs, b.outputs[0].logprobs)):
        common = set(da) & set(db)
        worst = max([worst] + [abs(da[t].logprob - db[t].logprob) for t in common])
        if ta[i] != tb[i]:
            first = i
            break
    return {"max_abs_logprob": worst, "first_token_differs": first}


def measure(variant: str, args, rng_seed: int = 0) -> dict:
    rng = np.random.default_rng(rng_seed)
    patches = list(PATCHES.get(variant, ()))
    if patches:  # the deterministic forward, in the engine's forms
        forms, forward = tuning.resolve_forms(getattr(jax.numpy, args.dtype)), deterministic.forward
        patches.append((deterministic, "forward", lambda model, batch, state, all_logits, _: forward(
            model, batch, state, all_logits, forms)))
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in patches]
    for mod, name, fn in patches:
        setattr(mod, name, fn)
    for cached in (worker_step.step_function, worker_step.prompt_step_function, worker_step.sample_function):
        cached.cache_clear()  # the steps traced afresh, with the patches
    try:
        engine = LLMEngine(args.preset, dtype=args.dtype, deterministic=variant != "default",
                           chunk_stride=args.chunk_stride,
                           enable_prefix_caching=True, max_num_seqs=args.others + 1, max_model_len=args.prompt + 64,
                           verbose=False)
        vocab = engine.cfg.vocab_size
        prompt = rng.integers(4, vocab, args.prompt).tolist()
        alone = _run(engine, [("alone", prompt, PARAMS)])["alone"]
        others = [(f"o{i}", rng.integers(4, vocab, int(n)).tolist(), SamplingParams(temperature=0.0, max_tokens=16))
                  for i, n in enumerate(rng.integers(16, args.prompt, args.others))]
        fresh = dataclasses.replace(PARAMS, skip_reading_prefix_cache=True)
        batched = _run(engine, others[:args.others // 2] + [("batched", prompt, fresh)]
                       + others[args.others // 2:])["batched"]
        engine.reset_prefix_cache()
        _run(engine, [("warm", prompt[:args.hit] + [3] * 8, SamplingParams(temperature=0.0, max_tokens=1))])
        hit = _run(engine, [("hit", prompt, PARAMS)])["hit"]
        return {"batched": _compare(alone, batched), "hit": _compare(alone, hit), "cached": hit.num_cached_tokens}
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="batch_variance.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="hybrid-1024", help="model preset (random weights) or HF folder")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="weights and activations")
    ap.add_argument("--prompt", type=positive_int, default=1024, help="tokens of the request's prompt")
    ap.add_argument("--hit", type=positive_int, default=768, help="prompt tokens the hit shares (a checkpoint)")
    ap.add_argument("--others", type=positive_int, default=8, help="other requests in the batch")
    ap.add_argument("--chunk-stride", type=positive_int, default=128, help="tokens between checkpoints")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--out", type=output_file, default="results/batch_variance.json", help="JSON written")
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {VARIANTS}")
    results = {}
    print(f"{args.preset} {args.dtype}, {args.prompt}-token prompt, {args.others} others, hit at {args.hit}")
    print(f"{'variant':14} {'batched: max |d|':>17} {'1st token':>9} {'hit: max |d|':>13} {'1st token':>9} cached")
    for variant in variants:
        r = results[variant] = measure(variant, args)
        b, h = r["batched"], r["hit"]
        print(f"{variant:14} {b['max_abs_logprob']:17.2e} {str(b['first_token_differs']):>9} "
              f"{h['max_abs_logprob']:13.2e} {str(h['first_token_differs']):>9} {r['cached']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "environment": environment(), "results": results},
                                         indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
