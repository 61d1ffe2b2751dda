"""A sparse-MoE layer against a dense MLP of the same active parameters, and an MoE model's memory plan per device.

    .venv/bin/python scripts/bench/bench_moe.py [--preset qwen3.5-35b-a3b] [--rows 1,16,256,2048] [--repeats 5]
    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python scripts/bench/bench_moe.py --ep-sizes 2,4,8
    .venv/bin/python scripts/bench/bench_moe.py --plan [--preset qwen3.5-35b-a3b] [--devices 8] [--device-gib 80]

Layer: one MoE block of `--preset`'s widths (its experts, top k, expert and shared-expert sizes; random weights)
and one SwiGLU MLP whose intermediate size is k x the expert size + the shared expert's, so that a token meets the
same number of weights in both. Each is jitted alone and run on `--rows` tokens; min and median of `--repeats` after
a compiling call. The MoE block reads every expert a token routes to; with few rows it reads most of its experts,
which the dense MLP of the same active size never holds: the ratio shows what sparsity costs on this backend.
`--ep-sizes`: the same block with its experts split over that many devices, the way the engine splits them (each
device multiplies its experts' rows, an all-reduce sums them): on host devices, the cost of the split.

`--plan`: the model split over `--devices` devices in every (tp, ep) that divides them and the model's sizes,
nothing allocated (abstract weights): the weights per device (the experts split over "ep", the rest over "tp"), and
the pools the engine would plan in what `--device-gib` x `--utilization` leaves per device.

Prints tables and writes JSON (default results/bench_moe.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdn_jax.backends.cpu import tuning
from gdn_jax.config import EngineConfig, get_preset
from gdn_jax.entrypoints.cli import output_file, positive_int, positive_ints, positive_number
from gdn_jax.model import sharding
from gdn_jax.model.layers import MLP
from gdn_jax.model.moe import SparseMoeBlock
from gdn_jax.model.weights import abstract_model
from gdn_jax.worker.memory import plan_memory

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared helpers in common.py
from common import environment, run_command  # noqa: E402


def _timed(layer, x, repeats: int, mesh=None) -> tuple[float, float]:
    """(min, median) ms of the jitted layer on x, in the forms the engine's steps take on this backend
    (`tuning.resolve_forms`; on a mesh without the CPU kernels); on `mesh`, its parameters placed as the engine
    places them."""
    forms = tuning.resolve_forms(x.dtype)
    if mesh is not None:
        forms = dataclasses.replace(forms, kernels=False, rows_kernel_rows=0, f32_rows_kernel_rows=0)
    graphdef, params = nnx.split(layer)
    if mesh is not None:
        params = jax.tree_util.tree_map_with_path(lambda path, a: jax.device_put(a, jax.sharding.NamedSharding(
            mesh, sharding.param_spec(tuple(k.key for k in path if hasattr(k, "key")), a.ndim))), params)
        x = jax.device_put(x, sharding.replicated(mesh))
    fn = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x, forms))
    jax.block_until_ready(fn(params, x))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(params, x))
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times), 1e3 * float(np.median(times))


def time_layers(preset: str, rows: list[int], repeats: int, dtype, ep_sizes: list[int]) -> list[dict]:
    cfg = get_preset(preset)
    active = cfg.num_experts_per_tok * cfg.moe_intermediate_size + cfg.shared_expert_intermediate_size
    moe = SparseMoeBlock(cfg, dtype, nnx.Rngs(0), 0.02)
    dense = MLP(dataclasses.replace(cfg, intermediate_size=active), dtype, nnx.Rngs(0), 0.02)
    split = {ep: SparseMoeBlock(cfg, dtype, nnx.Rngs(0), 0.02, sharding.make_mesh(1, ep)) for ep in ep_sizes}
    out = []
    for n in rows:
        x = jax.random.normal(jax.random.PRNGKey(n), (n, cfg.hidden_size), dtype)
        row = {"rows": n}
        row["moe_min_ms"], row["moe_median_ms"] = _timed(moe, x, repeats)
        row["dense_min_ms"], row["dense_median_ms"] = _timed(dense, x, repeats)
        row["ratio"] = row["moe_min_ms"] / row["dense_min_ms"]
        for ep, block in split.items():
            row[f"ep{ep}_min_ms"], row[f"ep{ep}_median_ms"] = _timed(block, x, repeats, block.mesh)
        out.append(row)
    return out


def plan(preset: str, devices: int, device_gib: float, utilization: float, dtype: str) -> list[dict]:
    """Weights and pools per device for every (tp, ep) of `devices` the model's sizes allow."""
    cfg, out = get_preset(preset), []
    itemsize = jnp.dtype(dtype).itemsize
    for tp in (d for d in range(1, devices + 1) if devices % d == 0):
        ep = devices // tp
        try:
            tp_cfg = sharding.tp_config(cfg, tp, ep)
        except ValueError as e:
            out.append({"tp": tp, "ep": ep, "refused": str(e)})
            continue
        _, params = abstract_model(tp_cfg, getattr(jnp, dtype))
        per_device = experts = 0
        for path, var in nnx.to_flat_state(params):
            x = var.get_value()
            spec = sharding.param_spec(path, x.ndim)
            split = math.prod({sharding.AXIS: tp, sharding.EXPERTS: ep}[a] for a in spec if a is not None)
            share = x.size * itemsize // split
            per_device += share
            experts += share if "experts_" in str(path) else 0
        budget = int(device_gib * 2**30 * utilization) - per_device
        config = EngineConfig.create(model=tp_cfg, dtype=dtype, max_num_seqs=64, max_model_len=32768)
        row = {"tp": tp, "ep": ep, "weights_gib": per_device / 2**30, "experts_gib": experts / 2**30,
               "pools_budget_gib": budget / 2**30}
        try:
            memory = plan_memory(tp_cfg, config, budget, devices=tp)
            row.update(kv_blocks=memory.num_kv_blocks, linear_slots=memory.num_linear_slots,
                       pools_gib=memory.total_bytes / 2**30, plan=memory.describe())
        except ValueError as e:
            row["refused"] = str(e)
        out.append(row)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="bench_moe.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3.5-35b-a3b", help="an MoE preset (default: %(default)s)")
    ap.add_argument("--rows", type=positive_ints, default=[1, 16, 256, 2048], help="tokens per call (default: "
                    "1,16,256,2048)")
    ap.add_argument("--repeats", type=positive_int, default=5, help="timed calls per cell (default: %(default)s)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="weights and activations")
    ap.add_argument("--ep-sizes", type=positive_ints, default=[], help="also time the block with its experts split "
                    "over these many devices (an 'ep' mesh; on the CPU, host devices: XLA_FLAGS="
                    "--xla_force_host_platform_device_count=N)")
    ap.add_argument("--plan", action="store_true", help="the memory plan per device instead of the layer times")
    ap.add_argument("--devices", type=positive_int, default=8, help="devices of the plan (default: %(default)s)")
    ap.add_argument("--device-gib", type=positive_number, default=80.0, help="memory per device (default: 80)")
    ap.add_argument("--utilization", type=positive_number, default=0.9, help="its share for the engine")
    ap.add_argument("--out", type=output_file, default="results/bench_moe.json", help="JSON output")
    args = ap.parse_args(argv)
    cfg = get_preset(args.preset)
    if not cfg.num_experts:
        ap.error(f"--preset {args.preset} has no experts")
    out = {"args": vars(args), "environment": environment()}
    if args.plan:
        out["plan"] = plan(args.preset, args.devices, args.device_gib, args.utilization, args.dtype)
        print(f"{args.preset}, {args.dtype}, on {args.devices} devices of {args.device_gib:g} GiB "
              f"(x {args.utilization:g}), 64 sequences of up to 32768 tokens")
        for r in out["plan"]:
            if "weights_gib" not in r:
                print(f"  tp={r['tp']} ep={r['ep']}: refused: {r['refused']}")
                continue
            tail = r.get("plan") or f"refused: {r['refused']}"
            print(f"  tp={r['tp']} ep={r['ep']}: weights {r['weights_gib']:.2f} GiB per device (experts "
                  f"{r['experts_gib']:.2f}); pools: {tail}")
    else:
        if args.ep_sizes and max(args.ep_sizes) > len(jax.devices()):
            ap.error(f"--ep-sizes {max(args.ep_sizes)} needs as many devices, {len(jax.devices())} visible")
        out["layers"] = time_layers(args.preset, args.rows, args.repeats, getattr(jnp, args.dtype), args.ep_sizes)
        print(f"{args.preset} widths, {args.dtype}: an MoE block ({cfg.num_experts} experts, top "
              f"{cfg.num_experts_per_tok}) vs a dense MLP of the same active parameters, on {jax.default_backend()}")
        head = f"{'rows':>6}{'MoE min ms':>12}{'dense min ms':>14}{'MoE / dense':>13}" + "".join(
            f"{f'EP={ep} min ms':>14}" for ep in args.ep_sizes)
        print(head + "\n" + "-" * len(head))
        for r in out["layers"]:
            print(f"{r['rows']:>6}{r['moe_min_ms']:>12.2f}{r['dense_min_ms']:>14.2f}{r['ratio']:>13.2f}" + "".join(
                f"{r[f'ep{ep}_min_ms']:>14.2f}" for ep in args.ep_sizes))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    run_command(main)
