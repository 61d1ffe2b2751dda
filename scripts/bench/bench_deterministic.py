"""What the deterministic mode costs: a long prefill and decode steps, default forms against `deterministic=True`, in
one sitting, through `LLMEngine.step`.

    .venv/bin/python scripts/bench/bench_deterministic.py [--preset hybrid-1024] [--dtypes float32,bfloat16]
                                                          [--prefill 2048] [--rows 1,16] [--repeats 3] [--steps 12]
                                                          [--out results/bench_deterministic.json]

Per dtype and mode one engine (prefix caching off, a token budget of `--prefill`, so the prompt is one step):
- `prefill`: time to the first token of a `--prefill`-token prompt (one step and its sampling), min and median of
  `--repeats` after one that compiles (its time is `first_ms` in the JSON);
- `decode R`: `R` requests of 32-token prompts decode together; after two untimed decode steps, `--steps` steps of R
  decode rows are timed (min and median of `engine.step()`).
`x default` is the deterministic median over the default one, measured back to back.

Prints a table and writes JSON (default results/bench_deterministic.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from gdn_jax import SamplingParams
from gdn_jax.engine import LLMEngine
from gdn_jax.entrypoints.cli import output_file, positive_int, positive_ints

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared helpers in common.py
from common import dtype_names, environment  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def _prefill(engine, vocab: int, tokens: int, repeats: int, rng) -> tuple[float, list[float]]:
    """(the compiling call's ms, the timed calls' ms): a fresh random prompt each time, to its first token."""
    times = []
    for i in range(repeats + 1):
        engine.add_request(f"p{i}", rng.integers(4, vocab, tokens).tolist(), GREEDY)
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    return times[0], times[1:]


def _decode(engine, vocab: int, rows: int, steps: int, rng) -> list[float]:
    """The ms of `steps` engine steps of `rows` decode rows, after the prompts' prefill and two decode steps."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(rows):
        engine.add_request(f"d{rows}.{i}", rng.integers(4, vocab, 32).tolist(), params)
    warm, times = 0, []
    while engine.has_unfinished_requests() and len(times) < steps:
        start = time.perf_counter()
        engine.step()
        ms = (time.perf_counter() - start) * 1e3
        info = engine.last_step_info
        if info["is_prefill"] or info["decode_rows"] != rows:
            continue
        warm += 1
        if warm > 2:
            times.append(ms)
    for i in range(rows):
        engine.abort_request(f"d{rows}.{i}")
    if len(times) < steps:
        raise SystemExit(f"only {len(times)} decode steps of {rows} rows ran; raise --steps' margin")
    return times


def main(argv=None):
    ap = argparse.ArgumentParser(prog="bench_deterministic.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="hybrid-1024", help="model preset (random weights) or HF folder")
    ap.add_argument("--dtypes", type=dtype_names, default=["float32", "bfloat16"], help="comma-separated dtypes")
    ap.add_argument("--prefill", type=positive_int, default=2048, help="prompt tokens of the prefill")
    ap.add_argument("--rows", type=positive_ints, default=[1, 16], help="decode batch sizes")
    ap.add_argument("--repeats", type=positive_int, default=3, help="timed prefills per mode, after a compiling one")
    ap.add_argument("--steps", type=positive_int, default=12, help="timed decode steps per batch size and mode")
    ap.add_argument("--out", type=output_file, default="results/bench_deterministic.json", help="JSON written")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    results = []
    print(f"{'dtype':9} {'measure':10} {'default ms':>18} {'deterministic ms':>18} {'x default':>9}")
    for dtype in args.dtypes:
        engines = {mode: LLMEngine(args.preset, dtype=dtype, deterministic=mode == "deterministic",
                                   enable_prefix_caching=False, max_num_seqs=max(args.rows),
                                   max_num_batched_tokens=args.prefill, max_model_len=args.prefill + 64,
                                   verbose=False)
                   for mode in ("default", "deterministic")}
        vocab = engines["default"].cfg.vocab_size
        measures = [("prefill", lambda e: _prefill(e, vocab, args.prefill, args.repeats, rng))]
        measures += [(f"decode {r}", lambda e, r=r: (None, _decode(e, vocab, r, args.steps, rng))) for r in args.rows]
        for name, run in measures:
            row = {"dtype": dtype, "measure": name}
            for mode, engine in engines.items():
                first, times = run(engine)
                row[mode] = {"min_ms": min(times), "median_ms": statistics.median(times), "first_ms": first,
                             "times_ms": times}
            row["ratio"] = row["deterministic"]["median_ms"] / row["default"]["median_ms"]
            results.append(row)
            cells = [f"{row[m]['min_ms']:7.1f} / {row[m]['median_ms']:7.1f}" for m in ("default", "deterministic")]
            print(f"{dtype:9} {name:10} {cells[0]:>18} {cells[1]:>18} {row['ratio']:9.2f}")
    out = {"args": vars(args), "environment": environment(), "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
