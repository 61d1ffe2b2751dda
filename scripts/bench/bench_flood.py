"""A one-prompt request's TTFT on an idle server and behind one client's flood, and the answer past the waiting limit.

    .venv/bin/python scripts/bench/bench_flood.py [--model tiny] [--prompts 64] [--n 256] [--rounds 5]
    .venv/bin/python scripts/bench/bench_flood.py --url http://127.0.0.1:8000 ...  # a running `gdn-jax serve`

Without `--url` the script starts `gdn-jax serve` in a subprocess (it compiles its step shapes at start-up), with
--max-sequences-per-request raised to the flood's size (`--prompts` x `--n`, at least 256) and --max-waiting-sequences
to that plus `--headroom`; a server started apart must admit the flood too.

The small request: one prompt of `--prompt-len` token ids, streamed, greedy; its TTFT is request sent -> first token,
at the client (the request is then left, which aborts it). First a warm-up: a small request and a flood of
`--warm-prompts` x `--n` sequences. Then `--rounds` small requests one after another on the idle server. Then the
flood: one streaming request of `--prompts` prompts x n=`--n`, `--flood-max-tokens` tokens each, read in the
background; once its first token came, one request of n=256 (n's largest), past the waiting limit while fewer than
256 - `--headroom` of the flood's sequences have started (a 429 with Retry-After; a server without the limit queues
it), then `--rounds` small requests, one every `--interval` s. The flood is read to its end. `compiles`: step shapes
the server compiled during the phase (/metrics).

Prints a table and writes JSON (default results/bench_flood.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from gdn_jax.entrypoints.cli import nonnegative_int, output_file, positive_int, positive_number
from scheduler.sampling_params import MAX_N

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared helpers in common.py
from common import ServerProcess, environment, run_command  # noqa: E402


def _prompts(rng, count: int, length: int) -> list[list[int]]:
    return [rng.integers(4, 250, length).tolist() for _ in range(count)]


async def small_ttft(ac: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> float:
    """Seconds from sending a one-prompt streamed request to its first token; the request is left then."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    async with ac.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"the small request got HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(event["error"]["message"])
                return time.perf_counter() - t0
    raise RuntimeError("the small request's stream ended with no token")


async def flood(ac: httpx.AsyncClient, prompts: list[list[int]], n: int, max_tokens: int,
                started: asyncio.Event) -> dict:
    """One streamed request of every prompt x n samples, read to its end; `started` is set at its first token."""
    body = {"prompt": prompts, "n": n, "max_tokens": max_tokens, "temperature": 1.0, "seed": 0, "ignore_eos": True,
            "stream": True}
    t0, first, finished, error = time.perf_counter(), None, 0, None
    async with ac.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"the flood got HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]["message"]
                break
            if first is None:
                first = time.perf_counter() - t0
                started.set()
            finished += sum(c["finish_reason"] is not None for c in event["choices"])
    started.set()
    return {"sequences": len(prompts) * n, "finished": finished, "first_token_s": first,
            "wall_s": time.perf_counter() - t0, "error": error}


async def past_the_limit(ac: httpx.AsyncClient, prompt: list[int], n: int) -> dict:
    """The status and Retry-After of a request of n sequences (left at once if it was admitted)."""
    body = {"prompt": prompt, "n": n, "max_tokens": 1, "stream": True}
    async with ac.stream("POST", "/v1/completions", json=body) as r:
        return {"sequences": n, "status": r.status_code, "retry_after": r.headers.get("retry-after")}


def _compilations(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith('gdn_jax_cache{stat="compilations"}'):
            return float(line.split()[-1])
    return float("nan")


def _summary(ttfts: list[float]) -> dict:
    return {"requests": len(ttfts), "ttft_p50_ms": 1e3 * statistics.median(ttfts), "ttft_max_ms": 1e3 * max(ttfts),
            "raw_ttft_ms": [1e3 * t for t in ttfts]}


async def measure(url: str, args) -> dict:
    rng = np.random.default_rng(args.seed)
    small = _prompts(rng, 2 * args.rounds + 1, args.prompt_len)
    limits = httpx.Limits(max_connections=args.rounds + 8)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as ac:
        await small_ttft(ac, small[-1], args.max_tokens)  # warm-up
        await flood(ac, _prompts(rng, args.warm_prompts, args.prompt_len), args.n, args.flood_max_tokens,
                    asyncio.Event())
        before = _compilations(url)
        idle = [await small_ttft(ac, p, args.max_tokens) for p in small[:args.rounds]]
        idle_compiles, before = _compilations(url) - before, _compilations(url)

        started = asyncio.Event()
        flooding = asyncio.create_task(flood(ac, _prompts(rng, args.prompts, args.prompt_len), args.n,
                                             args.flood_max_tokens, started))
        await started.wait()
        refused = await past_the_limit(ac, small[0], MAX_N)
        behind = []
        for p in small[args.rounds:2 * args.rounds]:
            behind.append(asyncio.create_task(small_ttft(ac, p, args.max_tokens)))
            await asyncio.sleep(args.interval)
        behind = await asyncio.gather(*behind)
        flooded = await flooding
    return {"idle": {**_summary(idle), "compilations": idle_compiles},
            "behind the flood": {**_summary(behind), "compilations": _compilations(url) - before},
            "flood": flooded, "past the waiting limit": refused}


def server_process(args) -> ServerProcess:
    """`gdn-jax serve` admitting the flood."""
    size = max(args.prompts * args.n, MAX_N)  # the flood, and the request past the limit
    extra = [] if args.max_running_per_request is None else ["--max-running-per-request",
                                                             str(args.max_running_per_request)]
    return ServerProcess(["--model", args.model, "--max-num-seqs", str(args.max_num_seqs), *extra,
                          "--max-model-len", str(args.max_model_len),
                          "--max-tokens-limit", str(max(args.max_tokens, args.flood_max_tokens)),
                          "--max-sequences-per-request", str(size), "--max-waiting-sequences",
                          str(size + args.headroom)])


def main(argv=None):
    ap = argparse.ArgumentParser(prog="bench_flood.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="preset or HF folder (default: %(default)s)")
    ap.add_argument("--url", default=None, help="measure this running server instead of starting one")
    ap.add_argument("--prompts", type=positive_int, default=64, help="prompts of the flood (default: %(default)s)")
    ap.add_argument("--n", type=positive_int, default=256, help="samples per prompt of the floods (default: %(default)s)")
    ap.add_argument("--warm-prompts", type=positive_int, default=2,
                    help="prompts of the warm-up flood (default: %(default)s)")
    ap.add_argument("--flood-max-tokens", type=positive_int, default=2,
                    help="tokens per sample of the floods (default: %(default)s)")
    ap.add_argument("--prompt-len", type=positive_int, default=24, help="token ids per prompt (default: %(default)s)")
    ap.add_argument("--max-tokens", type=positive_int, default=8,
                    help="max_tokens of the small request (default: %(default)s)")
    ap.add_argument("--rounds", type=positive_int, default=5,
                    help="small requests measured idle, and behind the flood (default: %(default)s)")
    ap.add_argument("--interval", type=positive_number, default=0.5,
                    help="seconds between the small requests behind the flood (default: %(default)s)")
    ap.add_argument("--headroom", type=positive_int, default=64,
                    help="--max-waiting-sequences past the flood's size (default: %(default)s)")
    ap.add_argument("--max-num-seqs", type=positive_int, default=64,
                    help="the server's running sequences (default: %(default)s)")
    ap.add_argument("--max-running-per-request", type=positive_int, default=None,
                    help="the server's bound on one request's running sequences (default: none)")
    ap.add_argument("--max-model-len", type=positive_int, default=256,
                    help="the server's context (default: %(default)s)")
    ap.add_argument("--seed", type=nonnegative_int, default=0, help="workload seed (default: %(default)s)")
    ap.add_argument("--out", type=output_file, default="results/bench_flood.json",
                    help="JSON output (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.headroom < args.rounds:
        ap.error(f"--headroom ({args.headroom}) must leave room for the --rounds ({args.rounds}) small requests")
    if args.url:
        result = asyncio.run(measure(args.url.rstrip("/"), args))
    else:
        with server_process(args) as srv:
            result = asyncio.run(measure(srv.url, args))

    idle = result["idle"]["ttft_p50_ms"]
    f = result["flood"]
    print(f"\nsmall request: {args.prompt_len} ids, TTFT at the client; flood: {args.prompts} prompts x n={args.n} = "
          f"{f['sequences']} sequences of {args.flood_max_tokens} tokens ({f['wall_s']:.1f} s, "
          f"{f['finished']} finished{', error: ' + f['error'] if f['error'] else ''})")
    head = f"{'phase':<18}{'requests':>9}{'TTFT p50 ms':>13}{'TTFT max ms':>13}{'x idle p50':>12}{'compiles':>10}"
    print(head + "\n" + "-" * len(head))
    for phase in ("idle", "behind the flood"):
        r = result[phase]
        print(f"{phase:<18}{r['requests']:>9}{r['ttft_p50_ms']:>13.1f}{r['ttft_max_ms']:>13.1f}"
              f"{r['ttft_p50_ms'] / idle:>12.2f}{r['compilations']:>10.0f}")
    refused = result["past the waiting limit"]
    print(f"a request of {refused['sequences']} sequences past the waiting limit: HTTP {refused['status']}, "
          f"Retry-After {refused['retry_after']}")
    out = {"args": vars(args), "environment": environment(), **result}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    run_command(main)
