"""Where one step shape's compile time goes: lowering (trace + StableHLO) against XLA, XLA's time by pass and phase
(from the JAX profiler's trace of the compilation), and what the optimized HLO holds (instructions per computation:
the layer-loop bodies, the `lax.switch` branches that pick a layer's matrices, the checkpoint scatters).

    .venv/bin/python scripts/bench/profile_compile.py --preset qwen3.5-9b --shape 16x512x256 [--dtype bfloat16]
                                                      [--checkpoint-mode scan] [--top 25]
                                                      [--out results/profile_compile_<preset>_<shape>.json]

Like scripts/bench/bench_compile.py it builds the worker on abstract weights (nothing is allocated). XLA flags under
test go in XLA_FLAGS as usual; the script prints them with the figures. XLA's time is read from the trace: every event of
the compiling thread, summed by name (events nest, so a phase and the passes inside it both count; read the table as
"time inside", not as a partition). Timings on a shared machine are noisy; repeat and read the minimum.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import jax
from jax._src.lib import _profile_data

from gdn_jax.entrypoints.cli import nonnegative_int, output_file, positive_int

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared helpers in common.py
from common import DTYPES, build_worker, parse_shapes, run_command  # noqa: E402


def xla_events(trace_dir: str) -> dict[str, float]:
    """Seconds inside each event name, over the host threads of the trace."""
    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    totals: collections.Counter = collections.Counter()
    for path in files:
        data = _profile_data.ProfileData.from_file(path)
        for plane in data.planes:
            if not plane.name.startswith("/host"):
                continue
            for line in plane.lines:
                for ev in line.events:
                    totals[ev.name] += ev.duration_ns / 1e9
    return dict(totals)


def hlo_census(text: str) -> list[tuple[str, int]]:
    """(computation name, instruction count) of the optimized HLO module, largest first."""
    counts, current = collections.Counter(), None
    for line in text.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$", line)
        if m:
            current = m.group(1)
        elif line.startswith("}"):
            current = None
        elif current and " = " in line:
            counts[current] += 1
    return counts.most_common()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3.5-9b",
                  help='model preset (abstract weights, nothing allocated) (default: %(default)s)')
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES),
                  help='activation and weight dtype (default: %(default)s)')
    p.add_argument("--shape", default="16x512x256",
                  help='the step shape ROWSxTOKENSxBLOCKS (default: %(default)s)')
    p.add_argument("--max-num-seqs", type=positive_int, default=16,
                  help='engine max_num_seqs (default: %(default)s)')
    p.add_argument("--max-model-len", type=positive_int, default=4096,
                  help='engine max_model_len (default: %(default)s)')
    p.add_argument("--block-size", type=positive_int, default=16,
                  help='KV block size (default: %(default)s)')
    p.add_argument("--chunk-stride", type=positive_int, default=64,
                  help='tokens between checkpoints (default: %(default)s)')
    p.add_argument("--max-num-batched-tokens", type=nonnegative_int, default=0,
                  help="token budget of a step; 0: the engine's default (default: %(default)s)")
    p.add_argument("--checkpoint-mode", default="scan", choices=("scan", "promote"),
                  help='scheduler checkpoint mode (default: %(default)s)')
    p.add_argument("--checkpoint-policy", default="all", choices=("all", "last"),
                  help='checkpoint policy of scan mode (default: %(default)s)')
    p.add_argument("--top", type=positive_int, default=25,
                  help='XLA trace events to print (default: %(default)s)')
    p.add_argument("--out", type=output_file, default=None,
                  help='JSON output (default: results/profile_compile_<preset>_<shape>.json)')
    a = p.parse_args(argv)
    (shape,) = parse_shapes(a.shape, "--shape")
    worker = build_worker(a)
    t0 = time.perf_counter()
    lowered = worker.lowered_step(shape)
    lower_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as trace_dir:
        t0, c0 = time.perf_counter(), time.process_time()
        with jax.profiler.trace(trace_dir):
            compiled = lowered.compile()
        compile_s, compile_cpu = time.perf_counter() - t0, time.process_time() - c0
        events = xla_events(trace_dir)
    census = hlo_census(compiled.as_text())
    flags = os.environ.get("XLA_FLAGS", "")
    print(f"{a.preset} {a.dtype} shape {shape} ({a.checkpoint_mode}); XLA_FLAGS={flags!r}")
    print(f"lower {lower_s:.2f} s; compile {compile_s:.2f} s wall, {compile_cpu:.2f} s process CPU "
          f"(the trace adds a little)")
    print(f"\n{'XLA event':<70} {'s':>7}")
    for name, s in sorted(events.items(), key=lambda kv: -kv[1])[:a.top]:
        print(f"{name[:70]:<70} {s:>7.2f}")
    print(f"\noptimized HLO: {sum(n for _, n in census)} instructions in {len(census)} computations; largest:")
    for name, n in census[:12]:
        print(f"  {name[:66]:<66} {n:>6}")
    out = {"preset": a.preset, "dtype": a.dtype, "shape": list(shape), "checkpoint_mode": a.checkpoint_mode,
           "xla_flags": flags, "lower_s": lower_s, "compile_s": compile_s, "compile_cpu_s": compile_cpu,
           "events": events, "hlo_computations": census}
    path = Path(a.out or f"results/profile_compile_{a.preset}_{a.shape}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    run_command(main)
