"""The host's Python work per decode step, with the device left out: `LLMEngine.step` with the worker's jitted forward
and sampling replaced by stubs that return at once (fixed-shape placeholders), so the time is the scheduler, the
worker's argument building, the sampled tokens' postprocessing and the outputs, and nothing the device does.

    .venv/bin/python scripts/bench/bench_host.py [--preset hybrid-1024] [--batches 1,16] [--prompt 512] [--steps 600]
                                                 [--tokenizer tokenizer.json [--whole-decode]]
                                                 [--out results/bench_host.json]

Per batch size: `--batches` requests of `--prompt` random tokens are prefilled (through the stubs), then `--steps`
greedy decode steps are timed. Per-step work that grows with the output length shows as a difference between the
first and the last tenth of the steps. The stubbed sampler draws random tokens (never EOS, `ignore_eos`), so the
outputs' text changes every step: byte ids of the preset's byte tokenizer, or with `--tokenizer` any id of that
`tokenizer.json` (a model folder's), which then detokenises the outputs; `--whole-decode` makes it decode each output
whole on every step, as every HF tokenizer did before the byte-level stream (`gdn_jax.tokenizer.HFTokenizer.stream`).
`bench_decode.py`'s `host` column is this plus the dispatch of the two executables and the copy of the result. Prints
a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from gdn_jax import LLMEngine, SamplingParams
from gdn_jax.entrypoints.cli import output_file, positive_int, positive_ints
from gdn_jax.tokenizer import HFTokenizer, TextStream
from scheduler.sampling_params import MAX_LOGPROBS

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared helpers in common.py
from common import Stub, run_command  # noqa: E402


def stub_device(engine: LLMEngine, rng: np.random.Generator, token_ids: tuple[int, int] = (4, 260)) -> None:
    """Replaces the worker's step and sampling executables with host stubs of the same output structure; the
    sampled ids are drawn from `token_ids` (low, high; by default the byte tokenizer's byte ids)."""
    w = engine.worker
    vocab = engine.cfg.vocab_size
    low, high = token_ids[0], min(vocab, token_ids[1])

    def step(leaves, state, batch, *extra):
        return state, np.zeros((batch.tokens.shape[0], 1), np.float32)

    def sample(logits, md):
        out = np.zeros((logits.shape[0], 3 + 2 * min(MAX_LOGPROBS, vocab)), np.int32)
        out[:, 0] = rng.integers(low, high, logits.shape[0])
        return out

    jitted = w.step_functions()
    w.replace_functions(**{kind: Stub(jitted[kind], step) for kind in ("prefill", "decode", "decode_wide")},
                        sample=Stub(jitted["sample"], sample))


def run(args, batch: int) -> dict:
    engine = LLMEngine(args.preset, max_num_seqs=max(batch, 2), chunk_stride=args.chunk_stride,
                       max_model_len=args.prompt + args.steps + 8 + batch, verbose=False)
    rng = np.random.default_rng(0)
    sampled = {}  # the ids the stub samples: by default the byte tokenizer's byte ids
    if args.tokenizer:
        engine.tokenizer = HFTokenizer(Path(args.tokenizer), None)
        if args.whole_decode:
            engine.tokenizer.stream = lambda: TextStream(engine.tokenizer.decode)
        sampled["token_ids"] = (0, engine.tokenizer.vocab_size)
    stub_device(engine, rng, **sampled)
    for i in range(batch):
        engine.add_request(str(i), rng.integers(4, engine.cfg.vocab_size, args.prompt).tolist(),
                           SamplingParams(temperature=0.0, max_tokens=args.steps + 4 + batch, ignore_eos=True))
    while True:
        engine.step()
        if not engine.last_step_info["is_prefill"]:
            break
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        info = engine.last_step_info
        assert info["rows"] == batch and not info["is_prefill"], info
    tenth = max(1, len(times) // 10)
    ms = [1e3 * t for t in times]
    return {"batch": batch, "steps": len(ms), "host_ms_min": min(ms), "host_ms_median": statistics.median(ms),
            "first_tenth_ms_median": statistics.median(ms[:tenth]),
            "last_tenth_ms_median": statistics.median(ms[-tenth:])}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="hybrid-1024", help="model preset (default: %(default)s)")
    ap.add_argument("--prompt", type=positive_int, default=512, help="prompt tokens per request (default: %(default)s)")
    ap.add_argument("--batches", type=positive_ints, default="1,16", help="decode batch sizes, comma-separated (default: %(default)s)")
    ap.add_argument("--steps", type=positive_int, default=600, help="timed decode steps (default: %(default)s)")
    ap.add_argument("--chunk-stride", type=positive_int, default=256, help="tokens between checkpoints (default: %(default)s)")
    ap.add_argument("--tokenizer", help="a tokenizer.json to detokenise the outputs with (default: the preset's bytes)")
    ap.add_argument("--whole-decode", action="store_true",
                    help="with --tokenizer: decode each output whole on every step (the generic stream)")
    ap.add_argument("--out", type=output_file, default="results/bench_host.json",
                    help="JSON output (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.whole_decode and not args.tokenizer:
        ap.error("--whole-decode applies to an HF tokenizer: give --tokenizer")
    if args.tokenizer and not Path(args.tokenizer).is_file():
        ap.error(f"--tokenizer {args.tokenizer}: no such file")
    rows = [run(args, b) for b in args.batches]
    tokenizer = f", {args.tokenizer}{' decoded whole' if args.whole_decode else ''}" if args.tokenizer else ""
    print(f"{args.preset}, {args.prompt}-token prompts, {args.steps} decode steps, device calls stubbed{tokenizer}")
    print(f"{'batch':>5} {'min ms':>7} {'median':>7} {'first 10%':>10} {'last 10%':>9}")
    for r in rows:
        print(f"{r['batch']:5d} {r['host_ms_min']:7.3f} {r['host_ms_median']:7.3f} {r['first_tenth_ms_median']:10.3f} "
              f"{r['last_tenth_ms_median']:9.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"preset": args.preset, "prompt": args.prompt, "tokenizer": args.tokenizer,
                               "whole_decode": args.whole_decode, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    run_command(main)
