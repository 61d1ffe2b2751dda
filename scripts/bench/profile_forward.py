"""Where a prefill forward's time goes: the XLA op time of one jitted forward, by part of the model.

    .venv/bin/python scripts/bench/profile_forward.py [--preset hybrid-1024] [--tokens 2048] [--dtypes float32,bfloat16]
                                                      [--runs 3] [--out results/profile_forward.json]

The forward is bench_forward.py's (the engine's `forward`, last position's logits, paged KV and GDN slots). It is
traced `--runs` times with the JAX profiler; every op of the compiled forward is attributed to a part of the model by
the call stack XLA's metadata keeps for it (`common.PARTS`: projections, gdn_rule, conv, gdn_state,
attention, norms_elementwise, logits, other).

Each op counts its self time (`common.self_times`): a loop (the layer loop, the attention and GDN scans) or a
conditional counts its span less its body's ops, which count for their parts. On two cores the ops of both threads
add up to more than the wall time; dispatch and waits for the other core are in the wall time only. Prints a
table per dtype and writes JSON (per part: ms per forward, share, its busiest ops; the 15 busiest ops).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from gdn_jax.backends.cpu import tuning
from gdn_jax.config import PRESETS, get_preset
from gdn_jax.entrypoints.cli import output_file, positive_int
from gdn_jax.model.qwen35 import init_model
from gdn_jax.model.state import init_state

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared helpers in common.py
from common import (PARTS, compiled_text, dtype_names, forward_jit, one_row_batch, op_parts, part_times,  # noqa: E402
                    run_command, self_times, trace_events)


def profile(cfg, tokens, dtype, runs: int) -> dict:
    graphdef, params = init_model(cfg, seed=0, dtype=dtype)
    batch, nb = one_row_batch(tokens, 16)
    state = init_state(cfg, nb + 1, 16, 2, dtype)
    fn = forward_jit(len(tokens), tuning.resolve_forms(dtype))
    parts = op_parts(compiled_text(fn, (graphdef, params, batch, state, False)))[0]
    box = {"state": state}

    def call():
        logits, box["state"] = fn(graphdef, params, batch, box["state"], False)
        logits.block_until_ready()

    call()
    call()
    events, wall = trace_events(call, runs)
    module = next(e["args"]["hlo_module"] for e in events if e.get("ph") == "X"
                  and str((e.get("args") or {}).get("hlo_module", "")).startswith("jit_forward"))
    by_op = self_times(events, module, runs)
    by_part = part_times(by_op, parts)
    total = sum(by_part.values())
    return {"module": module, "wall_ms": 1e3 * wall, "op_ms_total": total,
            "parts_ms": {p: by_part.get(p, 0.0) for p in PARTS},
            "parts_share": {p: by_part.get(p, 0.0) / total if total else 0.0 for p in PARTS},
            "top_ops_ms": {op: (ms, parts.get(op, "other")) for op, ms in by_op.most_common(15)},
            "top_ops_by_part_ms": {p: dict([(op, ms) for op, ms in by_op.most_common() if parts.get(op, "other") == p][:6])
                                   for p in PARTS}}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="profile_forward.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="hybrid-1024", choices=sorted(PRESETS), help="model preset (default: %(default)s)")
    ap.add_argument("--tokens", type=positive_int, default=2048, help="tokens in the one-pass forward (default: %(default)s)")
    ap.add_argument("--dtypes", type=dtype_names, default="float32,bfloat16", help="activation dtypes, comma-separated (default: %(default)s)")
    ap.add_argument("--runs", type=positive_int, default=3, help="traced forwards per dtype (default: %(default)s)")
    ap.add_argument("--out", type=output_file, default="results/profile_forward.json",
                    help="JSON output (default: %(default)s)")
    args = ap.parse_args(argv)
    cfg = get_preset(args.preset)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, args.tokens).tolist()
    result = {"preset": args.preset, "tokens": args.tokens, "backend": jax.default_backend(), "runs": args.runs}
    for name in args.dtypes:
        result[name] = r = profile(cfg, tokens, jnp.dtype(name), args.runs)
        print(f"\n{name}: forward of {args.tokens} tokens, preset {args.preset}: wall {r['wall_ms']:.0f} ms per "
              f"forward (traced), op time {r['op_ms_total']:.0f} ms")
        print(f"{'part':<20}{'ms':>9}{'share':>8}")
        for p in PARTS:
            print(f"{p:<20}{r['parts_ms'][p]:>9.1f}{100 * r['parts_share'][p]:>7.1f}%")
        print("busiest ops: " + ", ".join(f"{op} {ms:.0f} ms ({part})" for op, (ms, part) in
                                         list(r["top_ops_ms"].items())[:8]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    run_command(main)
