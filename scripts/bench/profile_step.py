"""Where an engine step's time goes: prefill steps of new prompts through `LLMEngine.step`, by part of the model,
with the step's sampling and host time beside them.

    .venv/bin/python scripts/bench/profile_step.py [--preset hybrid-1024] [--tokens 256] [--rows 1]
                                                   [--dtypes float32,bfloat16] [--steps 8] [--runs 3]
                                                   [--out results/profile_step.json]

Each step takes `--rows` fresh random prompts of `--tokens` tokens (no cached prefix; the engine's defaults, prefix
caching on, so the step also writes its checkpoints) and samples their first token (greedy). After two untimed steps
(compilation), `--steps` steps are timed and `--runs` more are traced with the JAX profiler. Per dtype it reports:

- `wall`: `engine.step()`, median over the timed steps (the requests are added before the clock starts);
- `host`: the step's wall time less the time the host waits for the device (from the return of each asynchronous
  jitted call, the forward's and sampling's, to its outputs being ready): scheduling, padding, dispatch,
  postprocess;
- per part of the model, the self time of the step executable's ops (`common.PARTS`: projections,
  gdn_rule, conv, gdn_state, attention, norms_elementwise, logits, other), and `sampling`, that of the sampling
  executable. On two cores the ops of both threads add up to more than the device time; shares are of that sum.

Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

from gdn_jax import LLMEngine, SamplingParams
from gdn_jax.entrypoints.cli import output_file, positive_int

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared helpers in common.py
from common import (PARTS, BlockTimer, compiled_text, dtype_names, op_parts, part_times, run_command,  # noqa: E402
                    self_times, trace_events)


def profile_dtype(args, dtype: str) -> dict:
    engine = LLMEngine(args.preset, dtype=dtype, max_num_seqs=args.rows, max_model_len=args.tokens + 16)
    budget = engine.scheduler_config.max_num_batched_tokens
    if args.rows * args.tokens > budget:  # found now, not by the first step, after its compilation
        raise ValueError(f"--rows ({args.rows}) x --tokens ({args.tokens}) exceeds the {budget} tokens the engine "
                         "prefills in one step")
    worker = engine.worker
    functions = worker.step_functions()
    timer, sampler = BlockTimer(functions["prefill"]), BlockTimer(functions["sample"])
    worker.replace_functions(prefill=timer, sample=sampler)
    rng = np.random.default_rng(0)
    count = [0]

    def add():
        for _ in range(args.rows):
            count[0] += 1
            engine.add_request(str(count[0]), rng.integers(4, engine.cfg.vocab_size - 4, args.tokens).tolist(),
                               SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))

    def step():
        outputs = engine.step()
        info = engine.last_step_info
        if not (info["is_prefill"] and info["rows"] == args.rows and info["tokens"] == args.rows * args.tokens
                and len(outputs) == args.rows and all(o.finished for o in outputs)):
            raise RuntimeError(f"the step did not prefill {args.rows} x {args.tokens} tokens in one go: {info} "
                               "(raise the engine's token budget or lower --rows / --tokens)")

    for _ in range(2):
        add()
        step()
    walls, host = [], []
    for _ in range(args.steps):
        add()
        timer.blocked.clear()
        sampler.blocked.clear()
        t0 = time.perf_counter()
        step()
        walls.append(time.perf_counter() - t0)
        host.append(walls[-1] - sum(timer.blocked) - sum(sampler.blocked))

    def traced():
        add()
        step()

    events, _ = trace_events(traced, args.runs)
    sample_module = f"jit_{sampler.fn.__name__}"
    sampling = sum(self_times(events, sample_module, args.runs).values())
    step_ms = self_times(events, "jit_step", args.runs)
    parts = op_parts(compiled_text(*timer.last[0]))[0]
    by_part = dict.fromkeys(PARTS, 0.0) | part_times(step_ms, parts)
    by_part["sampling"] = sampling
    total = sum(by_part.values())
    return {"dtype": dtype, "wall_ms_median": 1e3 * statistics.median(walls), "wall_ms_min": 1e3 * min(walls),
            "host_ms_median": 1e3 * statistics.median(host), "op_ms_total": total, "parts_ms": by_part,
            "parts_share": {p: t / total if total else 0.0 for p, t in by_part.items()}}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="profile_step.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="hybrid-1024", help="model preset, random weights (default: %(default)s)")
    ap.add_argument("--tokens", type=positive_int, default=256, help="prompt tokens per row (default: %(default)s)")
    ap.add_argument("--rows", type=positive_int, default=1, help="prompts per step (default: %(default)s)")
    ap.add_argument("--dtypes", type=dtype_names, default="float32,bfloat16", help="dtypes, comma-separated (default: %(default)s)")
    ap.add_argument("--steps", type=positive_int, default=8, help="timed steps per dtype (default: %(default)s)")
    ap.add_argument("--runs", type=positive_int, default=3, help="traced steps per dtype (default: %(default)s)")
    ap.add_argument("--out", type=output_file, default="results/profile_step.json",
                    help="JSON output (default: %(default)s)")
    args = ap.parse_args(argv)

    results = [profile_dtype(args, dtype) for dtype in args.dtypes]
    print(f"\n{args.preset}: prefill steps of {args.rows} x {args.tokens} new tokens + sampling")
    print(f"{'':22s}" + "".join(f"{r['dtype']:>20s}" for r in results))
    for key, label in (("wall_ms_median", "step wall (median)"), ("host_ms_median", "host (median)"),
                       ("op_ms_total", "op time (both threads)")):
        print(f"{label:22s}" + "".join(f"{r[key]:17.1f} ms" for r in results))
    for part in (*PARTS, "sampling"):
        print(f"  {part:20s}" + "".join(f"{r['parts_ms'][part]:9.1f} ms {100 * r['parts_share'][part]:5.1f}%"
                                        for r in results))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"preset": args.preset, "tokens": args.tokens, "rows": args.rows,
                               "jax": jax.__version__, "backend": jax.default_backend(), "results": results},
                              indent=1))
    print(f"wrote {out}")
    return results


if __name__ == "__main__":
    run_command(main)
