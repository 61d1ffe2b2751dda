"""Scheduler overhead per step, with a fake worker that returns one token per sampled row.

Keeps N sequences in flight (a finished request is replaced at once) over prompts that share a few
system prefixes, with prefix caching on; times schedule() + postprocess() per step and reports
decode and prefill steps separately.

    .venv/bin/python scripts/bench/bench_scheduler.py --out results/bench_scheduler.json
"""
import argparse
import json
import pathlib
import random
import statistics
import sys
import time

from gdn_jax.entrypoints.cli import nonnegative_int, output_file, positive_int
from scheduler import SamplingParams, Scheduler, SchedulerConfig, Sequence

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # scripts/, for the shared helpers in common.py
from common import run_command  # noqa: E402

VOCAB = 32000


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run(num_seqs: int, steps: int, warmup: int, prefix_len: int, suffix_len: int, seed: int) -> dict:
    rng = random.Random(seed)
    cfg = SchedulerConfig(num_kv_blocks=num_seqs * 64 + 2048, num_linear_slots=num_seqs * 2 + 256,
                          max_num_seqs=num_seqs, max_model_len=4096, max_num_batched_tokens=2048)
    sched = Scheduler(cfg)
    prefixes = [[rng.randrange(VOCAB) for _ in range(prefix_len)] for _ in range(4)]
    next_id = 0

    def add():
        nonlocal next_id
        prompt = rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(suffix_len)]
        sched.add(Sequence(next_id, prompt, SamplingParams(max_tokens=rng.randrange(64, 512))))
        next_id += 1

    for _ in range(num_seqs):
        add()
    times = {True: [], False: []}
    rows = {True: [], False: []}
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        plan = sched.schedule()
        t1 = time.perf_counter()
        sampled = [(r.seq_id * 31 + r.start_pos) % VOCAB if r.sample else None for r in plan.seqs]
        t2 = time.perf_counter()
        finished = sched.postprocess(plan, sampled)
        t3 = time.perf_counter()
        if i >= warmup:
            times[plan.is_prefill].append((t1 - t0 + t3 - t2) * 1e3)
            rows[plan.is_prefill].append(len(plan.seqs))
        for _ in finished:
            add()
    stats = sched.stats()
    out = {"num_seqs": num_seqs, "steps": steps, "hit_rate": stats["hits"] / max(1, stats["queries"]),
           "reused_tokens": stats["reused_tokens"], "query_tokens": stats["query_tokens"],
           "preemptions": stats["preemptions"], "checkpoints_saved": stats["checkpoints_saved"]}
    for is_prefill, name in ((False, "decode"), (True, "prefill")):
        xs = times[is_prefill]
        out[name] = {"steps": len(xs), "mean_ms": statistics.fmean(xs) if xs else float("nan"),
                     "p50_ms": percentile(xs, 0.5), "p99_ms": percentile(xs, 0.99),
                     "mean_rows": statistics.fmean(rows[is_prefill]) if xs else 0.0}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="bench_scheduler.py", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--seqs", type=positive_int, nargs="+", default=[8, 64, 256], help="concurrent sequences, one run each")
    ap.add_argument("--steps", type=positive_int, default=2000, help="timed scheduler steps")
    ap.add_argument("--warmup", type=nonnegative_int, default=600, help="untimed steps first")
    ap.add_argument("--prefix-len", type=positive_int, default=512, help="tokens of the shared prefix")
    ap.add_argument("--suffix-len", type=positive_int, default=64, help="tokens of each request's own suffix")
    ap.add_argument("--seed", type=nonnegative_int, default=0, help="workload seed")
    ap.add_argument("--out", type=output_file, default="results/bench_scheduler.json", help="JSON output")
    args = ap.parse_args(argv)

    results = [run(n, args.steps, args.warmup, args.prefix_len, args.suffix_len, args.seed)
               for n in args.seqs]
    print(f"{'seqs':>5} {'kind':>8} {'steps':>6} {'rows':>6} {'mean ms':>8} {'p50 ms':>8} {'p99 ms':>8}"
          f" {'hit rate':>9}")
    for r in results:
        for kind in ("decode", "prefill"):
            k = r[kind]
            print(f"{r['num_seqs']:>5} {kind:>8} {k['steps']:>6} {k['mean_rows']:>6.1f} {k['mean_ms']:>8.3f}"
                  f" {k['p50_ms']:>8.3f} {k['p99_ms']:>8.3f} {r['hit_rate']:>9.2f}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    run_command(main)
