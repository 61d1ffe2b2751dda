"""What the sampling knobs cost per step: the host build of `SamplingMetadata` and the jitted sampler on the device.

    .venv/bin/python scripts/bench/bench_sampling.py [--vocab 512 248320] [--rows 1 16] [--width 512 4096]
                                                     [--out results/...]

Penalties need each row's prompt + output ids: the host copies them into the padded `history` array (only for rows
that use penalties) and the device counts them with a scatter into [B, V] under a `lax.cond`, so a step without
penalties pays nothing for it. For contrast the table also times building dense [B, V] counts on the host (what the
device scatter replaces) and its transfer. Times are the minimum and median over repeats; the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from gdn_jax.entrypoints.cli import output_file, positive_int
from gdn_jax.sampling import SamplingMetadata, sample
from scheduler import SamplingParams, ScheduledSequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared helpers in common.py
from common import min_median_time, run_command  # noqa: E402


def _rows(B, length, penalties, rng, vocab):
    sp = SamplingParams(temperature=1.0, seed=1,  # no top-k/top-p: no vocabulary sort hides the penalty cost
                        **(dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2) if penalties
                           else {}))
    rows = []
    for b in range(B):
        hist = rng.integers(0, min(vocab, 1000), length).tolist()
        rows.append(ScheduledSequence(b, hist[-1:], length - 1, [], [], None, True, sp, length // 2,
                                      history=list(hist) if penalties else None, num_prompt_tokens=length // 2))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=positive_int, nargs="+", default=[512, 248320], help="vocabulary sizes (default 512 248320)")
    ap.add_argument("--rows", type=positive_int, nargs="+", default=[1, 16], help="batch rows (default 1 16)")
    ap.add_argument("--width", type=positive_int, nargs="+", default=[512, 4096],
                    help="history width = tokens per row, prompt + output (default 512 4096)")
    ap.add_argument("--repeats", type=positive_int, default=10, help="timed repeats per cell (default 10)")
    ap.add_argument("--out", type=output_file, default="results/bench_sampling.json",
                    help="JSON output (default results/...)")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    fn = jax.jit(sample)
    table = []
    print(f"{'V':>7} {'B':>3} {'W':>5} {'pen':>4} | {'host build ms':>14} | {'device step ms':>15} | "
          f"{'dense host counts ms':>20}")
    for V in args.vocab:
        for B in args.rows:
            logits = jax.random.normal(jax.random.PRNGKey(0), (B, V), jnp.float32)
            for W in args.width:
                for penalties in (False, True):
                    rows = _rows(B, W, penalties, rng, V)
                    build = min_median_time(lambda: SamplingMetadata.from_rows(rows, B, W, V, (1,), 0), args.repeats)
                    md = jax.device_put(SamplingMetadata.from_rows(rows, B, W, V, (1,), 0))
                    dev = min_median_time(lambda: jax.block_until_ready(fn(logits, md)), args.repeats)
                    dense = (None, None)
                    if penalties:
                        def dense_counts():
                            counts = np.zeros((B, V), np.float32)
                            for b, r in enumerate(rows):
                                np.add.at(counts[b], np.asarray(r.history, np.int64), 1.0)
                            jax.block_until_ready(jax.device_put(counts))
                        dense = min_median_time(dense_counts, args.repeats)
                    ms = lambda t: {"min": 1e3 * t[0], "median": 1e3 * t[1]}  # noqa: E731
                    rec = dict(vocab=V, rows=B, width=W, penalties=penalties, host_build_ms=ms(build),
                               device_ms=ms(dev), dense_host_counts_ms=ms(dense) if dense[0] is not None else None)
                    table.append(rec)
                    fmt = lambda p: f"{p['min']:6.2f} /{p['median']:6.2f}"  # noqa: E731
                    print(f"{V:>7} {B:>3} {W:>5} {'yes' if penalties else 'no':>4} | {fmt(rec['host_build_ms']):>14} | "
                          f"{fmt(rec['device_ms']):>15} | {fmt(rec['dense_host_counts_ms']) if dense[0] else '':>20}")
    print("(min / median ms; device = the whole jitted sampler at temperature 1: penalties, draw, logprobs)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(backend=jax.default_backend(), results=table), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    run_command(main)
