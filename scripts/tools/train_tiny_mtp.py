"""Trains the shipped `tiny` model's MTP block (the drafter of speculative decoding) on its frozen weights, with
Qwen3-Next's next-next-token loss, and writes the model folder back with it.

    pip install -e '.[train]'
    .venv/bin/python scripts/tools/train_tiny_mtp.py        # reads and rewrites gdn_jax/models/tiny/

The main model's weights are not changed (its held-out bits per byte stay those of its card). The block's decoder
layer starts as a copy of the model's last full-attention layer, its fc and norms fresh. Reports the block's
held-out next-next-token accuracy and how often its greedy draft equals the main model's greedy next token
(teacher-forced on the held-out slice: the k = 1 acceptance it predicts), writes `mtp_training.json` beside the model
and a section of the model card.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

ROOT = Path(__file__).resolve().parents[2]  # the repository
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]  # the checkout's gdn_jax; common.py

from gdn_jax.entrypoints.cli import nonnegative_int, positive_int  # noqa: E402
from gdn_jax.model.qwen35 import Qwen35Model  # noqa: E402
from gdn_jax.model.weights import load_hf_weights, save_hf_weights  # noqa: E402
from gdn_jax.train import (LN2, MtpForward, TrainConfig, bits_per_byte, forward_for, load_corpus,  # noqa: E402
                           make_mtp_train_step, make_optimizer, mtp_heldout, sample_batch, split_mtp)
from common import run_command  # noqa: E402


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="train_tiny_mtp.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "gdn_jax" / "models" / "tiny"),
                    help="model folder to read and rewrite (default: %(default)s)")
    ap.add_argument("--steps", type=positive_int, default=600, help="optimiser steps (default: %(default)s)")
    ap.add_argument("--batch", type=positive_int, default=8, help="sequences per step (default: %(default)s)")
    ap.add_argument("--seq-len", type=positive_int, default=256, help="bytes per sequence (default: %(default)s)")
    ap.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (AdamW) (default: %(default)s)")
    ap.add_argument("--warmup", type=nonnegative_int, default=50, help="warm-up steps (default: %(default)s)")
    ap.add_argument("--seed", type=nonnegative_int, default=1, help="initialisation and data-order seed "
                    "(default: %(default)s)")
    ap.add_argument("--log-every", type=positive_int, default=25, help="steps between log lines (default: %(default)s)")
    ap.add_argument("--eval-rows", type=positive_int, default=32, help="held-out windows evaluated (default: "
                    "%(default)s)")
    return ap.parse_args(argv)


def with_mtp(folder: Path, seed: int):
    """(config with one MTP layer, params): the folder's weights, and a block whose decoder layer copies the last
    full-attention layer's."""
    cfg, _, params = load_hf_weights(folder)
    cfg = dataclasses.replace(cfg, mtp_num_hidden_layers=1)
    fresh = nnx.split(Qwen35Model(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed), std=0.02))[1]
    flat, loaded = dict(nnx.to_flat_state(fresh)), dict(nnx.to_flat_state(params))
    last = max(cfg.full_layer_ids)
    for path, var in flat.items():
        if path[0] != "mtp":
            flat[path] = var.replace(loaded[path].get_value())
        elif path[:3] == ("mtp", "layers", 0):
            flat[path] = var.replace(loaded[("layers", last, *path[3:])].get_value())
    return cfg, nnx.from_flat_state(flat)


def main(argv=None) -> dict:
    a = parse(argv)
    folder = Path(a.model)
    corpus = load_corpus()
    cfg, params = with_mtp(folder, a.seed)
    before = mtp_heldout(cfg, params, corpus.heldout, a.eval_rows)
    print(f"before: {before}")
    tc = TrainConfig(steps=a.steps, batch=a.batch, seq_len=a.seq_len + 1, lr=a.lr, warmup=a.warmup, seed=a.seed)
    tx = make_optimizer(tc)[0]
    fwd = MtpForward(cfg, jnp.bfloat16)
    mtp, rest = split_mtp(params)
    step, opt_state = make_mtp_train_step(fwd, tx), tx.init(mtp)
    t0, history = time.time(), []
    for i in range(a.steps):
        tokens = jnp.asarray(sample_batch(corpus.train, i, a.batch, a.seq_len + 1, a.seed))
        mtp, opt_state, loss = step(mtp, opt_state, rest, tokens)
        if (i + 1) % a.log_every == 0 or i + 1 == a.steps:
            history.append({"step": i + 1, "loss": float(loss), "time": time.time() - t0})
            print(f"step {i + 1}: next-next loss {float(loss) / LN2:.3f} bits/byte ({time.time() - t0:.0f} s)")
    params = nnx.from_flat_state({**dict(nnx.to_flat_state(rest)), **dict(nnx.to_flat_state(mtp))})
    after = mtp_heldout(cfg, params, corpus.heldout, a.eval_rows)
    print(f"after: {after}")
    main_bpb = bits_per_byte(forward_for(cfg, "float32"), params, corpus.heldout, 256)  # (as the card's)
    save_hf_weights(folder, cfg, params)
    where = folder.resolve()
    shown = str(where.relative_to(ROOT)) if where.is_relative_to(ROOT) else str(folder)  # (no machine's path)
    result = {"settings": {**vars(a), "model": shown}, "before": before, "after": after,
              "main_heldout_bits_per_byte": main_bpb,
              "wall_s": time.time() - t0, "history": history, "jax": jax.__version__}
    (folder / "mtp_training.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {folder} (main model held-out {main_bpb:.3f} bits/byte, unchanged weights)")
    return result


if __name__ == "__main__":
    run_command(main)
