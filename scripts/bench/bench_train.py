"""Training throughput of the shipped `tiny` config: one optimiser step (forward + backward + AdamW) in float32 vs
bfloat16 compute (float32 master weights either way), at the batch shape of its training run.

    .venv/bin/python scripts/bench/bench_train.py [--repeats 10] [--batch B --seq-len T]

Prints a table and writes results/bench_train.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[2]  # the repository
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]  # the checkout's gdn_jax; common.py

from gdn_jax.entrypoints.cli import output_file, positive_int  # noqa: E402
from gdn_jax.config import ModelConfig  # noqa: E402
from gdn_jax.train import (Forward, TrainConfig, init_params, load_corpus, make_optimizer,  # noqa: E402
                           make_train_step, param_count, sample_batch)
from gdn_jax.model.weights import MODELS_DIR  # noqa: E402
from common import run_command  # noqa: E402


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="bench_train.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=positive_int, default=10, help="timed steps per dtype (default: %(default)s)")
    ap.add_argument("--batch", type=positive_int, default=None,
                    help="sequences per step (default: the training run's)")
    ap.add_argument("--seq-len", type=positive_int, default=None,
                    help="tokens per sequence (default: the training run's)")
    ap.add_argument("--out", type=output_file, default=str(ROOT / "results" / "bench_train.json"),
                    help="JSON output (default: %(default)s)")
    args = ap.parse_args(argv)
    folder = MODELS_DIR / "tiny"
    cfg = ModelConfig.from_pretrained(folder)
    hp = json.loads((folder / "training.json").read_text())["args"]
    B, T = args.batch or hp["batch"], args.seq_len or hp["seq_len"]
    tc = TrainConfig(steps=1000, batch=B, seq_len=T, lr=hp["lr"], warmup=hp["warmup"])
    stream = load_corpus(hp["heldout_bytes"]).train
    rows = []
    for name, dtype in (("float32", jnp.float32), ("bfloat16", jnp.bfloat16)):
        tx, _ = make_optimizer(tc)
        params = init_params(cfg)
        opt_state = tx.init(params)
        first = sample_batch(stream, 0, B, T)
        t = time.perf_counter()  # compilation alone (lowering included), then the first step apart from it
        step = make_train_step(Forward(cfg, dtype), tx).lower(params, opt_state, first).compile()
        compile_s = time.perf_counter() - t
        t = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, first)
        jax.block_until_ready(loss)
        first_step_s = time.perf_counter() - t
        times = []
        for i in range(args.repeats):
            batch = sample_batch(stream, i + 1, B, T)
            t = time.perf_counter()
            params, opt_state, loss = step(params, opt_state, batch)
            jax.block_until_ready(loss)
            times.append(time.perf_counter() - t)
        times = np.sort(times)
        rows.append({"compute_dtype": name, "batch": B, "seq_len": T, "params": param_count(params),
                     "compile_s": compile_s, "first_step_s": first_step_s, "step_s_min": float(times[0]), "step_s_median": float(np.median(times)),
                     "tokens_per_s_best": B * T / float(times[0]),
                     "tokens_per_s_median": B * T / float(np.median(times)),
                     "repeats": args.repeats, "load_average_1m": os.getloadavg()[0]})
    print(f"tiny ({rows[0]['params']:,} params), batch {B} x {T} tokens, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'compute':<10}{'compile s':>10}{'1st step s':>11}{'step ms min':>13}{'median':>9}{'tok/s best':>12}{'median':>9}")
    for r in rows:
        print(f"{r['compute_dtype']:<10}{r['compile_s']:>10.1f}{r['first_step_s']:>11.2f}{1e3 * r['step_s_min']:>13.0f}"
              f"{1e3 * r['step_s_median']:>9.0f}{r['tokens_per_s_best']:>12.0f}{r['tokens_per_s_median']:>9.0f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    run_command(main)
