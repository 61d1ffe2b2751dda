"""Tensor parallelism: step time and bytes per device against the TP size, and the host's peak memory while a
checkpoint loads split.

    .venv/bin/python scripts/bench/bench_tp.py [--model hybrid-1024] [--sizes 1,2,4,8] [--prompt-len 512]
    .venv/bin/python scripts/bench/bench_tp.py --load-rss [--rss-layers 4] [--rss-dtype bfloat16]

Each TP size runs in a process of its own with `--sizes`' largest count of host devices
(XLA_FLAGS=--xla_force_host_platform_device_count): one engine, a `--prompt-len` prompt generated once to compile,
then timed `--repeats` times: its TTFT (one prefill step) and its decode steps (`--decode-tokens`, the mean step).
Bytes per device: device 0's addressable shards of the weights and of the pools. On the CPU the "devices" share one
machine's cores and memory, so the times measure the partitioned program's overhead (the collectives, the copies
of heads where TP exceeds their count), not a speed-up; on several GPUs they would measure the split.

`--load-rss`: writes a checkpoint of random weights with Qwen3.5-9B's widths (`--rss-preset`) and `--rss-layers`
of its layers (3 GDN + 1 attention per 4) to a temporary folder, then loads it at TP=1 and TP=4, each in a fresh
process, and reports each process's peak anonymous memory (the host devices' memory is the process's own here, so
the weights count once in every row; what a loader holds besides them shows above that) and its peak RSS (which
also counts the file's pages as it is read). A third row loads the model whole on one device first and then splits it
(`weights.shard_model`), as a loader without a mesh would.

Prints tables and writes JSON (default results/bench_tp.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared helpers in common.py
from common import environment, run_command  # noqa: E402

from gdn_jax.entrypoints.cli import output_file, positive_int, positive_ints  # noqa: E402


def _child_env(devices: int) -> dict:
    flags = os.environ.get("XLA_FLAGS", "")
    return {**os.environ, "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices}".strip()}


def _run_child(args: list[str], devices: int) -> dict:
    done = subprocess.run([sys.executable, __file__, *args], env=_child_env(devices), capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"bench_tp.py {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_steps(model: str, tp: int, prompt_len: int, decode_tokens: int, repeats: int, dtype: str) -> dict:
    """One engine at `tp`: median TTFT and mean decode step, bytes on device 0."""
    import jax
    import numpy as np

    from gdn_jax import LLM, SamplingParams
    from gdn_jax.model.sharding import bytes_on_device

    llm = LLM(model, tensor_parallel_size=tp, dtype=dtype, max_num_seqs=4, max_model_len=prompt_len + decode_tokens,
              enable_prefix_caching=False, verbose=False)
    worker = llm.engine.worker
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)
    llm.generate([rng.integers(4, 250, prompt_len).tolist()], params, use_tqdm=False)  # compiles
    compiled, ttft, step = worker.num_compilations, [], []
    for _ in range(repeats):
        out = llm.generate([rng.integers(4, 250, prompt_len).tolist()], params, use_tqdm=False)[0]
        m = out.metrics
        ttft.append(m.ttft)
        step.append((m.finished_time - m.arrival_time - m.ttft) / (decode_tokens - 1))
    device = worker.mesh.devices.flat[0] if worker.mesh is not None else jax.devices()[0]
    return {"tp": tp, "ttft_ms": 1e3 * float(np.median(ttft)), "decode_step_ms": 1e3 * float(np.median(step)),
            "weights_mib_device0": bytes_on_device(worker.params, device) / 2**20,
            "pools_mib_device0": bytes_on_device(worker.state, device) / 2**20,
            "compilations_after_first": worker.num_compilations - compiled}


def shaped(preset: str, layers: int):
    """`preset`'s widths with `layers` of its layers."""
    from gdn_jax.config import get_preset, hybrid_layer_types

    cfg = get_preset(preset)
    return dataclasses.replace(cfg, layer_types=hybrid_layer_types(layers), name=f"{preset}-{layers}-layers")


def write_checkpoint(folder: Path, preset: str, layers: int, dtype: str) -> int:
    """Random weights of `shaped(preset, layers)` written as a HF folder; returns its bytes."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    from gdn_jax.model.weights import hf_shapes

    cfg = shaped(preset, layers)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg.to_hf_config()))
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)
    rng, tensors, total = np.random.default_rng(0), {}, 0
    for name, shape in hf_shapes(cfg).items():
        tensors[name] = arr = (0.02 * rng.standard_normal(shape, np.float32)).astype(np_dtype)
        total += arr.nbytes
    save_file(tensors, str(folder / "model.safetensors"))
    return total


class AnonPeak:
    """The peak of this process's anonymous resident memory (RssAnon: not the file pages that reading a
    safetensors file maps, which VmHWM counts), sampled every 5 ms on a thread."""

    def __init__(self):
        import threading

        self.peak, self.stop_event = 0, threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)

    @staticmethod
    def now() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
        return 0

    def sample(self):
        while not self.stop_event.wait(0.005):
            self.peak = max(self.peak, self.now())

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop_event.set()
        self.thread.join()
        self.peak = max(self.peak, self.now())


def measure_load(folder: str, tp: int, dtype: str, gathered: bool = False) -> dict:
    """Loads `folder` split over `tp` devices (`gathered`: whole on one device first, then split by
    `weights.shard_model`, as a loader without a mesh would); peak memory and the bytes on device 0."""
    import jax

    from gdn_jax.model.sharding import bytes_on_device, make_mesh
    from gdn_jax.model.weights import load_model, shard_model

    mesh = make_mesh(tp) if tp > 1 else None
    dt = getattr(jax.numpy, dtype)
    t0 = time.perf_counter()
    with AnonPeak() as anon:
        if gathered:
            cfg, _, params = load_model(folder, dtype=dt)
            params = shard_model(cfg, params, mesh, dt)[2]
        else:
            params = load_model(folder, dtype=dt, mesh=mesh)[2]
        jax.block_until_ready(params)
    seconds = time.perf_counter() - t0
    device = jax.devices()[0]
    return {"tp": tp, "gathered": gathered, "load_s": seconds, "peak_anon_mib": anon.peak / 2**20,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "weights_mib_device0": bytes_on_device(params, device) / 2**20,
            "weights_mib_all": sum(x.nbytes for x in jax.tree_util.tree_leaves(params)) / 2**20}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="bench_tp.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="hybrid-1024", help="preset or HF folder (default: %(default)s)")
    ap.add_argument("--sizes", type=positive_ints, default=[1, 2, 4, 8], help="TP sizes (default: 1,2,4,8)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the engines' dtype")
    ap.add_argument("--prompt-len", type=positive_int, default=512, help="prompt tokens (default: %(default)s)")
    ap.add_argument("--decode-tokens", type=positive_int, default=16, help="tokens generated (default: %(default)s)")
    ap.add_argument("--repeats", type=positive_int, default=3, help="timed requests per size (default: %(default)s)")
    ap.add_argument("--load-rss", action="store_true", help="measure the peak RSS of loading a 9B-shaped checkpoint")
    ap.add_argument("--rss-layers", type=positive_int, default=4, help="its layers (default: %(default)s)")
    ap.add_argument("--rss-dtype", default="bfloat16", choices=["float32", "bfloat16"],
                    help="the checkpoint's and the loaded weights' dtype")
    ap.add_argument("--rss-preset", default="qwen3.5-9b", help="the widths it takes (default: %(default)s)")
    ap.add_argument("--out", type=output_file, default="results/bench_tp.json", help="JSON output")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one measurement, in this process
    args = ap.parse_args(argv)
    if args.child:
        kind, *rest = json.loads(args.child)
        result = measure_steps(*rest) if kind == "steps" else measure_load(*rest)
        print(json.dumps(result))
        return
    if args.decode_tokens < 2:
        ap.error("--decode-tokens must be at least 2 (the decode steps follow the first token)")
    out = {"args": vars(args), "environment": environment()}
    if args.load_rss:
        with tempfile.TemporaryDirectory(prefix="gdn-jax-9b-shaped-") as tmp:
            size = write_checkpoint(Path(tmp), args.rss_preset, args.rss_layers, args.rss_dtype)
            out["checkpoint_mib"] = size / 2**20
            print(f"a {shaped(args.rss_preset, args.rss_layers).name} checkpoint, {args.rss_dtype}: "
                  f"{size / 2**20:.0f} MiB")
            out["load"] = [_run_child(["--child", json.dumps(["load", tmp, tp, args.rss_dtype, gathered])], 4)
                           for tp, gathered in ((1, False), (4, False), (4, True))]
        head = (f"{'':<24}{'load s':>8}{'peak anon MiB':>15}{'peak RSS MiB':>14}{'weights MiB, dev 0':>20}"
                f"{'all devs':>10}")
        print(head + "\n" + "-" * len(head))
        for r in out["load"]:
            name = f"TP={r['tp']}" + (", whole, then split" if r["gathered"] else "")
            print(f"{name:<24}{r['load_s']:>8.1f}{r['peak_anon_mib']:>15.0f}{r['peak_rss_mib']:>14.0f}"
                  f"{r['weights_mib_device0']:>20.0f}{r['weights_mib_all']:>10.0f}")
    else:
        devices = max(args.sizes)
        out["steps"] = [_run_child(["--child", json.dumps(["steps", args.model, tp, args.prompt_len,
                                                           args.decode_tokens, args.repeats, args.dtype])], devices)
                        for tp in args.sizes]
        print(f"{args.model}, {args.dtype}: a {args.prompt_len}-token prompt, {args.decode_tokens} tokens; "
              f"{devices} host devices (CPU: the overhead of the split, not a speed-up)")
        head = (f"{'TP':>3}{'TTFT ms':>10}{'decode step ms':>16}{'weights MiB/dev':>17}{'pools MiB/dev':>15}"
                f"{'recompiles':>12}")
        print(head + "\n" + "-" * len(head))
        for r in out["steps"]:
            print(f"{r['tp']:>3}{r['ttft_ms']:>10.1f}{r['decode_step_ms']:>16.2f}{r['weights_mib_device0']:>17.1f}"
                  f"{r['pools_mib_device0']:>15.1f}{r['compilations_after_first']:>12}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    run_command(main)
