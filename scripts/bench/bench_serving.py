"""Client-side TTFT and inter-token latency of the HTTP server, cache on and off, against the offline engine.

    .venv/bin/python scripts/bench/bench_serving.py [--model tiny] [--concurrency 1 8] [--requests 32] [--system 512]
    .venv/bin/python scripts/bench/bench_serving.py --url http://127.0.0.1:8000 ...  # a running `gdn-jax serve`

Workload: `--requests` streaming completions, each a shared system prompt (`--system` token ids) plus its own
question (`--question` ids), greedy, `--max-tokens` tokens each (ignore_eos). N concurrent clients (httpx, one
asyncio task each, closed loop: a client sends its next request when the previous one ends). Every measured pass is
preceded by a warm-up pass of as many requests with the same system prompt and other questions: the measured pass
is a warm system prompt, as a deployed server sees it, so with the cache on every measured request can reuse the
system prompt whatever the order in which the requests arrive (server and offline engine alike). The server compiles
every step shape at start-up, so no measured step compiles (checked on /metrics: the `compiles` column).

TTFT: request sent -> first streamed token, at the client. ITL: gaps between a request's later tokens. Without
`--url`, the script starts `gdn-jax serve` in a subprocess for cache on and for cache off, then runs the same
workload on an in-process `LLMEngine` (same configuration, the same closed loop of N requests in flight, TTFT from
submission to the step that returns the first token): the difference is the server's overhead.
Prints a table and writes JSON (default results/bench_serving.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from gdn_jax.entrypoints.cli import nonnegative_int, output_file, positive_int

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared helpers in common.py
from common import ServerProcess, run_command  # noqa: E402


def pct(xs, q):
    return float(np.percentile(xs, q)) if xs else float("nan")


def workload(args, vocab: int, clients: int) -> tuple[list[list[int]], list[list[int]]]:
    """(warm-up pass, measured pass): `--requests` prompts each, one system prompt, every question its own."""
    rng = np.random.default_rng(args.seed + clients)
    shared = rng.integers(4, vocab, args.system).tolist()
    passes = [[shared + rng.integers(4, vocab, args.question).tolist() for _ in range(args.requests)]
              for _ in range(2)]
    return passes[0], passes[1]


# ---- against a server -----------------------------------------------------------------------------------------
async def _one(ac: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times, usage = [], None
    async with ac.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk["choices"]:
                times.append(now)
    tokens = usage["completion_tokens"]
    return {"ttft": times[0] - t0, "itl": token_gaps(times, tokens), "e2e": times[-1] - t0,
            "tokens": tokens, "cached": usage["prompt_tokens_details"]["cached_tokens"]}


def token_gaps(times: list[float], tokens: int) -> list[float]:
    """Inter-token latencies of one stream: the time from its first chunk to its last over the tokens after the
    first, once per such token. A chunk may carry several tokens (the server keeps only a stream's latest output
    while its client has not read), so the gaps between chunks are not the gaps between tokens."""
    return [(times[-1] - times[0]) / (tokens - 1)] * (tokens - 1) if tokens > 1 else []


async def _closed_loop(url: str, prompts, clients: int, max_tokens: int, api_key: str | None) -> tuple[list, float]:
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results = []
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients + 2)

    async def client(ac):
        while not queue.empty():
            results.append(await _one(ac, queue.get_nowait(), max_tokens))

    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=600, headers=headers, limits=limits) as ac:
        await asyncio.gather(*(client(ac) for _ in range(clients)))
    return results, time.perf_counter() - t0


def _compilations(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith('gdn_jax_cache{stat="compilations"}'):
            return float(line.split()[-1])
    return float("nan")


def run_server(url, args, vocab, api_key) -> dict:
    out = {}
    for c in args.concurrency:
        warm, measured = workload(args, vocab, c)
        asyncio.run(_closed_loop(url, warm, c, args.max_tokens, api_key))
        before = _compilations(url)
        results, wall = asyncio.run(_closed_loop(url, measured, c, args.max_tokens, api_key))
        out[c] = summarize(results, wall)
        out[c]["compilations_during_measurement"] = _compilations(url) - before
    return out


def server_process(args, caching: bool) -> ServerProcess:
    """`gdn-jax serve` for the benchmark's settings, the prefix cache on or off."""
    return ServerProcess(["--model", args.model, "--dtype", args.dtype, "--max-num-seqs", str(max(args.concurrency)),
                          "--max-model-len", str(args.max_model_len), "--chunk-stride", str(args.chunk_stride),
                          "--max-tokens-limit", str(args.max_tokens)] + ([] if caching else ["--no-prefix-caching"]))


# ---- the offline engine ---------------------------------------------------------------------------------------
def run_offline(args, caching: bool) -> dict:
    from gdn_jax import LLMEngine, SamplingParams  # the engine turns on the persistent cache the server uses
    engine = LLMEngine(args.model, dtype=args.dtype, enable_prefix_caching=caching, chunk_stride=args.chunk_stride,
                       max_num_seqs=max(args.concurrency), max_model_len=args.max_model_len, verbose=False)
    engine.warm_up()  # as `gdn-jax serve` does at start-up
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    vocab = engine.cfg.vocab_size
    out = {}

    def closed_loop(prompts, clients):
        todo, sent, seen, results = list(prompts), {}, {}, []
        t0 = time.perf_counter()
        ids = iter(range(1 << 30))
        while todo or engine.has_unfinished_requests():
            while todo and len(sent) < clients:
                rid = str(next(ids))
                sent[rid] = time.perf_counter()
                engine.add_request(rid, todo.pop(0), sp)
            for o in engine.step():
                now = time.perf_counter()
                seen.setdefault(o.request_id, []).append(now)
                if o.finished:
                    times = seen.pop(o.request_id)
                    results.append({"ttft": times[0] - sent[o.request_id], "itl": list(np.diff(times)),
                                    "e2e": times[-1] - sent.pop(o.request_id), "tokens": len(o.outputs[0].token_ids),
                                    "cached": o.num_cached_tokens})
        return results, time.perf_counter() - t0

    for c in args.concurrency:
        warm, measured = workload(args, vocab, c)
        closed_loop(warm, c)
        before = engine.cache_stats()["compilations"]
        results, wall = closed_loop(measured, c)
        out[c] = summarize(results, wall)
        out[c]["compilations_during_measurement"] = engine.cache_stats()["compilations"] - before
    return out


def summarize(results: list[dict], wall: float) -> dict:
    ttft = [r["ttft"] for r in results]
    itl = [x for r in results for x in r["itl"]]
    tokens = sum(r["tokens"] for r in results)
    return {"requests": len(results), "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p90_ms": 1e3 * pct(ttft, 90),
            "ttft_mean_ms": 1e3 * statistics.fmean(ttft), "itl_p50_ms": 1e3 * pct(itl, 50),
            "itl_p90_ms": 1e3 * pct(itl, 90), "e2e_p50_ms": 1e3 * pct([r["e2e"] for r in results], 50),
            "wall_s": wall, "output_tok_per_s": tokens / wall,
            "cached_tokens_per_request": sum(r["cached"] for r in results) / max(1, len(results)),
            "raw_ttft_ms": [1e3 * t for t in ttft]}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="bench_serving.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="preset or HF folder (default: %(default)s)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="weights and activations (default: %(default)s)")
    ap.add_argument("--url", default=None, help="benchmark this running server instead of starting two")
    ap.add_argument("--api-key", default=os.environ.get("GDN_JAX_API_KEY"), help="bearer key (default: $GDN_JAX_API_KEY)")
    ap.add_argument("--concurrency", type=positive_int, nargs="+", default=[1, 8], help="concurrent clients, one run each (default: %(default)s)")
    ap.add_argument("--requests", type=positive_int, default=32, help="measured requests per (mode, concurrency) (default: %(default)s)")
    ap.add_argument("--system", type=positive_int, default=512, help="shared system prompt, tokens (default: %(default)s)")
    ap.add_argument("--question", type=positive_int, default=32, help="per-request suffix, tokens (default: %(default)s)")
    ap.add_argument("--max-tokens", type=positive_int, default=16, help="tokens per request (default: %(default)s)")
    ap.add_argument("--chunk-stride", type=positive_int, default=64, help="tokens between checkpoints (default: %(default)s)")
    ap.add_argument("--max-model-len", type=positive_int, default=1024, help="engine max_model_len (default: %(default)s)")
    ap.add_argument("--no-offline", action="store_true", help="skip the offline-engine comparison")
    ap.add_argument("--seed", type=nonnegative_int, default=0, help="workload seed (default: %(default)s)")
    ap.add_argument("--out", type=output_file, default="results/bench_serving.json",
                    help="JSON output (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.system + args.question + args.max_tokens > args.max_model_len:
        ap.error(f"--system ({args.system}) + --question ({args.question}) + --max-tokens ({args.max_tokens}) "
                 f"exceeds --max-model-len ({args.max_model_len})")

    from gdn_jax.config import ModelConfig, get_preset
    from gdn_jax.model.weights import model_folder
    folder = model_folder(args.model)  # the shipped `tiny`, or an HF folder; else a preset
    vocab = (get_preset(args.model) if folder is None else ModelConfig.from_pretrained(folder)).vocab_size
    rows = {}
    if args.url:
        try:  # before the workload: a wrong address is one line naming it, not a traceback from the first request
            httpx.get(args.url.rstrip("/") + "/health", timeout=30)
        except httpx.HTTPError as e:
            ap.error(f"--url {args.url}: no server answers there ({type(e).__name__}: {e})")
        rows["server (external)"] = run_server(args.url.rstrip("/"), args, vocab, args.api_key)
    else:
        for caching in (True, False):
            with server_process(args, caching) as srv:
                rows[f"server, cache {'on' if caching else 'off'}"] = run_server(srv.url, args, vocab, None)
        if not args.no_offline:
            for caching in (True, False):
                rows[f"offline, cache {'on' if caching else 'off'}"] = run_offline(args, caching)

    print(f"\n{args.model} ({args.dtype}): {args.requests} requests of {args.system} shared + {args.question} own "
          f"tokens -> {args.max_tokens} tokens, chunk_stride {args.chunk_stride}; system prompt warmed by a first pass")
    head = (f"{'mode':<22}{'clients':>8}{'TTFT p50':>10}{'TTFT p90':>10}{'ITL p50':>9}{'ITL p90':>9}"
            f"{'e2e p50':>9}{'tok/s':>8}{'cached/req':>11}{'compiles':>9}")
    print(head + "\n" + "-" * len(head))
    for name, by_c in rows.items():
        for c, r in by_c.items():
            print(f"{name:<22}{c:>8}{r['ttft_p50_ms']:>10.1f}{r['ttft_p90_ms']:>10.1f}{r['itl_p50_ms']:>9.1f}"
                  f"{r['itl_p90_ms']:>9.1f}{r['e2e_p50_ms']:>9.1f}{r['output_tok_per_s']:>8.1f}"
                  f"{r['cached_tokens_per_request']:>11.1f}{r['compilations_during_measurement']:>9.0f}")
    overhead = {}
    for cache in ("on", "off"):
        srv, off = rows.get(f"server, cache {cache}"), rows.get(f"offline, cache {cache}")
        if srv and off:
            for c in args.concurrency:
                overhead[f"cache {cache}, {c} clients"] = {
                    "ttft_p50_ms": srv[c]["ttft_p50_ms"] - off[c]["ttft_p50_ms"],
                    "itl_p50_ms": srv[c]["itl_p50_ms"] - off[c]["itl_p50_ms"],
                    "throughput_ratio": srv[c]["output_tok_per_s"] / off[c]["output_tok_per_s"]}
    if overhead:
        print("\nserver overhead vs the offline engine (ms, server minus offline; throughput server/offline)")
        for k, v in overhead.items():
            print(f"  {k:<22} TTFT p50 {v['ttft_p50_ms']:+7.1f}   ITL p50 {v['itl_p50_ms']:+6.1f}   "
                  f"throughput x{v['throughput_ratio']:.2f}")
    out = {"args": vars(args), "rows": {k: {str(c): r for c, r in v.items()} for k, v in rows.items()},
           "overhead": overhead}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    run_command(main)
