"""The one engine thread: it owns the `LLMEngine`, drives `step()`, and applies add / abort commands between steps.

HTTP handlers run on the asyncio loop and never touch the engine: they put a command on a queue and read their
request's outputs from a `Mailbox` that this thread fills, waking the handler with `call_soon_threadsafe`. So the
engine is only ever used by one thread. A mailbox keeps only the latest output of each prompt: outputs are cumulative,
so a handler that reads late (its client does not read) loses nothing and holds one output per prompt, not one per
step. If a step raises, the requests of that step get an error and the loop goes on serving. The thread also keeps
the `/metrics` registry, and counts the sequences submitted and not yet started (`queued_sequences`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gdn_jax.engine import EngineFull, EngineStepError, LLMEngine, RequestOutput
from gdn_jax.entrypoints.openai.protocol import BadRequest, EngineError
from scheduler import SamplingParams

ENGINE_THREAD_STACK_BYTES = 64 << 20
RETRY_AFTER_S = 1  # a 429's Retry-After: the queue moves every engine step
log = logging.getLogger(__name__)


class Mailbox:
    """One HTTP request's outputs, by prompt index: the latest RequestOutput of each prompt, or the error that ended
    it. The engine thread puts; the asyncio side takes."""

    def __init__(self, aloop: asyncio.AbstractEventLoop):
        self.aloop = aloop
        self._latest: dict[int, RequestOutput | Exception] = {}
        self._lock = threading.Lock()
        self._ready = asyncio.Event()
        self._wake_scheduled = False

    def put(self, index: int, item: RequestOutput | Exception) -> None:
        with self._lock:
            self._latest[index] = item  # an output holds everything an older one of its prompt did
            if self._wake_scheduled:
                return
            self._wake_scheduled = True
        try:
            self.aloop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the event loop is closed (shutdown)
            pass

    def _wake(self) -> None:
        with self._lock:
            self._wake_scheduled = False
        self._ready.set()

    async def take(self, timeout: float) -> dict[int, RequestOutput | Exception]:
        """What came since the last call ({} if nothing came within `timeout` seconds)."""
        try:
            async with asyncio.timeout(timeout):  # (no task per wait, unlike wait_for on 3.11)
                await self._ready.wait()
        except TimeoutError:
            return {}
        self._ready.clear()
        with self._lock:
            items, self._latest = self._latest, {}
        return items


class Sink:
    """Where one engine request's outputs go: its HTTP request's mailbox, under the prompt's index."""

    def __init__(self, mailbox: Mailbox, index: int, n: int):
        self.mailbox, self.index = mailbox, index
        self.first = True
        self.queued = n  # samples that have not started (no token yet, not ended)

    def put(self, item) -> None:
        self.mailbox.put(self.index, item)


class EngineLoop:
    """Drives `LLMEngine.step()` in one background thread; add/abort arrive as commands applied between steps."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._stop = threading.Event()
        # sequences submitted (counted by the asyncio side) and started or ended (by this thread): each counter has
        # one writer
        self._submitted_seqs = self._started_seqs = 0
        # XLA compiles new step shapes on this thread: give it a main-thread-sized stack, not the platform's default
        previous = threading.stack_size(ENGINE_THREAD_STACK_BYTES)
        try:
            self._thread = threading.Thread(target=self._run, name="gdn-jax-engine", daemon=True)
        finally:
            threading.stack_size(previous)
        self.consecutive_failures = 0
        # a snapshot for /metrics, replaced (never mutated) by the engine thread: at most every 50 ms while busy,
        # and whenever it goes idle or applies commands
        self.stats: dict = engine.cache_stats()
        self._stats_time = time.perf_counter()
        self.registry = CollectorRegistry()
        self.registry.register(_StatsCollector(self))
        self.ttft = Histogram("gdn_jax_time_to_first_token_seconds", "Arrival (HTTP request read) to first token",
                              registry=self.registry,
                              buckets=(.005, .01, .02, .05, .1, .2, .5, 1, 2, 5, 10, 30, 60))
        self.latency = Histogram("gdn_jax_e2e_request_latency_seconds", "Arrival to last token",
                                 registry=self.registry, buckets=(.05, .1, .2, .5, 1, 2, 5, 10, 30, 60, 120, 300))
        self.finished = Counter("gdn_jax_requests_finished", "Engine requests finished", ["finish_reason"],
                                registry=self.registry)
        self.prompt_tokens = Counter("gdn_jax_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=self.registry)
        self.cached_tokens = Counter("gdn_jax_cached_prompt_tokens", "Prompt tokens served from the prefix cache",
                                     registry=self.registry)
        self.generation_tokens = Counter("gdn_jax_generation_tokens", "Generated tokens", registry=self.registry)
        self.step_failures = Counter("gdn_jax_step_failures", "Engine steps that raised", registry=self.registry)

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._cmds.put(("wake",))
        self._thread.join(timeout)

    @property
    def num_active(self) -> int:
        return len(self._sinks)

    @property
    def queued_sequences(self) -> int:
        """Sequences submitted that have not started: no token yet, not ended (commands not applied yet included)."""
        return self._submitted_seqs - self._started_seqs

    # called from the asyncio side ------------------------------------------------------------------------------
    def submit(self, request_id: str, prompt, params: SamplingParams, sink: Sink, arrival: float,
               queue_group: str | None = None) -> None:
        """`queue_group`: the engine requests of one HTTP request take one turn together in the waiting queue."""
        self._submitted_seqs += sink.queued
        self._cmds.put(("add", request_id, prompt, params, sink, arrival, queue_group))

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))

    # the engine thread -------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain(block=not self.engine.has_unfinished_requests())
            if not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - the loop must survive whatever a step raises
                self._fail_step(e)
                continue
            self.consecutive_failures = 0
            for out in outputs:
                self._emit(out)
            if not self.engine.has_unfinished_requests() or time.perf_counter() - self._stats_time > 0.05:
                self._snapshot()

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._cmds.get(timeout=0.1) if block else self._cmds.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
        self._snapshot()

    def _snapshot(self) -> None:
        self.stats, self._stats_time = self.engine.cache_stats(), time.perf_counter()

    def _apply(self, cmd) -> None:
        if cmd[0] == "add":
            _, rid, prompt, params, sink, arrival, group = cmd
            try:
                self.engine.add_request(rid, prompt, params, arrival_time=arrival, queue_group=group)
            except Exception as e:  # noqa: BLE001 - validated before; reported to the one client
                self._settle(sink)
                sink.put(_refusal(e))
                return
            self._sinks[rid] = sink
        elif cmd[0] == "abort" and (sink := self._sinks.pop(cmd[1], None)) is not None:
            self._settle(sink)
            self.engine.abort_request(cmd[1])
            self.finished.labels("abort").inc()

    def _settle(self, sink: Sink) -> None:
        """A request ended: its samples that never started count as started (no longer queued)."""
        self._started_seqs += sink.queued
        sink.queued = 0

    def _emit(self, out: RequestOutput) -> None:
        sink = self._sinks.get(out.request_id)
        if sink is None:
            return
        m = out.metrics
        if sink.first and m.ttft is not None:
            sink.first = False
            self.ttft.observe(m.ttft)
        if sink.queued:
            queued = sum(1 for comp in out.outputs if not comp.token_ids and comp.finish_reason is None)
            self._started_seqs += sink.queued - queued
            sink.queued = queued
        if out.finished:
            del self._sinks[out.request_id]
            self._settle(sink)
            for comp in out.outputs:
                self.finished.labels(comp.finish_reason or "unknown").inc()
            self.latency.observe(time.perf_counter() - m.arrival_time)
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            self.cached_tokens.inc(out.num_cached_tokens)
            self.generation_tokens.inc(sum(len(comp.token_ids) for comp in out.outputs))
        sink.put(out)

    def _fail_step(self, exc: Exception) -> None:
        """The requests of the failed step get the error and are aborted. The engine fails a step that raised
        between its planning and its postprocess itself (EngineStepError); should a plan still be in flight, it is
        retired as failed (all its sequences aborted by then, nothing of it indexed) so scheduling can go on. A
        request whose own part of a step's postprocess raised gets the error too, but the step ran: it counts as no
        step failure and leaves the health check as it was."""
        if isinstance(exc, EngineStepError) and not exc.step_failed:
            log.exception("engine step: request(s) failed in the postprocess")
            err = EngineError(f"engine: {type(exc).__name__}: {exc}")
        else:
            self.step_failures.inc()
            self.consecutive_failures += 1
            log.exception("engine step failed")
            err = EngineError(f"engine step failed: {type(exc).__name__}: {exc}")
        if isinstance(exc, EngineStepError):  # the engine ended those requests and released what they held
            for rid in exc.request_ids:
                sink = self._sinks.pop(rid, None)
                if sink is not None:
                    self._settle(sink)
                    sink.put(err)
                    self.finished.labels("error").inc()
            self._snapshot()
            return
        sched = self.engine.scheduler
        plan = sched.inflight
        in_plan = {s.seq_id for s in plan.seqs} if plan is not None else None
        failed = [rid for rid in list(self._sinks)
                  if in_plan is None or self.engine.seq_id_of(rid) in in_plan]
        for rid in failed:
            sink = self._sinks.pop(rid)
            self._settle(sink)
            sink.put(err)
            self.engine.abort_request(rid)
            self.finished.labels("error").inc()
        if sched.inflight is not None:
            sched.fail_step(sched.inflight)
        self._snapshot()


def _refusal(e: Exception) -> Exception:
    """What the client of an `add_request` that raised is told: a 400 for a request the engine refuses, a 429 when
    the engine's own waiting limit is full (an engine built with max_waiting_sequences), else an engine error."""
    if isinstance(e, EngineFull):
        return BadRequest(str(e), status=429, headers={"Retry-After": str(RETRY_AFTER_S)})
    return BadRequest(str(e)) if isinstance(e, ValueError) else EngineError(f"{type(e).__name__}: {e}")


class _StatsCollector:
    """Exposes the engine's `cache_stats()` snapshot at scrape time, as labelled gauges, and its speculative-decoding
    totals as counters (`gdn_jax_spec_draft_tokens_total`, `gdn_jax_spec_accepted_tokens_total`: 0 without
    speculation; their ratio is the acceptance rate)."""

    def __init__(self, loop: EngineLoop):
        self.loop = loop

    def collect(self):
        s, eng = self.loop.stats, self.loop.engine
        cache = GaugeMetricFamily("gdn_jax_cache", "Engine cache_stats() counters and gauges", labels=["stat"])
        for k, v in sorted(s.items()):
            cache.add_metric([k], float(v))
        yield cache
        yield GaugeMetricFamily("gdn_jax_cache_hit_rate", "Prefix-cache hits / queries", value=s.get("hit_rate", 0.0))
        slots = GaugeMetricFamily("gdn_jax_linear_slots", "Linear-state slots by state", labels=["state"])
        for state in ("live", "checkpoint", "free"):
            slots.add_metric([state], s.get(f"{state}_slots", 0))
        yield slots
        usable = eng.memory.num_kv_blocks - 1
        blocks = GaugeMetricFamily("gdn_jax_kv_blocks", "KV blocks: in use by requests, cached (reusable), free "
                                   "(allocatable, cached included)", labels=["state"])
        blocks.add_metric(["in_use"], usable - s.get("kv_blocks_free", usable))
        blocks.add_metric(["cached"], s.get("kv_blocks_cached", 0))
        blocks.add_metric(["free"], s.get("kv_blocks_free", usable))
        yield blocks
        reqs = GaugeMetricFamily("gdn_jax_requests", "Requests by state", labels=["state"])
        reqs.add_metric(["running"], s.get("num_running", 0))
        reqs.add_metric(["waiting"], s.get("num_waiting", 0))
        reqs.add_metric(["active"], self.loop.num_active)
        yield reqs
        yield GaugeMetricFamily("gdn_jax_queued_sequences", "Sequences submitted and not started (what "
                                "max_waiting_sequences bounds)", value=self.loop.queued_sequences)
        yield CounterMetricFamily("gdn_jax_spec_draft_tokens", "Speculative decoding: MTP draft tokens verified",
                                  value=s.get("spec_draft_tokens", 0))
        yield CounterMetricFamily("gdn_jax_spec_accepted_tokens", "Speculative decoding: draft tokens accepted (each "
                                  "an output token, counted in gdn_jax_generation_tokens too)",
                                  value=s.get("spec_accepted_tokens", 0))
