"""Forward time of a 2048-token prefill: gdn_jax vs transformers, same config and weights, same run.

    .venv/bin/python scripts/bench/bench_forward.py [--tokens 2048] [--preset hybrid-1024]
                                                    [--out results/bench_forward.json]

The JAX side runs the engine's forward (paged KV, GDN slots) jitted, with the engine's prefill compile options;
transformers (torch==2.13.0, float32, eager
attention) runs `Qwen3_5ForCausalLM` built from the same config with the same weights. Both return logits for the
last position only (what a prefill needs). Prints a table and writes JSON. transformers is optional: without it
only the JAX rows are reported. `compile s` is the JAX forward's lowering and XLA compilation (`lower_s` +
`compile_s` in the JSON); its first run, which follows them, is `1st run s` (`first_run_s`), and the timed forwards
come after it.

Beside the times: the forward's matmul work counted from the config (`common.forward_flops`: projections and LM
head, attention over the causal triangle, the chunked GDN rule), the achieved matmul GFLOP/s (work / forward time),
and the measured matmul peak of each dtype on the forward's own projection shapes (`common.matmul_peak`: bare jitted
dots, plain contractions or, for a 16-bit dtype, the operands converted to float32 if that is faster; the FLOP-weighted
rate of the forward's mix), with the fraction of it the forward reaches. With transformers: the float32 floor, the
matmul work alone at the measured float32 peak (`float32_floor_s`), and so the most any float32 forward on this
machine could beat transformers by (`most_vs_transformers`: its time over that floor; the attention and the GDN rule
run below the projections' peak, so the true ceiling is lower still).
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

from gdn_jax.backends.cpu import tuning
from gdn_jax.config import PRESETS, get_preset
from gdn_jax.entrypoints.cli import output_file, positive_int
from gdn_jax.model.qwen35 import init_model
from gdn_jax.model.state import init_state
from gdn_jax.model.weights import hf_tensors

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared helpers in common.py
from common import forward_flops, forward_jit, matmul_peak, one_row_batch, run_command  # noqa: E402


def time_jax(cfg, tokens, dtype, repeats, seed=0):
    """Seconds of the forward's lowering, its compilation and its first run, each on its own (the first run, which
    allocates its outputs and warms the caches, is neither compilation nor a timed forward), then `repeats` timed
    forwards."""
    graphdef, params = init_model(cfg, seed=seed, dtype=dtype)
    batch, nb = one_row_batch(tokens, 16)
    state = init_state(cfg, nb + 1, 16, 2, dtype)
    t0 = time.perf_counter()
    lowered = forward_jit(len(tokens), tuning.resolve_forms(dtype)).lower(graphdef, params, batch, state, False)
    t1 = time.perf_counter()
    fn = lowered.compile()  # called without the static arguments (graphdef, the flag)
    t2 = time.perf_counter()
    logits, state = fn(params, batch, state)
    logits.block_until_ready()
    setup = {"lower_s": t1 - t0, "compile_s": t2 - t1, "first_run_s": time.perf_counter() - t2}
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        logits, state = fn(params, batch, state)
        logits.block_until_ready()
        times.append(time.perf_counter() - t0)
    return setup, times, graphdef, params, np.asarray(logits[0], np.float32)


def time_transformers(cfg, tokens, params, repeats):
    """Builds the same model in transformers from our weights (HF names), float32 CPU."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    hf_cfg = Qwen3_5TextConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, layer_types=list(cfg.layer_types),
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, linear_num_key_heads=cfg.linear_num_key_heads,
        linear_num_value_heads=cfg.linear_num_value_heads, linear_key_head_dim=cfg.linear_key_head_dim,
        linear_value_head_dim=cfg.linear_value_head_dim, linear_conv_kernel_dim=cfg.linear_conv_kernel_dim,
        rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                         "partial_rotary_factor": cfg.partial_rotary_factor},
        max_position_embeddings=cfg.max_position_embeddings)
    hf_cfg._attn_implementation = "eager"
    model = Qwen3_5ForCausalLM(hf_cfg).eval()
    sd = hf_tensors(cfg, params)
    model.load_state_dict({k: torch.from_numpy(np.array(v, np.float32)) for k, v in sd.items()}, strict=True)
    ids = torch.tensor([tokens])
    times = []
    with torch.inference_mode():
        model(ids[:, :64], use_cache=False, logits_to_keep=1)  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = model(ids, use_cache=False, logits_to_keep=1)
            times.append(time.perf_counter() - t0)
    return times, out.logits[0, -1].float().numpy(), torch.get_num_threads()


def main(argv=None):
    ap = argparse.ArgumentParser(prog="bench_forward.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="hybrid-1024", choices=sorted(PRESETS), help="model preset (default: %(default)s)")
    ap.add_argument("--tokens", type=positive_int, default=2048, help="tokens in the one-pass forward (default: %(default)s)")
    ap.add_argument("--repeats", type=positive_int, default=3, help="timed repeats after compilation; the minimum is reported (default: %(default)s)")
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers rows (they need the reference extra) (default: off)")
    ap.add_argument("--out", type=output_file, default="results/bench_forward.json",
                    help="JSON output (default: %(default)s)")
    args = ap.parse_args(argv)

    cfg = get_preset(args.preset)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, args.tokens).tolist()
    rows, result = [], {"preset": args.preset, "tokens": args.tokens, "backend": jax.default_backend(),
                        "cpu_count": os.cpu_count()}
    work = forward_flops(cfg, args.tokens)  # FLOPs: the projections (+ LM head), attention (causal), the GDN rule
    result["matmul_gflop"] = {k: v / 1e9 for k, v in work.items()}
    peaks = {}
    for name, dtype in (("float32", jnp.float32), ("bfloat16", jnp.bfloat16)):
        peaks[name] = matmul_peak(cfg, args.tokens, dtype)
    result["matmul_peak"] = peaks
    compile32, t32, graphdef, params, logits_jax = time_jax(cfg, tokens, jnp.float32, args.repeats)
    rows.append(("gdn_jax float32", compile32, min(t32)))
    compile16, t16, *_ = time_jax(cfg, tokens, jnp.bfloat16, args.repeats)
    rows.append(("gdn_jax bfloat16", compile16, min(t16)))
    for name, comp, t in (("float32", compile32, t32), ("bfloat16", compile16, t16)):
        rate = work["total"] / min(t) / 1e9
        result[f"jax_{name}"] = {**comp, "times_s": t, "matmul_gflops": rate,
                                 "peak_fraction": rate / peaks[name]["gflops"]}
    hf_best = None
    if not args.no_transformers:
        try:
            t_hf, logits_hf, threads = time_transformers(cfg, tokens, params, args.repeats)
        except ImportError as e:
            print(f"transformers/torch not available ({e}); JAX rows only")
        else:
            hf_best = min(t_hf)
            rows.append((f"transformers float32 ({threads} threads)", None, hf_best))
            # no float32 forward here runs faster than its matmul work at the measured float32 peak
            floor = work["total"] / (peaks["float32"]["gflops"] * 1e9)
            result["transformers_float32"] = {"times_s": t_hf, "torch_threads": threads,
                                              "max_abs_logit_diff": float(np.abs(logits_hf - logits_jax).max()),
                                              "float32_floor_s": floor, "most_vs_transformers": hf_best / floor}

    print(f"\nforward of {args.tokens} tokens, preset {args.preset} ({cfg.num_hidden_layers} layers, "
          f"{len(cfg.linear_layer_ids)} GDN + {len(cfg.full_layer_ids)} full), backend {jax.default_backend()}")
    print(f"matmul work {work['total'] / 1e9:.1f} GFLOP (projections + LM head {work['dense'] / 1e9:.1f}, attention "
          f"{work['attention'] / 1e9:.1f}, GDN rule {work['gdn'] / 1e9:.1f}); measured matmul peak on the projection "
          f"shapes at {args.tokens} rows: float32 {peaks['float32']['gflops']:.0f}, bfloat16 "
          f"{peaks['bfloat16']['gflops']:.0f} GFLOP/s")
    print(f"{'implementation':<36}{'compile s':>10}{'1st run s':>10}{'forward s':>11}{'tok/s':>10}{'vs transformers':>17}"
          f"{'GFLOP/s':>9}{'of peak':>9}")
    for name, comp, best in rows:
        ratio = f"{hf_best / best:.2f}x" if hf_best else "-"
        comp_s = f"{comp['lower_s'] + comp['compile_s']:.1f}" if comp is not None else "-"
        first_s = f"{comp['first_run_s']:.2f}" if comp is not None else "-"
        dt = next((d for d in peaks if name.endswith(d)), None) if name.startswith("gdn_jax") else None
        rate = work["total"] / best / 1e9
        frac = f"{100 * rate / peaks[dt]['gflops']:.0f}%" if dt else "-"
        print(f"{name:<36}{comp_s:>10}{first_s:>10}{best:>11.3f}{args.tokens / best:>10.0f}{ratio:>17}{rate:>9.0f}{frac:>9}")
    if "transformers_float32" in result:
        hf = result["transformers_float32"]
        print(f"max |logit difference| jax vs transformers (float32): {hf['max_abs_logit_diff']:.2e}")
        print(f"float32 floor: the matmul work alone at the measured float32 peak takes {hf['float32_floor_s']:.3f} s, "
              f"so no float32 forward on this machine beats transformers' {hf_best:.3f} s by more than "
              f"{hf['most_vs_transformers']:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    run_command(main)
