"""Compile time of the engine's step for every warm-up shape, from abstract shapes only: no weights and no pools are
allocated, so the Qwen3.5-9B preset compiles on a machine that could not hold it.

    .venv/bin/python scripts/bench/bench_compile.py --preset qwen3.5-9b [--dtype bfloat16] [--max-num-seqs 16]
                                                    [--max-model-len 4096] [--block-size 16] [--chunk-stride 64]
                                                    [--max-num-batched-tokens 2048] [--checkpoint-mode scan|promote]
                                                    [--checkpoint-policy all|last]
                                                    [--shapes 16x64x256,16x1x256 | --limit N] [--prompt-logprobs]
                                                    [--warm-up [--compile-threads N] [--speculative-tokens K]]
                                                    [--cache-dir off|DIR]
                                                    [--second-start] [--out results/bench_compile_<preset>.json]

The worker is built as the engine builds it (same memory plan, same shape buckets, `Worker.shape_buckets()`), but on
`weights.abstract_model` parameters, so its pools are `jax.ShapeDtypeStruct`s too. For each shape (rows, tokens per
row, blocks per row; tokens 1 is a decode step) the step is lowered (trace + StableHLO) and compiled (XLA), each
timed; a table per shape and the totals are printed, and JSON is written with `num_shapes` (the whole grid),
`per_shape_s` (lower + compile of each measured shape, in the order of `shapes`) and `total_s`. Sampling is its own
executable, one per rows bucket (`Worker.sample_buckets()`): those are timed too (`sampling`) and count in the total.
On the CPU, what the engine builds or measures once per machine (`tuning.resolve_forms`: its kernels' library, the
forms of a bfloat16 model's products, the decode steps' vector width) is done first and timed apart (`choices_s`):
with the cache off it happens in every process, and it would otherwise land in the worker's setup.

Subsets: `--shapes` lists shapes to time; `--limit N` (N >= 2) times N shapes spread over the grid, always including
the largest prefill and the largest decode shape. When not every shape was measured, `total_s` is an extrapolation
(the measured mean per prefill shape times the grid's prefill shapes, the same for decode) and `total_extrapolated`
is true; `measured_total_s` is what was actually timed. `--shapes` of one kind only (prefill or decode) leave the
other kind with no mean to extrapolate from: `total_s` is then null, and the printed total says which kind is missing.

The persistent compilation cache is off by default (`--cache-dir off`), so every shape compiles from scratch (the
figure of a first start). `--cache-dir DIR` turns it on in DIR (every compilation is written, whatever it took).
`--second-start` measures what a second process start costs: it runs this script twice in fresh processes on one new
cache folder (the first fills it, the second reads it) and reports both, with each process's wall time (imports,
model setup and every shape). `--warm-up` times `Worker.warm_up()` as a whole instead (the engine's own warm-up,
which lowers one executable while `--compile-threads` threads, by default one per core, compile the ones before, and
first looks each up in the executable store beside the cache, `gdn_jax.worker.executable_store`): with
`--second-start`, the second start of the engine; `--speculative-tokens K` times the warm-up of the speculating
worker instead (the model with its MTP block, K drafts: a prefill executable per prefill shape and a verify one per
rows bucket). Timing shape by shape (without `--warm-up`) fills JAX's persistent cache but not the executable store;
it times one compilation at a time, so its `total_s` is the sum over shapes, not a warm-up's wall time on a machine
of several cores.

Timings on a shared machine are noisy: repeat a run and read the minimum. `cpu s` (the process's CPU time over all
its threads, `time.process_time`) moves less with the load of other processes than the wall time does; `lower cpu s`
is the part of it spent lowering (JSON `lower_cpu_s`)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T_START = time.perf_counter()

import jax  # noqa: E402

from gdn_jax.backends.cpu import tuning  # noqa: E402
from gdn_jax.entrypoints.cli import nonnegative_int, output_file, positive_int  # noqa: E402
from gdn_jax.worker.compilation import compile_threads_default  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared helpers in common.py
from common import DTYPES, build_worker, parse_shapes, run_command  # noqa: E402


def spread(shapes: list, n: int) -> list:
    """n shapes spread evenly over the grid, always with its largest prefill and largest decode shape."""
    prefill = [s for s in shapes if s[1] > 1]
    decode = [s for s in shapes if s[1] == 1]
    chosen = [max(prefill, default=None), max(decode, default=None)]
    chosen = [s for s in chosen if s is not None][:n]
    rest = [s for s in shapes if s not in chosen]
    k = n - len(chosen)
    if k > 0 and rest:
        chosen += [rest[round(i * (len(rest) - 1) / max(k - 1, 1))] for i in range(min(k, len(rest)))]
    return sorted(set(chosen), key=shapes.index)


def timed(lower, again: bool = False) -> dict:
    """Wall seconds of `lower()` (-> a `jax.stages.Lowered`) and of its compilation, and the process CPU seconds of
    both (over all threads). `again`: the shape was timed before in this process; JAX's in-memory caches are emptied
    first, so that it is lowered and compiled again rather than found (0 s). (Not otherwise: the shapes of a warm-up
    share the traces of the jitted helpers inside the step, as they do here.)"""
    if again:
        jax.clear_caches()
    t0, c0 = time.perf_counter(), time.process_time()
    lowered = lower()
    t1, c1 = time.perf_counter(), time.process_time()
    lowered.compile()
    t2, c2 = time.perf_counter(), time.process_time()
    return {"lower_s": t1 - t0, "compile_s": t2 - t1, "total_s": t2 - t0, "cpu_s": c2 - c0, "lower_cpu_s": c1 - c0}


def row_times(r: dict) -> str:
    return (f"{r['lower_s']:>8.2f} {r['compile_s']:>9.2f} {r['total_s']:>8.2f} {r['cpu_s']:>7.2f} "
            f"{r['lower_cpu_s']:>11.2f}")


def measure(a) -> dict:
    if a.cache_dir != "off":
        jax.config.update("jax_compilation_cache_dir", a.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    else:  # off, whatever the environment says: a JAX_COMPILATION_CACHE_DIR would turn on JAX's cache and the
        # executable store beside it, and every shape compiled before would be read from them
        jax.config.update("jax_compilation_cache_dir", None)
    # the CPU's one-time choices (the kernels' build, the products' forms: measured once per machine and kept, here
    # once per process with the cache off), made before the worker resolves its forms from them and before the first
    # shape, so that neither time holds them
    t0 = time.perf_counter()
    if jax.default_backend() == "cpu":
        tuning.resolve_forms(a.dtype)
    choices_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    worker = build_worker(a)
    setup_s = time.perf_counter() - t0
    grid = worker.shape_buckets()
    if a.shapes:
        shapes = a.shapes
        unknown = [s for s in shapes if s not in grid]
        if unknown:
            raise ValueError(f"--shapes: {unknown} not in the warm-up grid ({len(grid)} shapes, e.g. {grid[-1]})")
    else:
        shapes = spread(grid, a.limit) if a.limit else grid
    print(f"{a.preset} {a.dtype}: {len(grid)} warm-up shapes ({sum(s[1] > 1 for s in grid)} prefill, "
          f"{sum(s[1] == 1 for s in grid)} decode); timing {len(shapes)}; memory {worker.memory.describe()}; "
          f"cache {a.cache_dir}; checkpoint_mode {a.checkpoint_mode}; setup {setup_s:.1f} s; the CPU's one-time "
          f"choices {choices_s:.1f} s")
    if a.warm_up:
        t0, c0 = time.perf_counter(), time.process_time()
        worker.warm_up(prompt_logprobs=a.prompt_logprobs, compile_threads=a.compile_threads)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        stats = getattr(worker, "warm_up_stats", None)  # executables loaded from the store / compiled
        threads = compile_threads_default() if a.compile_threads is None else a.compile_threads
        spec = worker.spec_shapes() if a.speculative_tokens else None
        print(f"Worker.warm_up ({threads} compile threads): {wall:.1f} s ({cpu:.1f} s process CPU time) for "
              + (f"{len(spec)} spec shapes ({a.speculative_tokens} drafts)" if spec else f"{len(grid)} step shapes"
                 + f" + {len(worker.sample_buckets())} sampling shapes")
              + (f"; {stats['loaded']} loaded from the executable store, {stats['compiled']} compiled"
                 if stats else ""))
        return {"mode": "warm_up", "preset": a.preset, "dtype": a.dtype, "cache_dir": a.cache_dir, "setup_s": setup_s,
                "choices_s": choices_s, "num_shapes": len(grid), "grid": [list(s) for s in grid], "per_shape_s": [],
                "total_s": wall,
                "cpu_s": cpu, "compile_threads": threads, "total_extrapolated": False,
                "process_s": time.perf_counter() - T_START, "warm_up_stats": stats,
                "speculative_tokens": a.speculative_tokens, "num_spec_shapes": len(spec) if spec else 0}
    print(f"{'rows':>5} {'tokens':>6} {'blocks':>6} {'saves':>5} {'lower s':>8} {'compile s':>9} {'total s':>8} "
          f"{'cpu s':>7} {'lower cpu s':>11}")
    # sampling: its own executable per rows bucket, shared by the step shapes with that many rows
    # (a worker that samples inside its step, as before the split, has none)
    all_samplers = worker.sample_buckets() if hasattr(worker, "sample_buckets") else []
    samplers = [B for B in all_samplers if any(s[0] == B for s in shapes)] if a.shapes else all_samplers
    sample_rows = []
    jax.clear_caches()  # nothing this process compiled before (in a test, say) is found instead of compiled
    for B in samplers:
        sample_rows.append({"rows": B} | timed(lambda: worker.lowered_sample(B)))
        print(f"{B:>5} {'(sampling)':>19} {row_times(sample_rows[-1])}", flush=True)
    sampling_s = sum(r["total_s"] for r in sample_rows)
    if sample_rows and len(sample_rows) < len(all_samplers):  # extrapolated like the step shapes
        sampling_estimate = (len(all_samplers) - len(sample_rows)) * sampling_s / len(sample_rows)
    else:
        sampling_estimate = 0.0
    rows = []
    for shape in shapes:
        saves = worker.num_saves(*shape[:2]) if hasattr(worker, "num_saves") else 0  # checkpoints the shape writes
        again = any(r["shape"] == list(shape) for r in rows)
        row = {"shape": list(shape), "saves": saves} | timed(lambda: worker.lowered_step(shape), again)
        if a.prompt_logprobs and shape[1] > 1:
            prompt = timed(lambda: worker.lowered_prompt_step(shape), again)
            row |= {"prompt_logprobs_s": prompt["total_s"], "total_s": row["total_s"] + prompt["total_s"],
                    "cpu_s": row["cpu_s"] + prompt["cpu_s"]}
        rows.append(row)
        print(f"{shape[0]:>5} {shape[1]:>6} {shape[2]:>6} {saves:>5} {row_times(row)}", flush=True)
    out = {"preset": a.preset, "dtype": a.dtype, "max_num_seqs": a.max_num_seqs, "max_model_len": a.max_model_len,
           "block_size": a.block_size, "chunk_stride": a.chunk_stride,
           "max_num_batched_tokens": a.max_num_batched_tokens, "checkpoint_mode": a.checkpoint_mode,
           "checkpoint_policy": a.checkpoint_policy, "cache_dir": a.cache_dir,
           "prompt_logprobs": a.prompt_logprobs, "setup_s": setup_s, "choices_s": choices_s, "num_shapes": len(grid),
           "grid": [list(s) for s in grid], "shapes": [r["shape"] for r in rows],
           "per_shape_s": [r["total_s"] for r in rows], "rows": rows, "num_sampling_shapes": len(all_samplers),
           "sampling": sample_rows, "sampling_s": sampling_s,
           # a shape timed more than once (named again in --shapes) counts once, at the median of its times
           "measured_total_s": sum(statistics.median(r["total_s"] for r in rows if tuple(r["shape"]) == s)
                                   for s in dict.fromkeys(tuple(r["shape"]) for r in rows)) + sampling_s}
    for kind, pick in (("prefill", lambda s: s[1] > 1), ("decode", lambda s: s[1] == 1)):
        got = [r for r in rows if pick(r["shape"])]
        out[f"{kind}_shapes"] = sum(map(pick, grid))
        for key in ("lower_s", "compile_s", "total_s", "cpu_s", "lower_cpu_s"):
            vals = sorted(r[key] for r in got)
            out[f"{kind}_{key}"] = ({"min": vals[0], "median": statistics.median(vals), "max": vals[-1],
                                     "mean": sum(vals) / len(vals)} if vals else None)
    done = {tuple(r["shape"]) for r in rows}
    out["total_extrapolated"] = len(done) < len(grid) or sampling_estimate > 0
    estimate, unmeasured = sampling_estimate, []
    for kind in ("prefill", "decode"):
        missing = sum(1 for s in grid if (s[1] > 1) == (kind == "prefill") and s not in done)
        if missing and out[f"{kind}_total_s"] is None:
            unmeasured.append(kind)  # nothing of this kind measured: no honest extrapolation
        elif missing:
            estimate += missing * out[f"{kind}_total_s"]["mean"]
    out["total_s"] = None if unmeasured else out["measured_total_s"] + estimate
    out["process_s"] = time.perf_counter() - T_START
    label = "extrapolated to the whole grid" if out["total_extrapolated"] else "measured"
    total = (f"total {out['total_s']:.1f} s" if out["total_s"] is not None else
             f"no total: no {' or '.join(unmeasured)} shape timed to extrapolate from")
    print(f"{total} over {len(grid)} step shapes + {len(all_samplers)} sampling shapes ({label}; measured {out['measured_total_s']:.1f} s "
          f"over {len(rows)}); process {out['process_s']:.1f} s")
    for kind in ("prefill", "decode"):
        st = out[f"{kind}_total_s"]
        if st:
            print(f"  per {kind} shape: min {st['min']:.2f} s, median {st['median']:.2f} s, max {st['max']:.2f} s "
                  f"(compile alone median {out[f'{kind}_compile_s']['median']:.2f} s; process CPU time median "
                  f"{out[f'{kind}_cpu_s']['median']:.2f} s)")
    return out


def second_start(a, argv: list[str]) -> dict:
    """Two fresh processes on one new cache folder: the first fills it, the second is the measured second start."""
    folder = a.cache_dir if a.cache_dir != "off" else tempfile.mkdtemp(prefix="gdn_jax_compile_cache_")
    runs = []
    for i in range(2):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "run.json"
            args = [arg for arg in argv if arg != "--second-start"]
            t0 = time.perf_counter()
            subprocess.run([sys.executable, __file__, *args, "--cache-dir", folder, "--out", str(out)], check=True)
            wall = time.perf_counter() - t0
            runs.append(json.loads(out.read_text()) | {"wall_s": wall})
        total = runs[-1]["total_s"]  # None: --shapes of one kind, nothing to extrapolate the other from
        timed_s = f"{total:.1f} s" if total is not None else f"{runs[-1]['measured_total_s']:.1f} s (shapes timed)"
        print(f"start {i + 1}: {timed_s} warming up after the CPU's one-time choices ({runs[-1]['choices_s']:.1f} s), "
              f"process wall {wall:.1f} s", flush=True)
    first, second = runs
    size = sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())
    return {"mode": "second_start", "cache_dir": folder, "cache_bytes": size, "first": first, "second": second,
            "num_shapes": second["num_shapes"], "per_shape_s": second["per_shape_s"], "total_s": second["total_s"],
            "second_start_wall_s": second["wall_s"]}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="qwen3.5-9b", help="model preset (random weights are never built)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="activation and weight dtype")
    p.add_argument("--max-num-seqs", type=positive_int, default=16, help="engine max_num_seqs (the rows buckets)")
    p.add_argument("--max-model-len", type=positive_int, default=4096, help="engine max_model_len (the block tables' width)")
    p.add_argument("--block-size", type=positive_int, default=16, help="KV block size")
    p.add_argument("--chunk-stride", type=positive_int, default=64, help="engine chunk_stride (checkpoint boundaries)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=None, help="engine max_num_batched_tokens (default "
                   "max(chunk_stride, 2048)): in checkpoint mode 'scan' the largest prefill row and the grid's bound")
    p.add_argument("--checkpoint-mode", default="scan", choices=("scan", "promote"), help="engine checkpoint_mode "
                   "('promote': prefill rows of at most chunk_stride tokens, no saves)")
    p.add_argument("--checkpoint-policy", default="all", choices=("all", "last"), help="engine checkpoint_policy")
    p.add_argument("--shapes", default="", help="comma-separated ROWSxTOKENSxBLOCKS shapes to time, a "
                   "shape named twice timed twice (default: all)")
    p.add_argument("--limit", type=nonnegative_int, default=0, help="time N shapes spread over the grid, the largest "
                   "prefill and decode shapes among them (N >= 2; 0: all)")
    p.add_argument("--prompt-logprobs", action="store_true", help="also compile the prompt-logprobs step per prefill "
                   "shape (as warm_up(prompt_logprobs=True)); its time counts in the shape's total")
    p.add_argument("--warm-up", action="store_true", help="time Worker.warm_up() as a whole (lowering overlapped "
                   "with compilation, as the engine warms up) instead of shape by shape")
    p.add_argument("--compile-threads", type=positive_int, default=None, help="with --warm-up: threads compiling at once "
                   "(default: Worker.warm_up's, the cores this process may use)")
    p.add_argument("--speculative-tokens", type=nonnegative_int, default=0, help="with --warm-up: the speculating "
                   "worker with this many MTP drafts (its prefill and verify executables; 0: off)")
    p.add_argument("--cache-dir", default="off", help="persistent compilation cache folder, or 'off' (default)")
    p.add_argument("--second-start", action="store_true", help="run twice in fresh processes on one new cache "
                   "folder (or --cache-dir) and report the second start")
    p.add_argument("--out", type=output_file, default=None,
                   help="JSON output (default results/bench_compile_<preset>.json)")
    a = p.parse_args(argv)
    if a.shapes:
        try:
            a.shapes = parse_shapes(a.shapes)  # parsed once, here: measure() takes the list
        except ValueError as e:
            p.error(str(e))
    if a.chunk_stride % a.block_size:  # the engine's rule (the worker built here from shapes alone skips its checks)
        p.error(f"--chunk-stride ({a.chunk_stride}) must be a multiple of --block-size ({a.block_size})")
    # flags that would go unused: the run would not be the one asked for
    if a.shapes and a.limit:
        p.error("--limit picks shapes from the grid: give it or --shapes, not both")
    if a.warm_up and (a.shapes or a.limit):
        p.error(f"--warm-up times the whole grid: {'--shapes' if a.shapes else '--limit'} does not apply")
    if a.speculative_tokens and not a.warm_up:
        p.error("--speculative-tokens applies to --warm-up (the spec executables are not timed shape by shape)")
    if a.compile_threads is not None and not a.warm_up:
        p.error("--compile-threads applies to --warm-up (shape by shape, one compilation runs at a time)")
    if a.limit == 1:  # spread() keeps the largest prefill shape and drops the decode ones: no decode total
        p.error("--limit 1: the largest prefill and the largest decode shape are always timed: give 2 or more "
                "(0: the whole grid)")
    result = second_start(a, argv) if a.second_start else measure(a)
    result |= {"jax": jax.__version__, "backend": jax.default_backend(), "cpus": os.cpu_count(),
               "loadavg": os.getloadavg()}
    out = Path(a.out or f"results/bench_compile_{a.preset}{'_second_start' if a.second_start else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    run_command(main)
