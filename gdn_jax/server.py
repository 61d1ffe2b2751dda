"""An OpenAI-compatible HTTP server over the step-level engine (FastAPI + uvicorn, `pip install gdn-jax[serve]`).

One background thread owns the `LLMEngine` and drives `step()`. HTTP handlers run on the asyncio loop and never touch
the engine: they validate a request (tokenize, check ids and lengths: pure reads of the engine's configuration), put an
`add` or `abort` command on a queue, and read their request's outputs from an asyncio queue that the engine thread
feeds with `call_soon_threadsafe`. Commands are applied between steps, so the engine is only ever used by one thread.

Endpoints: POST /v1/completions, POST /v1/chat/completions (models with a chat template), GET /v1/models,
GET /health, GET /metrics (Prometheus text). A request's `model`, if given, must be the served name
(`ServerConfig.model_name`, serve's `--served-model-name`, else its `--model`): another is a 404, as in vLLM. With
`api_key` set, /v1/* needs `Authorization: Bearer <key>`, compared in constant time; /health and /metrics stay open
(bind to loopback, the default, to keep them private).

`echo` with `logprobs` scores the prompt from prompt logprobs. Positions served from the prefix cache have no logits,
so such a request is admitted with `skip_reading_prefix_cache`: it computes its whole prompt (reporting
`cached_tokens = 0`), while what it computes still populates the cache for other requests. With `max_tokens` 0 it
scores the prompt alone (the legacy API's scoring call): nothing generated, `completion_tokens` 0.

Logprobs (completions' `logprobs`, chat's `logprobs` / `top_logprobs`) cover the tokens whose text the choice shows:
not a stop string's tokens nor a stop token, and in a stream a token's entry goes out with the chunk that shows the
start of its text. `text_offset` counts characters of the choice's text (a token that ends inside a multi-byte
character puts the next one at that character's start). `n` samples per prompt are choices i * n + j. OpenAI fields
the server does not implement (`logit_bias`, a `best_of` other than `n`, `suffix`, tools, `response_format` other
than text) are refused with a 400 naming the field; other unknown fields are ignored, as vLLM does.

With `reasoning_parser="qwen3"` a chat reply's think block (to the first "</think>", from the reply's start when the
rendered prompt left a block open, or after a "<think>" the reply starts with) is the message's `reasoning`, the rest
its `content`, as vLLM's parser of that name splits them; a stream holds back a possible tag's first characters.

A client that disconnects has its request aborted (its slots and blocks are freed at once). If an engine step raises,
the requests of that step get an error (HTTP 500, or an error event on a stream) and the loop goes on serving.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import hmac
import itertools
import json
import logging
import queue
import re
import socket
import threading
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, CONTENT_TYPE_LATEST
from prometheus_client.core import GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from gdn_jax.chat import ChatTemplate, chat_message, chat_modes
from gdn_jax.engine import EngineStepError, LLMEngine, RequestOutput
from gdn_jax.tokenizer import TextOffsets, text_offsets
from scheduler import SamplingParams

ENGINE_THREAD_STACK_BYTES = 64 << 20
REASONING_PARSERS = ("qwen3",)
THINK_START, THINK_END = "<think>", "</think>"
log = logging.getLogger("gdn_jax.server")


@dataclasses.dataclass
class ServerConfig:
    model_name: str = "tiny"                 # the id clients pass as `model` (another id is a 404, as in vLLM)
    api_key: str | None = None
    max_request_bytes: int = 1 << 20         # request bodies above this get a 413
    max_tokens_limit: int = 1024             # the largest `max_tokens` accepted
    max_prompts: int = 64                    # prompts in one /v1/completions request
    chat_template: str | None = None         # jinja source; None: /v1/chat/completions answers 400
    special_tokens: dict[str, str] = dataclasses.field(default_factory=dict)  # the template's bos_token, ...
    reasoning_parser: str | None = None      # "qwen3": a chat reply's think block goes to `reasoning` (vLLM's way)

    def __post_init__(self):
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS} or None, got "
                             f"{self.reasoning_parser!r}")


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


class EngineError(Exception):
    """The engine failed this request (a step raised); reported as a 500 or an in-band stream error."""


def _error(status: int, message: str, param: str | None = None, kind: str | None = None) -> JSONResponse:
    kind = kind or {401: "authentication_error", 413: "invalid_request_error", 500: "server_error"}.get(
        status, "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


# ---- request bodies ----------------------------------------------------------------------------------------------
class _Body(BaseModel):
    # strict: a string is not silently taken as a number, nor a number as a string. Unknown fields are ignored (as
    # vLLM does), except the OpenAI fields this server does not implement (`UNSUPPORTED`), which are refused when set.
    model_config = ConfigDict(strict=True, extra="ignore")


# OpenAI request fields that would change the result and that this server does not implement, with the values that
# mean "off" (accepted). Any other value is a 400 naming the field: ignoring it would return something else than asked.
UNSUPPORTED = {"logit_bias": (None, {}), "suffix": (None, ""), "tools": (None, []),
               "functions": (None, []), "tool_choice": (None, "none", "auto"), "function_call": (None, "none", "auto"),
               "response_format": (None, {"type": "text"}),
               # vLLM's extra request fields of the same kind (it implements them; ignoring one would return another
               # completion than vLLM's)
               "allowed_token_ids": (None,), "bad_words": (None, []), "truncate_prompt_tokens": (None,),
               "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
               "structured_outputs": (None,), "logits_processors": (None,), "prompt_logprobs": (None,),
               "use_beam_search": (None, False), "length_penalty": (None, 1.0, 1),
               "skip_special_tokens": (None, True), "return_tokens_as_token_ids": (None, False)}


def refuse_unsupported(req: BaseModel) -> None:
    for name, off in UNSUPPORTED.items():
        value = getattr(req, name, None)
        if not any(value == v and type(value) is type(v) for v in off):
            raise BadRequest(f"{name} is not supported by this server (got {json.dumps(value, default=str)[:80]})",
                             name)


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None   # the rest are vLLM's extra sampling parameters
    min_p: float | None = None
    min_tokens: int | None = None
    include_stop_str_in_output: bool | None = False
    logit_bias: Any = None  # UNSUPPORTED
    response_format: Any = None  # UNSUPPORTED (vLLM takes it in completions too)
    allowed_token_ids: Any = None  # UNSUPPORTED, as the rest (vLLM's extra fields; echo + logprobs scores a prompt)
    bad_words: Any = None
    truncate_prompt_tokens: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    logits_processors: Any = None
    prompt_logprobs: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    skip_special_tokens: Any = None  # true (special tokens' text left out) is what this server does
    return_tokens_as_token_ids: Any = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: Any = None  # only equal to n (`sampling_params`)
    suffix: Any = None  # UNSUPPORTED


class ChatMessage(_Body):
    role: str
    content: Any = None  # a string, or a list of text parts ({"type": "text", "text": ...})
    name: str | None = None
    tool_calls: Any = None  # refused when set (`chat_message`): tools are not supported


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more template variables (`enable_thinking`, ...)
    add_generation_prompt: bool = True  # vLLM's: open the assistant's turn after the messages
    continue_final_message: bool = False  # vLLM's: the reply continues the last (assistant) message
    include_reasoning: bool = True  # vLLM's: false leaves the reasoning parser's `reasoning` out of the reply
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: Any = None
    functions: Any = None
    tool_choice: Any = None
    function_call: Any = None


def _parse(model: type[BaseModel], body: bytes) -> Any:
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"malformed JSON body: {e}") from None
    except RecursionError:  # Python's parser recurses once per level of nesting
        raise BadRequest("malformed JSON body: nested too deeply") from None
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except RecursionError:
        raise BadRequest("invalid body: nested too deeply") from None
    except ValidationError as e:
        err = e.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else "body"
        msg = err["msg"]
        if field == "prompt" and err["type"] != "missing":
            msg = "must be a string, a list of token ids, a list of strings or a list of token-id lists"
        got = json.dumps(err.get("input"), default=str)
        raise BadRequest(f"invalid field '{field}': {msg} (got {got[:80]})", param=field) from None


# ---- the engine thread -------------------------------------------------------------------------------------------
class _Sink:
    """Where one engine request's outputs go: an asyncio queue of (index, RequestOutput | Exception)."""

    def __init__(self, aloop: asyncio.AbstractEventLoop, q: asyncio.Queue, index: int):
        self.aloop, self.q, self.index = aloop, q, index
        self.first = True

    def put(self, item) -> None:
        try:
            self.aloop.call_soon_threadsafe(self.q.put_nowait, (self.index, item))
        except RuntimeError:  # the event loop is closed (shutdown)
            pass


class EngineLoop:
    """Drives `LLMEngine.step()` in one background thread; add/abort arrive as commands applied between steps."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}
        self._stop = threading.Event()
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

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._cmds.put(("wake",))
        self._thread.join(timeout)

    @property
    def num_active(self) -> int:
        return len(self._sinks)

    # called from the asyncio side ------------------------------------------------------------------------------
    def submit(self, request_id: str, prompt, params: SamplingParams, sink: _Sink, arrival: float) -> None:
        self._cmds.put(("add", request_id, prompt, params, sink, arrival))

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
            _, rid, prompt, params, sink, arrival = cmd
            try:
                self.engine.add_request(rid, prompt, params, arrival_time=arrival)
            except Exception as e:  # noqa: BLE001 - validated before; reported to the one client
                sink.put(BadRequest(str(e)) if isinstance(e, ValueError) else EngineError(f"{type(e).__name__}: {e}"))
                return
            self._sinks[rid] = sink
        elif cmd[0] == "abort" and self._sinks.pop(cmd[1], None) is not None:
            self.engine.abort_request(cmd[1])
            self.finished.labels("abort").inc()

    def _emit(self, out: RequestOutput) -> None:
        sink = self._sinks.get(out.request_id)
        if sink is None:
            return
        m = out.metrics
        if sink.first and m.ttft is not None:
            sink.first = False
            self.ttft.observe(m.ttft)
        if out.finished:
            del self._sinks[out.request_id]
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
            self._sinks.pop(rid).put(err)
            self.engine.abort_request(rid)
            self.finished.labels("error").inc()
        if sched.inflight is not None:
            sched.fail_step(sched.inflight)
        self._snapshot()


class _StatsCollector:
    """Exposes the engine's `cache_stats()` snapshot at scrape time, as labelled gauges."""

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


# ---- the HTTP application ----------------------------------------------------------------------------------------
class _Server:
    def __init__(self, loop: EngineLoop, config: ServerConfig):
        self.loop, self.config, self.engine = loop, config, loop.engine
        self.max_model_len = self.engine.max_model_len
        self._chat = ChatTemplate(config.chat_template, config.special_tokens) if config.chat_template else None
        self._ids = itertools.count()

    # -- shared parts -------------------------------------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        ok = hmac.compare_digest(token.strip().encode(), key.encode()) and scheme.lower() == "bearer"
        if not ok:
            raise BadRequest("invalid or missing API key: send 'Authorization: Bearer <key>'", status=401)

    def check_model(self, req: "_Sampling") -> None:
        """A request naming a model this server does not serve is a 404 (vLLM's answer); one naming none is served."""
        if req.model is not None and req.model != self.config.model_name:
            raise BadRequest(f"The model `{req.model}` does not exist: this server serves `{self.config.model_name}` "
                             "(GET /v1/models)", "model", status=404)

    async def read_body(self, request: Request) -> bytes:
        limit = self.config.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BadRequest(f"request body of {declared} bytes exceeds the limit of {limit}", status=413)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise BadRequest(f"request body exceeds the limit of {limit} bytes", status=413)
        return bytes(body)

    def sampling_params(self, req: _Sampling, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None, num_prompt_tokens: int, score_only: bool = False,
                        names: dict[str, str] | None = None) -> SamplingParams:
        """The engine's parameters for a request. `score_only` (a completions request with `echo`, `logprobs` and
        `max_tokens` 0: the prompt scored, nothing generated) lets `max_tokens` be 0; the engine then samples one
        token, which the response leaves out. `names`: the request's own names of `max_tokens` and `logprobs`
        (chat: `max_completion_tokens`, `top_logprobs`), for the errors."""
        names = {"max_tokens": "max_tokens", "logprobs": "logprobs", **(names or {})}
        refuse_unsupported(req)
        # the model's recommended sampling (generation_config.json, unless the engine was built with
        # generation_config="vllm") for the fields the request leaves unset, and its max_new_tokens as a cap (vLLM's)
        model = self.engine.default_sampling
        max_tokens = min(max_tokens, model.get("max_tokens", max_tokens))

        def unset(name, value, default):
            return model.get(name, default) if value is None else value

        if req.stream_options is not None and not req.stream:  # as the OpenAI API: not silently ignored
            raise BadRequest("stream_options needs stream: true", "stream_options")
        best_of = getattr(req, "best_of", None)
        if best_of is not None and best_of not in (1, req.n or 1):  # more samples than returned: not implemented
            raise BadRequest(f"best_of is not supported by this server beyond n (got best_of {best_of}, n "
                             f"{req.n or 1})", "best_of")
        for name in ("presence_penalty", "frequency_penalty"):  # the OpenAI API's range
            if getattr(req, name) is not None and not -2.0 <= getattr(req, name) <= 2.0:
                raise BadRequest(f"{name} must be in [-2, 2], got {getattr(req, name)}", name)
        if req.seed is not None and not 0 <= req.seed < 2**32:
            raise BadRequest(f"seed must be in [0, 2**32), got {req.seed}", "seed")
        name = names["max_tokens"]
        if not int(not score_only) <= max_tokens <= self.config.max_tokens_limit:
            hint = max_tokens == 0 and isinstance(req, CompletionRequest)
            raise BadRequest(f"{name} must be in [1, {self.config.max_tokens_limit}], got {max_tokens}"
                             + (" (0 only with echo and logprobs: the prompt scored alone)" if hint else ""), name)
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise BadRequest(f"this model's maximum context length is {self.max_model_len} tokens; the request "
                             f"needs {num_prompt_tokens + max_tokens} ({num_prompt_tokens} in the prompt, "
                             f"{max_tokens} in the completion)", name)
        vocab = self.engine.cfg.vocab_size
        bad = [t for t in req.stop_token_ids or () if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"stop_token_ids: {bad[0]} is outside the vocabulary [0, {vocab})", "stop_token_ids")
        try:
            return SamplingParams(
                temperature=unset("temperature", req.temperature, 1.0), top_p=unset("top_p", req.top_p, 1.0),
                top_k=unset("top_k", req.top_k, -1),
                max_tokens=max(1, max_tokens), seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
                ignore_eos=bool(req.ignore_eos), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=unset("repetition_penalty", req.repetition_penalty, 1.0),
                min_p=unset("min_p", req.min_p, 0.0), min_tokens=req.min_tokens or 0, n=1 if req.n is None else req.n,
                skip_reading_prefix_cache=prompt_logprobs is not None,
                include_stop_str_in_output=bool(req.include_stop_str_in_output))
        except ValueError as e:  # the message begins with the field's name
            field, rest = (str(e).split(" ", 1) + [""])[:2]
            if field not in SamplingParams.__dataclass_fields__:
                raise BadRequest(str(e), None) from None
            name = names.get(field, field)
            raise BadRequest(f"{name} {rest}", name) from None

    def validate_prompt(self, prompt, params: SamplingParams, field: str = "prompt") -> tuple[str | None, list[int]]:
        """`field`: the request's field the prompt came from, for the errors (chat: `messages`)."""
        try:
            text, ids, _ = self.engine.validate_request(prompt, params)
        except ValueError as e:
            raise BadRequest(f"{field}: {e}", field) from None
        return text, ids

    def check_request(self, ids: list[int], params: SamplingParams, field: str = "prompt") -> None:
        """The engine's checks of a prompt with its parameters (its stop ids with the model's further end-of-sequence
        ids, whole-row prompt logprobs, ...), before anything is submitted: a refusal is a 400 naming the field, not
        an error inside a stream that has begun."""
        try:
            self.engine.validate_request(ids, params)
        except ValueError as e:
            name = re.match(r"\w*", str(e)).group()
            raise BadRequest(str(e), name if name in SamplingParams.__dataclass_fields__ else field) from None

    async def run(self, request: Request, prompts: list[tuple[str | None, list[int]]], params: SamplingParams,
                  arrival: float):
        """Submits one engine request per prompt; yields (index, RequestOutput) until all finish. Leaving early
        (client gone, error) aborts whatever is unfinished."""
        aloop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        base = f"{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        rids = [f"{base}-{i}" for i in range(len(prompts))]
        for i, (text, ids) in enumerate(prompts):
            self.loop.submit(rids[i], {"prompt_token_ids": ids, "prompt": text}, params, _Sink(aloop, q, i), arrival)
        pending = set(range(len(prompts)))
        next_check = time.monotonic() + 0.5
        try:
            while pending:
                try:
                    async with asyncio.timeout(0.5):  # (no task per token, unlike wait_for on 3.11)
                        i, item = await q.get()
                except TimeoutError:
                    item = None
                if time.monotonic() >= next_check or item is None:  # a gone client is noticed within ~0.5 s
                    next_check = time.monotonic() + 0.5
                    if await request.is_disconnected():
                        return
                if item is None:
                    continue
                if isinstance(item, Exception):
                    raise item
                if item.finished:
                    pending.discard(i)
                yield i, item
        finally:
            for i in pending:
                self.loop.abort(rids[i])

    def usage(self, finals: list[RequestOutput], score_only: bool = False) -> dict:
        p = sum(len(o.prompt_token_ids) for o in finals)
        c = 0 if score_only else sum(len(comp.token_ids) for o in finals for comp in o.outputs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in finals)}}

    # -- /v1/completions ----------------------------------------------------------------------------------------
    def completion_prompts(self, req: CompletionRequest) -> list:
        p = req.prompt
        if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)) or p == []:
            prompts = [p]
        else:
            prompts = list(p)
        if len(prompts) > self.config.max_prompts:
            raise BadRequest(f"at most {self.config.max_prompts} prompts per request, got {len(prompts)}", "prompt")
        return prompts

    def logprobs_block(self, ids: list[int], entries: list, offsets: list[int]) -> dict:
        """The completions API's logprobs object for `ids` (entries: per token a {id: Logprob} dict, or None;
        offsets: where each token's text begins in the choice's text, `TextOffsets`)."""
        dec = self.engine.decode_token
        tokens, lps, tops = [], [], []
        for t, entry in zip(ids, entries):
            tokens.append(dec(t))
            if entry is None:
                lps.append(None)
                tops.append(None)
            else:
                lps.append(entry[t].logprob)
                tops.append({lp.decoded_token if lp.decoded_token is not None else dec(k): lp.logprob
                             for k, lp in entry.items()})
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": list(offsets)}

    def prompt_logprobs_block(self, out: RequestOutput, ids: list[int]) -> dict:
        """`logprobs_block` of an echoed prompt (its first token, and any position not computed, has None)."""
        return self.logprobs_block(ids, out.prompt_logprobs or [None] * len(ids),
                                   text_offsets(self.engine.tokenizer, ids))

    def chat_logprobs(self, ids: list[int], entries: list, k: int) -> dict:
        """The chat API's logprobs object for `ids`: per token its text, logprob and bytes, and the `k` likeliest."""
        tok = self.engine.tokenizer

        def item(t, lp) -> dict:
            return {"token": self.engine.decode_token(t), "logprob": lp.logprob, "bytes": list(tok.token_bytes(t))}

        return {"content": [{**item(t, entry[t]), "top_logprobs": [
            item(u, lp) for u, lp in sorted(entry.items(), key=lambda e: e[1].rank) if lp.rank <= k]}
            for t, entry in zip(ids, entries)]}

    async def completions(self, request: Request) -> Response:
        arrival = time.perf_counter()
        self.check_auth(request)
        req = _parse(CompletionRequest, await self.read_body(request))
        self.check_model(req)
        raw = self.completion_prompts(req)
        echo_lp = bool(req.echo) and req.logprobs is not None
        score_only = echo_lp and req.max_tokens == 0  # the legacy way to score a prompt: nothing generated
        prompts, params = [], None
        for prompt in raw:
            text, ids = self.validate_prompt(prompt, SamplingParams())
            params = self.sampling_params(req, 16 if req.max_tokens is None else req.max_tokens, req.logprobs,
                                          req.logprobs if echo_lp else None, len(ids), score_only)
            self.check_request(ids, params)
            prompts.append((text if text is not None else self.engine.tokenizer.decode(ids), ids))
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": cid, "object": "text_completion", "created": created, "model": self.config.model_name}
        if req.stream:
            return self._stream(request, prompts, params, arrival, head, self._completion_chunks(req, prompts,
                                                                                                score_only),
                                req.stream_options, score_only)
        finals: dict[int, RequestOutput] = {}
        async for i, out in self.run(request, prompts, params, arrival):
            if out.finished:
                finals[i] = out
        if len(finals) < len(prompts):
            return Response(status_code=499)  # client gone
        tok, choices = self.engine.tokenizer, []
        for i in range(len(prompts)):  # choice i * n + j: sample j of prompt i
            out = finals[i]
            prompt_text, ids = prompts[i]
            base = len(prompt_text) if req.echo else 0
            pre = self.prompt_logprobs_block(out, ids) if req.echo and req.logprobs is not None else None
            for comp in out.outputs:
                text, lp = "" if score_only else comp.text, None
                if req.logprobs is not None:
                    offsets = text_offsets(tok, comp.token_ids, base)
                    n = 0 if score_only else shown_tokens(offsets, base + len(text), comp.finish_reason != "stop")
                    lp = self.logprobs_block(comp.token_ids[:n], comp.logprobs[:n], offsets[:n])
                    if pre is not None:
                        lp = {k: pre[k] + lp[k] for k in lp}
                choices.append({"index": len(choices), "text": prompt_text + text if req.echo else text,
                                "logprobs": lp, "finish_reason": "length" if score_only else comp.finish_reason,
                                "stop_reason": None if score_only else comp.stop_reason})
        return JSONResponse({**head, "choices": choices,
                             "usage": self.usage([finals[i] for i in sorted(finals)], score_only)})

    def _completion_chunks(self, req: CompletionRequest, prompts, score_only: bool):
        """Turns successive outputs of prompt i into streamed choices (one per sample j with news, index i * n + j).
        A token's logprobs go out with the chunk that shows the start of its text (`_SampleStream`)."""
        streams: dict[tuple, _SampleStream] = {}

        def one(i: int, j: int, out: RequestOutput) -> dict | None:
            comp = out.outputs[j]
            prompt_text, ids = prompts[i]
            prefix, lp = "", None
            if (i, j) not in streams:  # first chunk of this sample: the echoed prompt rides along
                streams[i, j] = _SampleStream(self.engine.tokenizer, len(prompt_text) if req.echo else 0,
                                              req.logprobs is not None and not score_only)
                if req.echo:
                    prefix = prompt_text
                    if req.logprobs is not None:
                        lp = self.prompt_logprobs_block(out, ids)
            st = streams[i, j]
            new, fresh, shown = st.advance(comp, "" if score_only else comp.text, out.finished)
            if req.logprobs is not None:
                block = self.logprobs_block(comp.token_ids[shown], comp.logprobs[shown], st.offsets_of(shown))
                lp = block if lp is None else {k: lp[k] + block[k] for k in lp}
            if not (prefix or new or fresh or out.finished):  # a chunk per new token, even when its text is held
                return None
            return {"index": i * len(out.outputs) + j, "text": prefix + new, "logprobs": lp,
                    "finish_reason": ("length" if score_only else comp.finish_reason) if out.finished else None,
                    "stop_reason": comp.stop_reason if out.finished and not score_only else None}

        def delta(i: int, out: RequestOutput) -> list[dict]:
            return [c for j in range(len(out.outputs)) if (c := one(i, j, out)) is not None]

        return delta

    def _stream(self, request: Request, prompts, params, arrival, head: dict, delta, stream_options,
                score_only: bool = False) -> Response:
        include_usage = bool(stream_options and stream_options.include_usage)

        async def events():
            finals = []
            try:
                async for i, out in self.run(request, prompts, params, arrival):
                    if out.finished:
                        finals.append(out)
                    for choice in delta(i, out):  # one event per choice, as the OpenAI API streams them
                        yield f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"
            except Exception as e:  # noqa: BLE001 - headers are sent: report in-band, as _error would have
                status = e.status if isinstance(e, BadRequest) else 500
                kind = "server_error" if status == 500 else "invalid_request_error"
                yield f"data: {json.dumps({'error': {'message': str(e), 'type': kind, 'code': status}})}\n\n"
                yield "data: [DONE]\n\n"
                return
            if include_usage and len(finals) == len(prompts):
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': self.usage(finals, score_only)})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # -- /v1/chat/completions -----------------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        arrival = time.perf_counter()
        self.check_auth(request)
        body = await self.read_body(request)
        if self._chat is None:
            raise BadRequest("this model has no chat template (no chat_template.jinja or tokenizer_config.json "
                             "chat_template in its folder; pass --chat-template FILE): use /v1/completions")
        req = _parse(ChatRequest, body)
        self.check_model(req)
        if not req.messages:
            raise BadRequest("messages must not be empty", "messages")
        try:  # the messages are checked first, the template runs after the other fields' checks
            messages = [chat_message(i, {"role": m.role, "content": m.content, "name": m.name,
                                         "tool_calls": m.tool_calls}) for i, m in enumerate(req.messages)]
        except ValueError as e:
            raise BadRequest(str(e), "messages") from None
        if req.top_logprobs is not None and not req.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        try:  # vLLM's: the two modes, also as chat_template_kwargs (which win); not both
            modes = chat_modes(req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs)
        except ValueError as e:  # both modes on, or a value of chat_template_kwargs (the request's own are typed)
            both = str(e).startswith("add_generation_prompt and continue_final_message")
            raise BadRequest(str(e), "continue_final_message" if both else "chat_template_kwargs") from None
        k = (req.top_logprobs or 0) if req.logprobs else None
        try:  # the template's own error (raise_exception): the request's problem
            text = self._chat.render(messages, *modes)
        except ValueError as e:
            raise BadRequest(str(e), "messages") from None
        text, ids = self.validate_prompt(text, SamplingParams(), "messages")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:  # as the OpenAI API: as long as the context allows (here also the server's limit)
            max_tokens = max(1, min(self.config.max_tokens_limit, self.max_model_len - len(ids)))
        params = self.sampling_params(req, max_tokens, k, None, len(ids), names={
            "logprobs": "top_logprobs",
            "max_tokens": "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"})
        self.check_request(ids, params, "messages")
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.config.model_name}
        tok = self.engine.tokenizer
        parse = self.config.reasoning_parser is not None
        keep = req.include_reasoning  # false: the reasoning is split off and left out (vLLM's include_reasoning)
        opened = parse and prompt_opens_reasoning(text)
        if req.stream:
            streams: dict[int, _SampleStream] = {}
            parts: dict[int, _ReasoningStream] = {}

            def one(j: int, out: RequestOutput) -> dict | None:
                comp = out.outputs[j]
                d, lp = {}, None
                if j not in streams:
                    d["role"], streams[j] = "assistant", _SampleStream(tok, 0, k is not None)
                    parts[j] = _ReasoningStream(opened)
                new, _, shown = streams[j].advance(comp, comp.text, out.finished)
                if parse:
                    d.update((name, new) for name, new in parts[j].advance(streams[j].text, out.finished).items()
                             if keep or name != "reasoning")
                elif new:
                    d["content"] = new
                if shown.stop > shown.start:
                    lp = self.chat_logprobs(comp.token_ids[shown], comp.logprobs[shown], k)
                if not d and lp is None and not out.finished:
                    return None
                return {"index": j, "delta": d, "logprobs": lp,
                        "finish_reason": comp.finish_reason if out.finished else None}

            def delta(i: int, out: RequestOutput) -> list[dict]:
                return [c for j in range(len(out.outputs)) if (c := one(j, out)) is not None]

            return self._stream(request, [(text, ids)], params, arrival, {**head, "object": "chat.completion.chunk"},
                                delta, req.stream_options)
        final = None
        async for _, out in self.run(request, [(text, ids)], params, arrival):
            final = out if out.finished else final
        if final is None:
            return Response(status_code=499)
        choices = []
        for j, comp in enumerate(final.outputs):
            lp = None
            if k is not None:
                n = shown_tokens(text_offsets(tok, comp.token_ids), len(comp.text), comp.finish_reason != "stop")
                lp = self.chat_logprobs(comp.token_ids[:n], comp.logprobs[:n], k)
            message = {"role": "assistant", "content": comp.text}
            if parse:
                reasoning, message["content"] = split_reasoning(comp.text, opened, True)
                message["reasoning"] = reasoning if keep else None
            choices.append({"index": j, "message": message, "logprobs": lp, "finish_reason": comp.finish_reason})
        return JSONResponse({**head, "object": "chat.completion", "choices": choices, "usage": self.usage([final])})


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether a rendered chat prompt leaves a think block open, so that the reply starts inside its reasoning
    (Qwen3.5's template with thinking on ends with "<think>\\n"; with `enable_thinking` false it closes the block)."""
    start = prompt.rfind(THINK_START)
    return start >= 0 and prompt.find(THINK_END, start) < 0


def split_reasoning(text: str, opened: bool, finished: bool) -> tuple[str | None, str | None]:
    """A chat reply's text -> (reasoning, content), None for a part it has not (or not yet) got. The reasoning runs
    to the first "</think>": from the reply's start if the prompt opened the block (`opened`), else if the reply
    opens it itself (an older template: the reply starts with "<think>", which is left out, as is one a reply to a
    prompt that opened the block starts with); a reply without a think block is all content. While not
    `finished`, text that may still become a tag (a start of "<think>" at the reply's start, a start of "</think>"
    at the reasoning's end) is held back, so that a stream never sends a tag's characters."""
    if text.startswith(THINK_START):  # a reply that opens the block itself (or, after a prompt that did, again)
        text, opened = text[len(THINK_START):], True
    elif not finished and text and THINK_START.startswith(text):
        return ("" if opened else None), None
    elif not opened:
        return None, text
    reasoning, end, content = text.partition(THINK_END)
    if end:
        return reasoning, content or None
    if not finished:
        held = next((n for n in range(min(len(THINK_END) - 1, len(reasoning)), 0, -1)
                     if THINK_END.startswith(reasoning[-n:])), 0)
        reasoning = reasoning[:len(reasoning) - held]
    return reasoning, None


class _ReasoningStream:
    """What a stream has sent of a reply's reasoning and content (`split_reasoning` of the text sent so far)."""

    def __init__(self, opened: bool):
        self.opened, self.reasoning, self.content = opened, "", ""

    def advance(self, text: str, finished: bool) -> dict:
        """The reply's text sent so far -> the delta fields not sent yet ("reasoning", "content")."""
        reasoning, content = split_reasoning(text, self.opened, finished)
        out = {}
        for name, now in (("reasoning", reasoning or ""), ("content", content or "")):
            new = now[len(getattr(self, name)):]
            if new:
                out[name] = new
                setattr(self, name, now)
        return out


class _SampleStream:
    """What a stream has sent of one sample: its text, its token count, and how many of its tokens had their
    logprobs sent: those whose text begins inside the text sent (`shown_tokens`; held-back text holds them), at the
    end all of them unless a stop string or stop token ended the sample. Token offsets (from `base`, the sample's
    start in the choice's text) are tracked only when `logprobs`."""

    def __init__(self, tokenizer, base: int, logprobs: bool):
        self.text, self.num_tokens, self.shown, self.base = "", 0, 0, base
        self.offsets = TextOffsets(tokenizer, base) if logprobs else None

    def advance(self, comp, text: str, finished: bool) -> tuple[str, bool, slice]:
        """The sample's output now, with `text` its text shown -> (the text not sent yet, whether tokens came since
        the last call, the tokens whose logprobs go out now)."""
        new = text[len(self.text):] if text.startswith(self.text) else ""
        self.text += new
        fresh, self.num_tokens = len(comp.token_ids) > self.num_tokens, len(comp.token_ids)
        first = self.shown
        if self.offsets is not None:
            at = self.offsets.add(comp.token_ids[len(self.offsets.offsets):])
            self.shown = max(first, shown_tokens(at, self.base + len(self.text),
                                                 finished and comp.finish_reason != "stop"))
        return new, fresh, slice(first, self.shown)

    def offsets_of(self, tokens: slice) -> list[int]:
        return self.offsets.offsets[tokens] if self.offsets is not None else []


def shown_tokens(offsets: list[int], end: int, all_: bool) -> int:
    """How many of a completion's tokens (their text offsets `offsets`) a response shows: those whose text begins
    before `end`, the end of the text shown; all of them if `all_` (it ended neither on a stop string nor a stop
    token, and nothing is held back)."""
    return len(offsets) if all_ else bisect.bisect_left(offsets, end)


def create_app(loop: EngineLoop, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI application over a started `EngineLoop`."""
    config = config or ServerConfig()
    srv = _Server(loop, config)
    app = FastAPI(title="gdn-jax", version="0.1.0", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = srv

    @app.exception_handler(BadRequest)
    async def _bad(_: Request, e: BadRequest):
        return _error(e.status, e.message, e.param)

    @app.exception_handler(EngineError)
    async def _engine_failed(_: Request, e: EngineError):
        return _error(500, str(e))

    @app.exception_handler(StarletteHTTPException)  # an unknown path or method: the same error shape as the rest
    async def _http(request: Request, e: StarletteHTTPException):
        return _error(e.status_code, f"{e.detail} ({request.method} {request.url.path})")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await srv.completions(request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await srv.chat(request)

    @app.get("/v1/models")
    async def models(request: Request):
        srv.check_auth(request)
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "gdn-jax", "max_model_len": srv.max_model_len}]}

    @app.get("/health")
    async def health():
        if loop.consecutive_failures:
            return PlainTextResponse(f"unhealthy: the last {loop.consecutive_failures} engine step(s) failed", 503)
        return PlainTextResponse("ok")

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(loop.registry), media_type=CONTENT_TYPE_LATEST)

    return app


# ---- running it --------------------------------------------------------------------------------------------------
class ServerThread:
    """A uvicorn server in a background thread on a loopback port (tests, benchmarks, notebooks).
    `port=0` picks a free port; `.url` is the base URL."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        for _ in range(200):  # bounded: 20 s
            if self.server.started:
                return self
            time.sleep(0.1)
        raise RuntimeError("the server did not start within 20 s")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def serve(engine: LLMEngine, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info") -> None:
    """Runs the server in the foreground until interrupted."""
    import uvicorn
    loop = EngineLoop(engine).start()
    try:
        uvicorn.run(create_app(loop, config), host=host, port=port, log_level=log_level,
                    timeout_graceful_shutdown=5)
    finally:
        loop.shutdown()


__all__ = ["BadRequest", "EngineError", "EngineLoop", "ServerConfig", "ServerThread", "create_app", "serve"]
