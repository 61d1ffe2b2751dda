"""Where a prefill forward's time goes: the XLA op time of one jitted forward, by part of the model.

    python scripts/profile_forward.py [--preset hybrid-1024] [--tokens 2048] [--dtypes float32,bfloat16]
                                      [--runs 3] [--out results/profile_forward.json]

The forward is `bench_forward`'s (the engine's `forward`, last position's logits, paged KV and GDN slots). It is
traced `--runs` times with the JAX profiler; every op of the compiled forward is attributed to a part of the model by
the source line XLA's metadata names for it (the function that line is in):

- `projections`: the layers' projection and MLP matmuls (`_product` in gdn_jax/model.py);
- `gdn_rule`: the chunked gated delta rule (gdn_jax/gated_delta.py, except the conv);
- `conv`: the causal depthwise conv of the GDN layers (`causal_conv1d`);
- `attention`: the full-attention layers' scores, softmax and values, the KV cache writes and reads, RoPE;
- `norms_elementwise`: RMS norms, gates, activations, residual adds, the GDN input gates, dtype conversions;
- `logits`: the final norm and LM head;
- `other`: everything else (embedding gather, GDN state reads and writes, layer-loop bookkeeping).

Loops (the layer loop, the attention and GDN scans) are not counted themselves: their bodies' ops are. The sum of
op times is less than the wall time by the runtime's dispatch and by the time ops wait for the other core. Prints a
table per dtype and writes JSON (per part: ms per forward, share, its busiest ops; the 15 busiest ops).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import trace_events  # noqa: E402
from bench_forward import _batch, forward_jit  # noqa: E402

from gdn_jax.config import get_preset  # noqa: E402
from gdn_jax.model import init_model, init_state  # noqa: E402

PARTS = ("projections", "gdn_rule", "conv", "attention", "norms_elementwise", "logits", "other")
# innermost function of an op's call stack -> part (the first listed one met walking outwards); a projection matmul is
# any op under `Linear.__call__`, the LM head any other op under `_product`
FUNCTION_PARTS = {
    "causal_conv1d": "conv",
    "l2norm": "norms_elementwise",
    "chunk_gated_delta_rule": "gdn_rule",
    "recurrent_gated_delta_rule": "gdn_rule",
    "rope": "attention",
    "Attention.__call__": "attention",
    "RMSNorm.__call__": "norms_elementwise",
    "GatedRMSNorm.__call__": "norms_elementwise",
    "MLP.__call__": "norms_elementwise",
    "DecoderLayer.residual": "norms_elementwise",
    "GatedDeltaNet.__call__": "norms_elementwise",
}
CONTAINERS = ("while", "conditional", "call")  # ops whose time is their bodies' ops


def _section(text: str, name: str) -> list[str]:
    m = re.search(r"^" + name + r"\n(.*?)(?:\n\n|\Z)", text, re.S | re.M)
    return m.group(1).splitlines() if m else []


def _stacks(hlo_text: str) -> dict[int, list[str]]:
    """stack_frame_id -> the function names of its call stack, innermost first (the HLO text's StackFrames table;
    a parent_frame_id there is the parent's id + 1, 0 for none)."""
    fns = {int(line.split()[0]): line.split(" ", 1)[1].strip('"') for line in _section(hlo_text, "FunctionNames")}
    locs = {int(line.split()[0]): fns[int(re.search(r"function_name_id=(\d+)", line).group(1))]
            for line in _section(hlo_text, "FileLocations")}
    frames = {}
    for line in _section(hlo_text, "StackFrames"):
        d = dict(re.findall(r"(\w+)=(\d+)", line))
        frames[int(line.split()[0])] = (int(d["file_location_id"]), int(d["parent_frame_id"]) - 1)
    out = {}
    for fid in frames:
        chain, i = [], fid
        while i in frames and len(chain) < 200:
            loc, parent = frames[i]
            chain.append(locs[loc])
            if parent <= 0 or parent == i:
                break
            i = parent
        out[fid] = chain
    return out


def _part(chain: list[str]) -> str:
    if "Linear.__call__" in chain:
        return "projections"
    if "_product" in chain:
        return "logits"
    for fn in chain:
        if fn in FUNCTION_PARTS:
            return FUNCTION_PARTS[fn]
    return "other"


def op_parts(hlo_text: str) -> tuple[dict[str, str], set[str]]:
    """HLO instruction name -> part of the model (from the call stack XLA's metadata keeps for it); and the names of
    the container ops (loops, conditionals, calls)."""
    stacks = _stacks(hlo_text)
    parts, containers, calls, where = {}, set(), {}, {}
    by_computation = collections.defaultdict(collections.Counter)  # computation -> parts of its ops
    inst = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*? ([a-z\-]+)\(")
    computation = None
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            computation = head.group(1)
            continue
        m = inst.match(line)
        if not m:
            continue
        name, opcode = m.groups()
        if opcode in CONTAINERS:
            containers.add(name)
        sf = re.search(r"stack_frame_id=(\d+)", line)
        if sf:
            parts[name] = _part(stacks.get(int(sf.group(1)), []))
            by_computation[computation][parts[name]] += 1
        else:
            called = re.search(r"calls=%?([\w.\-]+)", line)
            calls[name], where[name] = (called.group(1) if called else None), computation

    def majority(computation):
        counts = by_computation.get(computation)
        return counts.most_common(1)[0][0] if counts else None

    # an op without metadata (a library fusion, ynn_fusion, may lose it): its fused body's part if that has any,
    # else the part most of its own computation's ops (a loop body) belong to
    for name, called in calls.items():
        parts[name] = majority(called) or majority(where[name]) or "other"
    return parts, containers


def profile(cfg, tokens, dtype, runs: int) -> dict:
    graphdef, params = init_model(cfg, seed=0, dtype=dtype)
    batch, nb = _batch(tokens, 16)
    state = init_state(cfg, nb + 1, 16, 2, dtype)
    fn = forward_jit()
    compiled = fn.lower(graphdef, params, batch, state, False).compile()
    parts, containers = op_parts(compiled.as_text())
    box = {"state": state}

    def call():
        logits, box["state"] = fn(graphdef, params, batch, box["state"], False)
        logits.block_until_ready()

    call()
    call()
    events, wall = trace_events(call, runs)
    module = None
    by_part, by_op = collections.Counter(), collections.Counter()
    for e in events:
        a = e.get("args") or {}
        if e.get("ph") != "X" or "hlo_op" not in a or not str(a.get("hlo_module", "")).startswith("jit_forward"):
            continue
        module = a["hlo_module"]
        op = a["hlo_op"]
        if op in containers:
            continue
        by_part[parts.get(op, "other")] += e["dur"] / 1e3 / runs
        by_op[op] += e["dur"] / 1e3 / runs
    total = sum(by_part.values())
    return {"module": module, "wall_ms": 1e3 * wall, "op_ms_total": total,
            "parts_ms": {p: by_part.get(p, 0.0) for p in PARTS},
            "parts_share": {p: by_part.get(p, 0.0) / total if total else 0.0 for p in PARTS},
            "top_ops_ms": {op: (ms, parts.get(op, "other")) for op, ms in by_op.most_common(15)},
            "top_ops_by_part_ms": {p: dict([(op, ms) for op, ms in by_op.most_common() if parts.get(op, "other") == p][:6])
                                   for p in PARTS}}


def main():
    ap = argparse.ArgumentParser(prog="profile_forward.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="hybrid-1024", help="model preset (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens in the one-pass forward (default: %(default)s)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="activation dtypes, comma-separated (default: %(default)s)")
    ap.add_argument("--runs", type=int, default=3, help="traced forwards per dtype (default: %(default)s)")
    ap.add_argument("--out", default="results/profile_forward.json", help="JSON output (default: %(default)s)")
    args = ap.parse_args()
    cfg = get_preset(args.preset)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, args.tokens).tolist()
    result = {"preset": args.preset, "tokens": args.tokens, "backend": jax.default_backend(), "runs": args.runs}
    for name in args.dtypes.split(","):
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


if __name__ == "__main__":
    main()
