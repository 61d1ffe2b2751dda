"""XLA compile options against the step's compile time and run time, in one process, interleaved.

    .venv/bin/python scripts/bench/bench_compile_options.py [--preset hybrid-1024] [--dtypes bfloat16,float32]
                                                            [--repeats 5] [--shapes 1x2048,16x1,16x64] [--context 1024]
                                                            [--sets "NAME;NAME"]
                                                            [--out results/bench_compile_options.json]

Each option set (`OPTION_SETS`: XLA's defaults, the engine's options `worker.LLVM_IR_CPU_COMPILER_OPTIONS`, those
with LLVM's O1 and O0 pipelines, XLA's defaults with O1, and with 512-bit vectors: the engine's narrow decode steps where
that width is the faster, `Forms.decode_vector_bits`; `--sets` picks some)
compiles the engine's step (`Worker.lowered_step(...).compile(compiler_options=...)`, with JAX's persistent cache off)
for each shape on real (random) weights; then the executables run in turn, A B C A B C ...,
`--repeats` times each, so that the load of other processes falls on every set alike. A prefill shape runs full rows
of `tokens` tokens from position 0; a decode shape runs rows that attend to `--context` cached tokens. Reports compile
seconds and run milliseconds (wall min and median; process CPU median, which moves less with the load) per set and
shape, and whether the logits are bitwise those of XLA's defaults (else the largest difference). Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

from gdn_jax.engine import LLMEngine
from gdn_jax.entrypoints.cli import output_file, positive_int
from gdn_jax.model.state import Batch, RestoreOps
from gdn_jax.worker import executable_store as executables
from gdn_jax.worker.compilation import LLVM_IR_CPU_COMPILER_OPTIONS, vector_width_options
from gdn_jax.worker.step import host_batch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared helpers in common.py
from common import run_command  # noqa: E402

# each set overrides the jitted step's own options (worker.compiler_options: JAX appends a set's options to those), so
# every option is spelled out; 256 bits is XLA's preferred vector width, optimisation level 3 its default
WIDTH_256 = {"xla_cpu_prefer_vector_width": 256}
WIDTH_512 = {"xla_cpu_prefer_vector_width": 512}
O3, O2, O1, O0 = ({"xla_backend_optimization_level": level} for level in (3, 2, 1, 0))
OPTION_SETS = {
    "xla defaults": {"xla_cpu_use_fusion_emitters": True} | WIDTH_256 | O3,
    "LLVM IR emitters": LLVM_IR_CPU_COMPILER_OPTIONS | WIDTH_256 | O3,  # the engine's sampling
    "LLVM IR emitters, LLVM O2": LLVM_IR_CPU_COMPILER_OPTIONS | WIDTH_256 | O2,
    # the engine's prefill steps (worker.PREFILL_OPT_LEVEL)
    "LLVM IR emitters, LLVM O1": LLVM_IR_CPU_COMPILER_OPTIONS | WIDTH_256 | O1,
    "LLVM IR emitters, LLVM O0": LLVM_IR_CPU_COMPILER_OPTIONS | WIDTH_256 | O0,
    "xla defaults, LLVM O1": {"xla_cpu_use_fusion_emitters": True} | WIDTH_256 | O1,
    "xla defaults, 512-bit vectors": {"xla_cpu_use_fusion_emitters": True} | WIDTH_512 | O3,
    # the engine's decode steps of fewer than DECODE_DEFAULT_EMITTER_ROWS rows: the LLVM IR emitters at the width
    # `tuning.decode_vector_bits` measures the faster (256 bits: "LLVM IR emitters")
    "LLVM IR emitters, 512-bit vectors": vector_width_options(512) | O3,
    "LLVM IR emitters, 512-bit vectors, LLVM O2": vector_width_options(512) | O2,
    "LLVM IR emitters, 512-bit vectors, LLVM O1": vector_width_options(512) | O1,
}


def step_args(worker, rows: int, tokens: int, context: int, rng) -> Batch:
    """The `Batch` of a step of `rows` full rows of `tokens` tokens after `context` tokens each (their KV in
    distinct blocks; live slots 1..rows, cold)."""
    bs, NB = worker.block_size, worker.max_blocks
    per_row = -(-(context + tokens) // bs)
    tables = np.zeros((rows, NB), np.int32)
    for b in range(rows):
        tables[b, :per_row] = 1 + b * per_row + np.arange(per_row)
    positions = context + np.arange(tokens)
    slot_mapping = (tables[:, positions // bs] * bs + positions % bs).astype(np.int32)
    lengths = np.full(rows, tokens, np.int32)
    ops = RestoreOps.from_ops([], rows)
    ops.linear_state_ids[:] = 1 + np.arange(rows)
    return host_batch(rng.integers(0, worker.cfg.vocab_size, (rows, tokens), dtype=np.int32),
                      np.full(rows, context, np.int32), lengths, tables, slot_mapping, ops,
                      worker.padding_saves(rows, tokens))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="hybrid-1024",
                  help='model preset, random weights (default: %(default)s)')
    p.add_argument("--dtypes", default="bfloat16,float32",
                  help='dtypes, comma-separated (default: %(default)s)')
    p.add_argument("--shapes", default="1x2048,16x1,16x64", help="ROWSxTOKENS,... (tokens 1: decode) (default: %(default)s)")
    p.add_argument("--context", type=positive_int, default=1024, help="cached tokens before a decode row (default: %(default)s)")
    p.add_argument("--repeats", type=positive_int, default=5,
                  help='timed runs per option set and shape, after a warm-up round (default: %(default)s)')
    p.add_argument("--sets", default="", help="names of the option sets to run, ';'-separated (default: all; "
                  "XLA's defaults always run, as the reference of the logits)")
    p.add_argument("--out", type=output_file, default="results/bench_compile_options.json",
                  help='JSON output (default: %(default)s)')
    a = p.parse_args(argv)
    shapes = [tuple(int(n) for n in s.split("x")) for s in a.shapes.split(",")]
    names = a.sets.split(";") if a.sets else list(OPTION_SETS)
    if unknown := [n for n in names if n not in OPTION_SETS]:
        p.error(f"unknown option sets {unknown}; the sets are {list(OPTION_SETS)}")
    sets = {n: OPTION_SETS[n] for n in ["xla defaults"] + [n for n in names if n != "xla defaults"]}
    rng, results = np.random.default_rng(0), []
    for dtype in a.dtypes.split(","):
        engine = LLMEngine(a.preset, dtype=dtype, max_num_seqs=16, max_model_len=4096, verbose=False)
        worker = engine.worker
        for rows, tokens in shapes:
            shape = (rows, tokens, worker.max_blocks)
            batch = step_args(worker, rows, tokens, 0 if tokens > 1 else a.context, rng)
            leaves = jax.tree.leaves(worker.params)  # the step's first argument
            lowered = worker.lowered_step(shape)
            compiled, rec = {}, {}
            for name, opts in sets.items():
                t0 = time.perf_counter()
                with executables.fresh_compilation():  # compile time, not a load from JAX's persistent cache
                    compiled[name] = lowered.compile(compiler_options=dict(opts))
                rec[name] = {"compile_s": time.perf_counter() - t0, "run_ms": [], "cpu_ms": []}
            reference = None
            for _ in range(a.repeats + 1):  # the first round warms up
                for name, fn in compiled.items():
                    t0, c0 = time.perf_counter(), time.process_time()
                    worker.state, logits = fn(leaves, worker.state, batch)
                    logits = np.asarray(jax.block_until_ready(logits), np.float32)
                    rec[name]["run_ms"].append(1e3 * (time.perf_counter() - t0))
                    rec[name]["cpu_ms"].append(1e3 * (time.process_time() - c0))
                    if name == "xla defaults":
                        reference = logits
                    rec[name]["max_abs_diff"] = float(np.max(np.abs(logits - reference)))
            for name, r in rec.items():
                runs, cpu = sorted(r.pop("run_ms")[1:]), sorted(r.pop("cpu_ms")[1:])
                r |= {"run_ms_min": runs[0], "run_ms_median": runs[len(runs) // 2], "cpu_ms_median": cpu[len(cpu) // 2]}
                results.append({"dtype": dtype, "shape": list(shape), "options": name, **r})
                print(f"{dtype:<9} {rows:>3}x{tokens:<5} {name:<30} compile {r['compile_s']:6.2f} s   run min "
                      f"{r['run_ms_min']:8.1f} ms  median {r['run_ms_median']:8.1f} ms "
                      f"(CPU {r['cpu_ms_median']:8.1f} ms)  "
                      f"max |logits - default| {r['max_abs_diff']:.2e}", flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"preset": a.preset, "repeats": a.repeats, "context": a.context,
                               "option_sets": sets, "results": results}, indent=1))
    print(f"wrote {out}")
    return {"results": results}


if __name__ == "__main__":
    run_command(main)
