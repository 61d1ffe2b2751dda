"""Trains the shipped `tiny` model: a small Qwen3.5-layout hybrid (3 Gated DeltaNet : 1 full attention) on the language
and library reference that ships with Python (`pydoc_data/topics.py`), byte-level, on the CPU.

    pip install -e '.[train]'
    .venv/bin/python scripts/tools/train_tiny.py            # writes gdn_jax/models/tiny/
    .venv/bin/python scripts/tools/train_tiny.py --resume   # continues from the latest checkpoint in --ckpt-dir

A checkpoint folder belongs to the run that wrote it: a run without --resume refuses a --ckpt-dir that holds
checkpoints, and --resume refuses settings other than those the checkpoint records (only --log-every, --eval-every
and --ckpt-every may change).

Writes the loss curve (JSON + PNG) under --log-dir, orbax checkpoints every --ckpt-every steps under --ckpt-dir, and the
model folder --out: HF `config.json` + `model.safetensors`, the held-out slice `validation.txt`, the curve and a model
card `README.md` with the figures of the run (tokens/s, validation bits per byte, parameter count, wall time).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parents[2]  # the repository
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]  # the checkout's gdn_jax; common.py

from gdn_jax.entrypoints.cli import nonnegative_int, positive_int  # noqa: E402
from gdn_jax.config import ModelConfig, hybrid_layer_types  # noqa: E402
from gdn_jax.tokenizer import ByteTokenizer  # noqa: E402
from gdn_jax.train import (LN2, TrainConfig, bits_per_byte, forward_for, load_corpus, param_count,  # noqa: E402
                           steady_tokens_per_s, train)
from gdn_jax.model.weights import save_hf_weights  # noqa: E402
from common import run_command  # noqa: E402

HELDOUT_AT = 0.9  # where the held-out slice starts, as a fraction of the corpus text
PROMPT = "The \"for\" statement is used to"


def model_config(a) -> ModelConfig:
    return ModelConfig(
        name="tiny", vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
        layer_types=hybrid_layer_types(a.layers), num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
        head_dim=a.head_dim, linear_num_key_heads=a.linear_key_heads, linear_num_value_heads=a.linear_value_heads,
        linear_key_head_dim=a.linear_head_dim, linear_value_head_dim=a.linear_head_dim,
        max_position_embeddings=a.max_positions, eos_token_id=1, tie_word_embeddings=False)


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="train_tiny.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "gdn_jax" / "models" / "tiny"), help="model folder to write (default: %(default)s)")
    ap.add_argument("--log-dir", default=str(ROOT / "results" / "train_tiny"), help="loss curve, log and checkpoints (default: %(default)s)")
    ap.add_argument("--ckpt-dir", default=None, help="orbax checkpoints (default: LOG_DIR/ckpt)")
    ap.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt-dir, "
                    "with the settings it records")
    ap.add_argument("--stop-after", type=positive_int, default=None, help="stop after this many steps of this run (the "
                    "schedule still spans --steps); for interrupting and resuming")
    ap.add_argument("--no-sample", action="store_true", help="skip the engine generation at the end")
    ap.add_argument("--host-note", default="", help="a remark on the machine for the model card (e.g. shared)")
    g = ap.add_argument_group("optimisation")
    g.add_argument("--steps", type=positive_int, default=TrainConfig.steps, help="optimiser steps (default: %(default)s)")
    g.add_argument("--batch", type=positive_int, default=TrainConfig.batch, help="sequences per step (default: %(default)s)")
    g.add_argument("--seq-len", type=positive_int, default=TrainConfig.seq_len, help="bytes per training sequence (default: %(default)s)")
    g.add_argument("--lr", type=float, default=TrainConfig.lr, help="peak learning rate (AdamW) (default: %(default)s)")
    g.add_argument("--warmup", type=nonnegative_int, default=TrainConfig.warmup, help="linear warm-up steps (default: %(default)s)")
    g.add_argument("--weight-decay", type=float, default=TrainConfig.weight_decay, help="AdamW weight decay (default: %(default)s)")
    g.add_argument("--seed", type=nonnegative_int, default=TrainConfig.seed, help="initialisation and data-order seed (default: %(default)s)")
    g.add_argument("--dtype", default=TrainConfig.compute_dtype, choices=["bfloat16", "float32"], help="compute dtype (default: %(default)s)")
    g.add_argument("--eval-every", type=positive_int, default=TrainConfig.eval_every, help="steps between held-out evaluations (default: %(default)s)")
    g.add_argument("--eval-window", type=positive_int, default=TrainConfig.eval_window, help="bytes per held-out evaluation window (default: %(default)s)")
    g.add_argument("--ckpt-every", type=positive_int, default=TrainConfig.ckpt_every, help="steps between orbax checkpoints (default: %(default)s)")
    g.add_argument("--log-every", type=positive_int, default=TrainConfig.log_every, help="steps between log lines (default: %(default)s)")
    g.add_argument("--heldout-bytes", type=positive_int, default=32768, help="bytes of the held-out slice (default: %(default)s)")
    m = ap.add_argument_group("model")
    m.add_argument("--vocab", type=positive_int, default=288, help="vocabulary size (256 bytes + specials) (default: %(default)s)")
    m.add_argument("--hidden", type=positive_int, default=192, help="hidden size (default: %(default)s)")
    m.add_argument("--intermediate", type=positive_int, default=576, help="MLP size (default: %(default)s)")
    m.add_argument("--layers", type=positive_int, default=8, help="decoder layers (every 4th is full attention) (default: %(default)s)")
    m.add_argument("--heads", type=positive_int, default=4, help="attention query heads (default: %(default)s)")
    m.add_argument("--kv-heads", type=positive_int, default=2, help="attention key/value heads (default: %(default)s)")
    m.add_argument("--head-dim", type=positive_int, default=48, help="attention head size (default: %(default)s)")
    m.add_argument("--linear-key-heads", type=positive_int, default=2, help="GDN key heads (default: %(default)s)")
    m.add_argument("--linear-value-heads", type=positive_int, default=4, help="GDN value heads (default: %(default)s)")
    m.add_argument("--linear-head-dim", type=positive_int, default=48, help="GDN head size (default: %(default)s)")
    m.add_argument("--max-positions", type=positive_int, default=4096, help="max_position_embeddings written to the config (default: %(default)s)")
    a = ap.parse_args(argv)
    if a.vocab < 256 + ByteTokenizer.OFFSET:
        ap.error(f"--vocab {a.vocab}: a byte-level model needs at least {256 + ByteTokenizer.OFFSET} ids (256 bytes "
                 f"+ specials)")
    if not a.no_sample and a.max_positions <= len(ByteTokenizer(a.vocab).encode(PROMPT)):
        ap.error(f"--max-positions {a.max_positions} leaves no room to continue the sample prompt "
                 f"({len(PROMPT.encode())} bytes): raise it or pass --no-sample")
    return a


def plot_curve(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    ax.plot([r["step"] for r in history], [r["loss"] / LN2 for r in history], label="train (bits/byte)", lw=1)
    val = [r for r in history if "val_bpb" in r]
    ax.plot([r["step"] for r in val], [r["val_bpb"] for r in val], "o-", label="held-out (bits/byte)")
    ax.set_xlabel("step")
    ax.set_ylabel("bits per byte")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def sample(folder: Path, prompt: str, max_tokens: int = 160) -> str:
    """Greedy continuation of `prompt` by the engine, within the model's max_position_embeddings."""
    from gdn_jax import LLM, SamplingParams

    max_pos = json.loads((Path(folder) / "config.json").read_text())["max_position_embeddings"]
    llm = LLM(str(folder), max_model_len=min(512, max_pos), max_num_seqs=1, chunk_stride=64, verbose=False)
    room = min(512, max_pos) - len(llm.get_tokenizer().encode(prompt))
    return llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=min(max_tokens, room)),
                        use_tqdm=False)[0].outputs[0].text


CARD = """# tiny: a {params_m:.2f}M-parameter Qwen3.5-layout hybrid trained on the Python reference

A byte-level model with the Qwen3.5 hybrid layout ({n_lin} Gated DeltaNet + {n_full} gated full-attention layers, 3:1),
trained from scratch on the CPU by `scripts/tools/train_tiny.py`. It is the engine's default model (`LLM("tiny")`):
small enough to ship inside the package, trained enough to continue Python-documentation prompts with English-like text.
It knows nothing but the Python reference and is not a useful assistant.

| | |
|---|---|
| corpus | `pydoc_data/topics.py` of Python {pyver} ({num_docs} topics, {corpus_bytes} bytes, sha256 `{corpus_sha}`), documents joined with EOS |
| held-out slice | `validation.txt`: {heldout_bytes} bytes cut at {heldout_at:.0%} of the text (line-aligned), never trained on |
| tokenizer | bytes: id = byte + 4 (0 pad, 1 EOS, 2 BOS); vocabulary {vocab} |
| layout | hidden {hidden}, {layers} layers `{layout}`, MLP {intermediate}; attention {heads} heads x {head_dim} ({kv_heads} KV heads, RoPE on {rotary} dims); GDN {lk} key / {lv} value heads x {lhd} |
| parameters | {params} ({file_mb:.1f} MB float32 safetensors) |
| training | {steps} steps x {batch} x {seq_len} tokens ({tokens_m:.2f}M tokens, {epochs:.1f} passes), AdamW lr {lr:g} (warm-up {warmup}, cosine to 10%), weight decay {wd:g}, {dtype} compute with float32 master weights |
| wall time | {wall_min:.1f} min on {machine}; {tps:.0f} tokens/s (median of the logged intervals) |
| **validation bits/byte** | **float32 {bpb32:.4f}**, bfloat16 {bpb16:.4f} (windows of {window} bytes from a zero state; uniform is 8) |
| positions | trained on {seq_len}-byte windows; `max_position_embeddings` {max_pos} relies on RoPE extrapolation (only {rotary} of {head_dim} attention dims rotate) and on the GDN state, which has no positions |

Training command:

```bash
{command}
```

Greedy continuation (`LLM("tiny")`, float32) of `{prompt_repr}`:

```text
{sample}
```

Greedy decoding sometimes settles into a run of spaces or dashes (the corpus's indentation and section underlines).

![loss curve](loss_curve.png)

The corpus is the Python documentation (PSF license); the weights are a derived work of it.
"""


RUN_ONLY = ("out", "log_dir", "ckpt_dir", "resume", "stop_after", "no_sample", "host_note")  # not hyperparameters


def _shown_args(argv: list[str]) -> list[str]:
    """The command line minus the options that do not change the model (--resume, --stop-after, --host-note): the
    card's training command, which run as shown trains the whole run (a run interrupted with --stop-after and resumed
    ends with a --stop-after on its command line)."""
    shown, skip = [], False
    for x in map(str, argv):
        if skip or x == "--resume" or x.startswith(("--host-note=", "--stop-after=")):
            skip = False
        elif x in ("--host-note", "--stop-after"):
            skip = True
        else:
            shown.append(x)
    return shown


def main(argv=None) -> dict:
    a = parse(argv)
    cfg = model_config(a)
    tc = TrainConfig(steps=a.steps, batch=a.batch, seq_len=a.seq_len, lr=a.lr, warmup=a.warmup,
                     weight_decay=a.weight_decay, seed=a.seed, compute_dtype=a.dtype, eval_every=a.eval_every,
                     eval_window=a.eval_window, ckpt_every=a.ckpt_every, log_every=a.log_every)
    log_dir, out = Path(a.log_dir), Path(a.out)
    log_dir.mkdir(parents=True, exist_ok=True)
    corpus = load_corpus(a.heldout_bytes, HELDOUT_AT)
    print(f"corpus: {corpus.num_docs} documents, {corpus.num_bytes} bytes; train stream {len(corpus.train)} tokens, "
          f"held-out {len(corpus.heldout)} bytes | {jax.device_count()} {jax.default_backend()} device(s)")
    res = train(cfg, tc, corpus, ckpt_dir=a.ckpt_dir or log_dir / "ckpt", resume=a.resume, stop_after=a.stop_after)
    params, history = res["params"], res["history"]
    n_params = param_count(params)
    (log_dir / "loss_curve.json").write_text(json.dumps({"history": history, "config": vars(a)}, indent=1))
    plot_curve(history, log_dir / "loss_curve.png")
    tps = steady_tokens_per_s(history, a.batch * a.seq_len)
    summary = {"start_step": res["start_step"], "end_step": res["end_step"], "params": n_params,
               "wall_s": res["wall_s"], "tokens_per_s": tps, "compute_dtype": a.dtype}
    if res["end_step"] < a.steps:  # interrupted on purpose (--stop-after): no export
        print(json.dumps(summary))
        return summary
    t = time.perf_counter()
    bpb = {name: bits_per_byte(forward_for(cfg, name), params, corpus.heldout, a.eval_window)
           for name in ("float32", "bfloat16")}
    print(f"held-out bits/byte: float32 {bpb['float32']:.4f}, bfloat16 {bpb['bfloat16']:.4f} "
          f"({time.perf_counter() - t:.0f} s)")
    out.mkdir(parents=True, exist_ok=True)
    save_hf_weights(out, cfg, params)
    (out / "validation.txt").write_text(corpus.heldout_text)
    plot_curve(history, out / "loss_curve.png")
    text = "(not generated)" if a.no_sample else sample(out, PROMPT)
    print(f"sample: {PROMPT!r} -> {text!r}")
    from pydoc_data import topics

    summary.update(val_bpb=bpb, sample=text, file_bytes=(out / "model.safetensors").stat().st_size)
    training = {
        "val_bpb_float32": bpb["float32"], "val_bpb_bfloat16": bpb["bfloat16"], "eval_window": a.eval_window,
        "heldout_bytes": len(corpus.heldout_text.encode()), "params": n_params, "steps": a.steps,
        "tokens_per_s": tps, "wall_s": res["wall_s"], "args": {k: v for k, v in vars(a).items() if k not in RUN_ONLY},
        "python": platform.python_version(),
    }
    (out / "training.json").write_text(json.dumps(training, indent=1) + "\n")
    (log_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    argv_shown = _shown_args(argv if argv is not None else sys.argv[1:])
    tokens = a.steps * a.batch * a.seq_len
    card = CARD.format(
        params_m=n_params / 1e6, n_lin=len(cfg.linear_layer_ids), n_full=len(cfg.full_layer_ids),
        pyver=platform.python_version(), num_docs=corpus.num_docs, corpus_bytes=corpus.num_bytes,
        corpus_sha=hashlib.sha256(Path(topics.__file__).read_bytes()).hexdigest()[:16],
        heldout_bytes=len(corpus.heldout_text.encode()), heldout_at=HELDOUT_AT, vocab=cfg.vocab_size,
        hidden=cfg.hidden_size,
        layers=cfg.num_hidden_layers, layout="".join("G" if t == "linear_attention" else "A" for t in cfg.layer_types),
        intermediate=cfg.intermediate_size, heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
        kv_heads=cfg.num_key_value_heads, rotary=cfg.rotary_dim, lk=cfg.linear_num_key_heads,
        lv=cfg.linear_num_value_heads, lhd=cfg.linear_key_head_dim, params=f"{n_params:,}",
        file_mb=summary["file_bytes"] / 1e6, steps=a.steps, batch=a.batch, seq_len=a.seq_len, tokens_m=tokens / 1e6,
        epochs=tokens / len(corpus.train), lr=a.lr, warmup=a.warmup, wd=a.weight_decay, dtype=a.dtype,
        wall_min=res["wall_s"] / 60, tps=tps,
        machine=f"{os.cpu_count()} {jax.default_backend()} cores" + (f" ({a.host_note})" if a.host_note else ""),
        bpb32=bpb["float32"], bpb16=bpb["bfloat16"], window=a.eval_window,
        max_pos=cfg.max_position_embeddings,
        command="python scripts/tools/train_tiny.py" + "".join(" " + shlex.quote(x) for x in argv_shown),
        prompt_repr=PROMPT, sample=PROMPT + text)
    (out / "README.md").write_text(card)
    print(json.dumps({k: v for k, v in summary.items() if k != "sample"}))
    return summary


if __name__ == "__main__":
    run_command(main)
