"""Decode step time and tokens/s through `LLMEngine.step`, beside the memory-bandwidth bound of each step.

    .venv/bin/python scripts/bench/bench_decode.py [--preset hybrid-1024] [--layers N] [--vocab-size V] [--prompt 512]
                                                   [--batches 1,4,16,64] [--dtypes float32,bfloat16] [--steps 12]
                                                   [--bandwidth GBPS] [--max-num-seqs 64] [--max-num-batched-tokens N]
                                                   [--chunk-stride 256] [--probe-mib 512]
                                                   [--peak float32=GFLOPS,bfloat16=GFLOPS]
                                                   [--out results/bench_decode.json]

For each dtype one engine (`--max-num-seqs` 64 and the default memory budget, so the state pools are as large as a
serving engine's) prefills `batch` random `--prompt`-token prompts, then runs greedy decode steps; after two
untimed steps (compilation, the deferred checkpoint save at the prompt's end) `--steps` steps are timed as the engine
runs them, `--steps` more through wrappers that split each step's time (`host`, `python` below), then
`--profile-steps` more are traced with the JAX profiler. While the later rows prefill, the first ones already decode
(mixed steps), so by the timed steps the rows hold different contexts: the bound and the compute floor use their mean
over the timed steps (`context_tokens`). Each request may generate 256 tokens; a decode step of fewer rows (a row
that ran out of them during a long prefill or the steps before, or a KV pool too small for the batch), timed,
wrapped or traced, stops the script with a message.

Per configuration it reports:
- `step`: wall time of `engine.step()` (scheduler + worker + postprocess), min and median over the timed steps,
  which run unwrapped: the engine dispatches sampling while the step's device work still runs;
- `host` and `python` come from the wrapped steps, which wait for each jitted call's outputs before going on (so a
  wrapped step takes a little longer than a timed one: sampling's dispatch no longer overlaps the step's work; their
  median is `wrapped_step_ms_median` in the JSON);
- `host`: the wrapped step's wall time minus the time the host waits for the device (from the return of each
  asynchronous jitted call, the step's and sampling's, to its outputs being ready): scheduling, padding, argument
  handling, dispatch, postprocess (median). On the CPU backend the host shares the cores with the device's threads, which
  are still busy or spinning when a call is dispatched (sampling's dispatch: ~0.1 ms on an idle machine, ~0.3 ms
  in a step), so this reads above the host's own work;
- `python`: the wrapped step's wall time minus the whole of the two jitted calls (dispatch included): the engine's
  own Python work per step, scheduling, argument building and postprocess (median);
- `critical`: the host's part of an unwrapped timed step's critical path, nothing waited for (`Marks`): from the
  step's start until the step executable's call returned (scheduling, padding, dispatch) plus from the results'
  arrival on the host until the step's end (postprocess, outputs); sampling's dispatch, between them, runs while the
  device computes (median). On the CPU backend that dispatch still takes a core from the step's threads, so the
  device part reads a little longer than it would run alone;
- `bound`: the bytes a decode step must move (every weight except the embedding table, of which only the batch's
  rows are read; the KV of the real context; the GDN conv + SSM state, read and written) in the model's dtype,
  divided by the read bandwidth: `--bandwidth` GB/s if given, else the larger of 16 GB/s (the development
  machine's figure) and the fastest read probe measured at the start (`measure_read_bandwidth`: the engine's own
  one-row product among them, at either vector width; on the AMD EPYC development machines 31-40 GB/s, where XLA's
  library matrix-vector routine reads 21-26; a busy machine reads low). `x bound` = median step / bound;
- `compute`: the step's multiply-adds (every matrix, the LM head included, times the batch's rows; attention over
  the real context; the GDN rule) divided by the machine's matmul rate in the model's dtype, measured at the start
  on the model's projection shapes at 512 rows (`common.matmul_peak`; `--peak` GFLOP/s per dtype overrides
  it): a floor of its own where
  the rows are many, or the hardware multiplies slowly (16 rows of bfloat16 on a CPU without matrix units do about
  16 multiply-adds per weight byte). `x compute` = median step / compute;
- the XLA op self time of a traced step (an op's time less that of the ops nested in it: loop and conditional
  bodies) summed by kind (copy, dot, convert, fusion, scatter, sort, ...) and by part of the model (projections,
  gdn_rule, conv, gdn_state, attention, norms_elementwise, logits, other: `common.PARTS`). On two cores the ops of
  both threads add up to more than the step's wall time.

Prints a table and writes JSON. Timings on a shared machine are noisy: read the minimum beside the median.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdn_jax import LLMEngine, SamplingParams
from gdn_jax.backends.cpu import library
from gdn_jax.entrypoints.cli import nonnegative_int, output_file, positive_int, positive_ints
from gdn_jax.config import PRESETS, ModelConfig, get_preset, hybrid_layer_types

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared helpers in common.py
from common import (BlockTimer, Stub, compiled_text, decode_bytes, dtype_names, matmul_peak,  # noqa: E402
                    measure_read_bandwidth, op_kind, op_parts, part_times, run_command, self_times, trace_events)


def decode_flops(engine: LLMEngine, batch: int, context: int) -> float:
    """Floating-point operations (2 per multiply-add) of one decode step of `batch` rows at `context` tokens: every
    matrix (the conv taps included, and the embedding table only where it is the LM head), attention's scores and
    values over the context, and the GDN rule's products on each state (decay, two reads, one rank-1 write)."""
    cfg = engine.cfg
    pure = nnx.to_pure_dict(engine.worker.params)
    matrices = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(pure) if p.ndim == 2)
    if not cfg.tie_word_embeddings:
        matrices -= cfg.vocab_size * cfg.hidden_size
    attention = 2 * 2 * len(cfg.full_layer_ids) * context * cfg.num_attention_heads * cfg.head_dim
    state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    gdn = 2 * 4 * len(cfg.linear_layer_ids) * state
    return float(batch * (2 * matrices + attention + gdn))


class Marks:
    """Times an unwrapped engine step's critical path: when the step executable's call returned (the device has the
    step; `launched`) and when the worker had its results on the host (`fetched`, after its step function "fetch").
    The host work before the first and after the second is what the device waits for; the sampling's dispatch between
    them runs while the device computes the step (JAX dispatches asynchronously). Nothing is waited for here."""

    def __init__(self, worker, plain: dict):
        self.worker, self.launched, self.fetched = worker, None, None
        fetch = worker.step_functions()["fetch"]

        def fetched(launched):
            out = fetch(launched)
            self.fetched = time.perf_counter()
            return out

        def stamped(fn):
            def call(*args):
                out = fn(*args)
                self.launched = time.perf_counter()
                return out
            return Stub(fn, call)

        self.replaced = worker.replace_functions(fetch=fetched, decode=stamped(plain["decode"]),
                                                 decode_wide=stamped(plain["decode_wide"]))

    def clear(self):
        self.launched = self.fetched = None

    def remove(self):
        self.worker.replace_functions(**self.replaced)


def profile_steps(step, n: int, module: str, hlo_text: str) -> dict:
    """Traces `n` calls of `step` (an engine step): the XLA self time of the step executable `module` per step, summed by op kind
    (`op_kind`, with the op counts) and by part of the model (`common.op_parts` on the executable's compiled
    text; "unattributed": ops the text does not name)."""
    events, _ = trace_events(step, n)
    ms = self_times(events, module, n)
    calls = collections.Counter(e["args"]["hlo_op"] for e in events
                                if e.get("ph") == "X" and (e.get("args") or {}).get("hlo_module") == module)
    kind_ms, count = collections.Counter(), collections.Counter()
    for op, t in ms.items():
        kind = op_kind(op)
        kind_ms[kind] += t
        count[kind] += calls[op] / n
    part_ms = part_times(ms, op_parts(hlo_text)[0], "unattributed")
    return {"op_ms": dict(kind_ms), "op_count": dict(count), "part_ms": dict(part_ms)}


def model_config(args) -> ModelConfig:
    """The preset, with `--layers` (the Qwen3.5 layout: every fourth layer full attention) and `--vocab-size` if
    given: a wide model's step at a depth and vocabulary this machine holds."""
    cfg = get_preset(args.preset)
    if args.layers:
        cfg = dataclasses.replace(cfg, layer_types=hybrid_layer_types(args.layers))
    if args.vocab_size:
        cfg = dataclasses.replace(cfg, vocab_size=args.vocab_size)
    return cfg


def run_dtype(args, dtype: str, bandwidth: float) -> list[dict]:
    batches = args.batches
    room = 256  # tokens a request may generate after its prompt (max_model_len - prompt)
    engine = LLMEngine(model_config(args), dtype=dtype, max_num_seqs=args.max_num_seqs,
                       chunk_stride=args.chunk_stride, max_model_len=args.prompt + room,
                       max_num_batched_tokens=args.max_num_batched_tokens, verbose=True)
    peak = args.peak.get(dtype) or 1e9 * matmul_peak(engine.cfg, 512, jnp.dtype(dtype))["gflops"]
    print(f"  {dtype} matmul rate: {peak / 1e9:.0f} GFLOP/s ({'given' if args.peak.get(dtype) else 'measured now'})")
    worker = engine.worker
    plain = {kind: fn for kind, fn in worker.step_functions().items() if kind in ("decode", "decode_wide", "sample")}
    module = f"jit_{plain['decode'].__name__}"  # the decode step executable's name in the profile
    timer = BlockTimer(plain["decode"])
    # decode steps of many rows are their own jitted function (other compile options): one record for both;
    # sampling is its own executable: its wait is device time too
    sampler = BlockTimer(plain["sample"])
    wrapped = {"decode": timer, "sample": sampler,
               "decode_wide": BlockTimer(plain["decode_wide"], timer.blocked, timer.last, timer.calls)}
    vocab = engine.cfg.vocab_size
    rng = np.random.default_rng(0)
    rows = []
    for batch in batches:
        for i in range(batch):
            # as many tokens as the context allows: the first rows decode while the later ones prefill (mixed
            # steps), for as many steps as the prefill takes; the rows are aborted once measured
            engine.add_request(f"{batch}-{i}", rng.integers(4, vocab - 4, args.prompt).tolist(),
                               SamplingParams(temperature=0.0, max_tokens=room, ignore_eos=True))
        while True:  # prefill every row
            engine.step()
            if not engine.last_step_info["is_prefill"]:
                break

        def decode_step(batch=batch):
            """One engine step, which must decode every row of the batch."""
            engine.last_step_info = {"rows": 0, "is_prefill": False}  # a step with no rows leaves it as it was
            engine.step()
            info = engine.last_step_info
            if info["rows"] != batch or info["is_prefill"]:
                raise SystemExit(f"batch {batch}: a decode step ran {info['rows']} rows"
                                 f"{' with prefill' if info['is_prefill'] else ''}, not {batch} decode rows: a row "
                                 f"finished or was preempted (its {room} tokens of room after the prompt ran out "
                                 "while the other rows prefilled, or the KV pool is too small for the batch)")

        for _ in range(2):  # untimed: compile + the deferred save at the prompt's end
            decode_step()
        steps, wrapped_steps, host, python, contexts, critical = [], [], [], [], [], []
        marks = Marks(worker, plain)
        for _ in range(args.steps):  # the engine's own steps: `step`
            # a row's context in a decode step: its tokens so far, the one the step feeds included (its KV is
            # written and read in the step); the token the step samples is not
            contexts.append(statistics.mean(len(s.token_ids) for s in engine.scheduler.running))
            marks.clear()
            t0 = time.perf_counter()
            decode_step()
            t1 = time.perf_counter()
            steps.append(t1 - t0)
            critical.append(marks.launched - t0 + t1 - marks.fetched)
        marks.remove()
        worker.replace_functions(**wrapped)
        for _ in range(args.steps):  # as many again through the wrappers, each waited for: the split of the step
            for t in (timer, sampler):
                t.blocked.clear()
                t.calls.clear()
            t0 = time.perf_counter()
            decode_step()
            wall = time.perf_counter() - t0
            wrapped_steps.append(wall)
            host.append(wall - sum(timer.blocked) - sum(sampler.blocked))
            python.append(wall - sum(timer.calls) - sum(sampler.calls))
        worker.replace_functions(**plain)
        context = round(statistics.mean(contexts))  # the rows' mean over the timed steps
        prof = (profile_steps(decode_step, args.profile_steps, module, compiled_text(*timer.last[0]))
                if args.profile_steps else {"op_ms": {}, "op_count": {}, "part_ms": {}})
        need = decode_bytes(engine, batch, context)
        bound = need["total"] / bandwidth
        flops = decode_flops(engine, batch, context)
        med = statistics.median(steps)
        row = {"dtype": dtype, "batch": batch, "layers": engine.cfg.num_hidden_layers, "context_tokens": context,
               "vocab_size": engine.cfg.vocab_size, "step_ms_min": 1e3 * min(steps), "step_ms_median": 1e3 * med,
               "host_ms_median": 1e3 * statistics.median(host), "host_ms_min": 1e3 * min(host),
               "python_ms_median": 1e3 * statistics.median(python),
               "critical_host_ms_median": 1e3 * statistics.median(critical),
               "critical_host_ms_min": 1e3 * min(critical),
               "wrapped_step_ms_median": 1e3 * statistics.median(wrapped_steps),  # the steps host and python split
               "tokens_per_s": batch / med, "bytes_per_step": need,
               "bound_ms": 1e3 * bound, "x_bound": med / bound, "flops_per_step": flops,
               "matmul_flops_per_s": peak, "compute_ms": 1e3 * flops / peak, "x_compute": med * peak / flops,
               "profile": prof}
        rows.append(row)
        for i in range(batch):
            engine.abort_request(f"{batch}-{i}")
        print(f"  {dtype:9s} batch {batch:3d}: step {row['step_ms_min']:7.1f} min {row['step_ms_median']:7.1f} med ms"
              f" | host {row['host_ms_median']:5.2f} ms (python {row['python_ms_median']:4.2f}, critical "
              f"{row['critical_host_ms_median']:4.2f})"
              f" | {row['tokens_per_s']:7.1f} tok/s"
              f" | bound {row['bound_ms']:5.1f} ms ({need['total'] / 1e6:.0f} MB) x{row['x_bound']:.2f}"
              f" | compute {row['compute_ms']:5.1f} ms ({flops / 1e9:.2f} GFLOP) x{row['x_compute']:.2f}", flush=True)
        kinds = sorted(prof["op_ms"].items(), key=lambda kv: -kv[1])
        if not kinds:  # --profile-steps 0
            continue
        print("    op self time per step by kind (ms, count): "
              + ", ".join(f"{k} {v:.1f} ({prof['op_count'][k]:.0f})" for k, v in kinds))
        print("    by part (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(prof["part_ms"].items(),
                                                                               key=lambda kv: -kv[1])))
    return rows


def positive_float(text: str) -> float:
    """An argparse type: a number above 0 (a rate: 0 would be no rate at all, and read as "measure it")."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a positive rate")
    return value


def parse_peaks(text: str) -> dict[str, float]:
    """`--peak`: "float32=186,bfloat16=367" -> {dtype: FLOP/s}."""
    peaks = {}
    for item in filter(None, text.split(",")):
        dtype, _, value = item.partition("=")
        try:
            peaks[dtype] = 1e9 * positive_float(value)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"{item!r}: expected DTYPE=GFLOPS, GFLOPS above 0, e.g. float32=186"
                                             ) from None
    return peaks


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="hybrid-1024", choices=sorted(PRESETS), help="model preset (default: %(default)s)")
    ap.add_argument("--layers", type=nonnegative_int, default=0,
                    help="decoder layers instead of the preset's, in the Qwen3.5 layout (default: the preset's)")
    ap.add_argument("--vocab-size", type=nonnegative_int, default=0, help="vocabulary instead of the preset's")
    ap.add_argument("--prompt", type=positive_int, default=512, help="prompt tokens per request (default: %(default)s)")
    ap.add_argument("--batches", type=positive_ints, default="1,4,16,64", help="decode batch sizes, comma-separated (default: %(default)s)")
    ap.add_argument("--dtypes", type=dtype_names, default="float32,bfloat16", help="dtypes, comma-separated (default: %(default)s)")
    ap.add_argument("--steps", type=positive_int, default=12, help="timed decode steps (default: %(default)s)")
    ap.add_argument("--chunk-stride", type=positive_int, default=256, help="tokens between checkpoints (default: %(default)s)")
    ap.add_argument("--max-num-seqs", type=positive_int, default=64, help="engine max_num_seqs (default: %(default)s)")
    ap.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                    help="engine max_num_batched_tokens: prefill tokens per step (default: the engine's)")
    ap.add_argument("--bandwidth", type=positive_float, default=None,
                    help="read bandwidth (GB/s) of the bound (default: the larger of 16 and the fastest float32 "
                         "read probe measured at the start)")
    ap.add_argument("--probe-mib", type=positive_int, default=512,
                    help="MiB of float32 the bandwidth probe reads (default: %(default)s)")
    ap.add_argument("--peak", default="", type=parse_peaks,
                    help="matmul rate (GFLOP/s) per dtype for the compute floor, e.g. float32=186,bfloat16=367 "
                         "(default: measured at the start of each dtype)")
    ap.add_argument("--profile-steps", type=nonnegative_int, default=3,
                    help="steps traced for the op kinds and parts; 0: no trace (default: %(default)s)")
    ap.add_argument("--out", type=output_file, default="results/bench_decode.json",
                    help="JSON output (default: %(default)s)")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.peak) - set(args.dtypes))
    if unknown:  # a rate for no dtype measured (a misspelt name) would leave the floor measured without a word
        ap.error(f"--peak: {', '.join(unknown)} not among --dtypes ({','.join(args.dtypes)})")
    if max(args.batches) > args.max_num_seqs:  # it was raised without a word: the engine measured was not the one asked
        ap.error(f"--max-num-seqs {args.max_num_seqs} is below the largest of --batches ({max(args.batches)}): a step "
                 f"runs at most max_num_seqs rows")

    bw = measure_read_bandwidth(args.probe_mib)
    bandwidth = args.bandwidth * 1e9 if args.bandwidth else max(16e9, bw["best"])
    print("read bandwidth measured now: " + ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in bw.items() if k != "best")
          + f"; the bound uses {bandwidth / 1e9:.1f} GB/s")
    kernel = library.available()  # the GDN decode update and decode attention: compiled CPU kernels, or XLA's
    print(f"GDN decode update and decode attention: {'the compiled CPU kernels' if kernel else 'XLA'} "
          f"({library.KERNELS_ENV}={os.environ.get(library.KERNELS_ENV, '')!r})")
    rows = []
    for dtype in args.dtypes:
        rows += run_dtype(args, dtype, bandwidth)

    print(f"\n{'dtype':9s} {'batch':>5s} {'step min':>9s} {'step med':>9s} {'host':>6s} {'python':>6s} "
          f"{'critical':>8s} {'tok/s':>8s} "
          f"{'MB/step':>8s} {'bound':>6s} {'x bound':>7s} {'compute':>7s} {'x compute':>9s}")
    for r in rows:
        print(f"{r['dtype']:9s} {r['batch']:5d} {r['step_ms_min']:8.1f}m {r['step_ms_median']:8.1f}m "
              f"{r['host_ms_median']:5.2f}m {r['python_ms_median']:5.2f}m {r['critical_host_ms_median']:7.2f}m "
              f"{r['tokens_per_s']:8.1f} "
              f"{r['bytes_per_step']['total'] / 1e6:8.0f} "
              f"{r['bound_ms']:5.1f}m {r['x_bound']:7.2f} {r['compute_ms']:6.1f}m {r['x_compute']:9.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"preset": args.preset, "prompt": args.prompt, "max_num_seqs": args.max_num_seqs,
                               "measured_bandwidth": bw,
                               "bound_bandwidth_bytes_per_s": bandwidth, "jax": jax.__version__,
                               "backend": jax.default_backend(), "cpu_kernels": kernel, "rows": rows},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    run_command(main)
