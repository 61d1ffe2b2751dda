"""What /v1/completions and /v1/chat/completions share: the base of their handlers.

`OpenAIServing` checks a request (API key, model name, body size, sampling parameters, the prompt against the engine's
limits: pure reads of the engine's configuration), submits it to the `EngineLoop`, and reads its outputs back. A
request's `model`, if given, must be the served name: another is a 404, as in vLLM. A client that disconnects has its
request aborted (its slots and blocks are freed at once).

Limits: a body must arrive within `body_timeout` (else a 408, and the connection is closed); one request may add at
most `max_sequences_per_request` sequences (prompts x n, else a 400), and none is admitted while the sequences
submitted and not yet started would pass `max_waiting_sequences` (a 429 with Retry-After, as TGI answers a full
queue). What waits for a client is bounded whatever it reads: the latest output per prompt (`Mailbox`).

Shutdown (`GracefulShutdown`): once begun, nothing is admitted (503); at its deadline every running request ends, a
stream with an error event and `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import bisect
import hmac
import itertools
import json
import re
import time
import uuid

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.requests import ClientDisconnect

from gdn_jax.engine import RequestOutput
from gdn_jax.engine.input_processor import checkpoint_positions as check_positions
from gdn_jax.entrypoints.openai.engine_loop import RETRY_AFTER_S, EngineLoop, Mailbox, Sink
from gdn_jax.entrypoints.openai.protocol import (BadRequest, CompletionRequest, SamplingRequest, refuse_unsupported,
                                                 stream_error_event)
from gdn_jax.entrypoints.openai.server_config import ServerConfig
from gdn_jax.tokenizer import TextOffsets
from scheduler import SamplingParams


class GracefulShutdown:
    """The server's shutdown as the handlers see it: once begun nothing is admitted; at the deadline the running
    requests end."""

    def __init__(self):
        self.deadline: float | None = None  # on time.monotonic()'s clock

    def begin(self, timeout: float) -> None:
        if self.deadline is None:
            self.deadline = time.monotonic() + timeout

    @property
    def begun(self) -> bool:
        return self.deadline is not None

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline


class Submission:
    """One HTTP request's engine requests (one per prompt) and the mailbox of their outputs. `close` aborts those not
    finished; it is called however the response ends, and again does nothing."""

    def __init__(self, loop: EngineLoop, mailbox: Mailbox, rids: list[str]):
        self.loop, self.mailbox, self.rids = loop, mailbox, rids
        self.pending = set(range(len(rids)))  # prompts not finished

    def close(self) -> None:
        for i in sorted(self.pending):
            self.loop.abort(self.rids[i])
        self.pending.clear()


class EventStream(StreamingResponse):
    """A server-sent event stream that closes its `Submission` however it ends (a client gone, a cancellation)."""

    def __init__(self, events, submission: Submission):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.submission = submission

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.submission.close()


class OpenAIServing:
    """The checks, submission and streaming that the endpoints' handlers share."""

    def __init__(self, loop: EngineLoop, config: ServerConfig, shutdown: GracefulShutdown | None = None):
        self.loop, self.config, self.engine = loop, config, loop.engine
        self.shutdown = shutdown or GracefulShutdown()
        self.max_model_len = self.engine.max_model_len
        self._ids = itertools.count()

    def check_auth(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        ok = hmac.compare_digest(token.strip().encode(), key.encode()) and scheme.lower() == "bearer"
        if not ok:
            raise BadRequest("invalid or missing API key: send 'Authorization: Bearer <key>'", status=401)

    def check_model(self, req: SamplingRequest) -> None:
        """A request naming a model this server does not serve is a 404 (vLLM's answer); one naming none is served."""
        if req.model is not None and req.model != self.config.model_name:
            raise BadRequest(f"The model `{req.model}` does not exist: this server serves `{self.config.model_name}` "
                             "(GET /v1/models)", "model", status=404)

    async def read_body(self, request: Request) -> bytes:
        """The request's body: a 413 past `max_request_bytes`, a 408 (the connection then closed) when it has not all
        arrived within `body_timeout`."""
        limit, timeout = self.config.max_request_bytes, self.config.body_timeout
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BadRequest(f"request body of {declared} bytes exceeds the limit of {limit}", status=413)
        body = bytearray()
        try:
            async with asyncio.timeout(timeout):
                async for chunk in request.stream():
                    body += chunk
                    if len(body) > limit:
                        raise BadRequest(f"request body exceeds the limit of {limit} bytes", status=413)
        except TimeoutError:
            raise BadRequest(f"the request body did not arrive within {timeout:g} s ({len(body)} bytes came)",
                             status=408, headers={"Connection": "close"}) from None
        except ClientDisconnect:  # nobody reads the answer
            raise BadRequest("the client closed the connection before its body ended", status=499) from None
        return bytes(body)

    def sampling_params(self, req: SamplingRequest, max_tokens: int, logprobs: int | None,
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

    def submit(self, prompts: list[tuple[str | None, list[int]]], params: SamplingParams, arrival: float,
               checkpoint_positions: list[int] | None = None) -> Submission:
        """Submits one engine request per prompt, if the server admits them: not while it shuts down (503), not more
        than `max_sequences_per_request` sequences (400), not past `max_waiting_sequences` (429). The hinted
        `checkpoint_positions` apply to every prompt (400 naming the field when one does not fit one)."""
        hints = {}
        if checkpoint_positions is not None:
            hints["checkpoint_positions"] = checkpoint_positions
            for _, ids in prompts:
                try:
                    check_positions(checkpoint_positions, len(ids), self.engine.scheduler_config.block_size)
                except ValueError as e:
                    raise BadRequest(str(e), "checkpoint_positions") from None
        if self.shutdown.begun:
            raise BadRequest("the server is shutting down", status=503)
        new, limit = len(prompts) * params.n, self.config.max_sequences_per_request
        if new > limit:
            raise BadRequest(f"the request adds {new} sequences ({len(prompts)} prompt(s) x n={params.n}); at most "
                             f"{limit} per request (max_sequences_per_request)", "n")
        waiting, limit = self.loop.queued_sequences, self.config.max_waiting_sequences
        if waiting + new > limit:
            raise BadRequest(f"the server's queue is full: {waiting} sequences wait to start, this request adds {new}, "
                             f"the limit is {limit} (max_waiting_sequences); retry later", status=429,
                             headers={"Retry-After": str(RETRY_AFTER_S)})
        mailbox = Mailbox(asyncio.get_running_loop())
        base = f"{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        rids = [f"{base}-{i}" for i in range(len(prompts))]
        for i, (text, ids) in enumerate(prompts):
            self.loop.submit(rids[i], {"prompt_token_ids": ids, "prompt": text, **hints}, params,
                             Sink(mailbox, i, params.n), arrival, queue_group=base)
        return Submission(self.loop, mailbox, rids)

    async def outputs(self, request: Request, sub: Submission):
        """Yields (prompt index, RequestOutput) until every prompt finished; a newer output replaces an older one not
        yet read (outputs are cumulative). Leaving early (client gone, error, the shutdown's deadline) aborts
        whatever is unfinished."""
        next_check = time.monotonic() + 0.5
        try:
            while sub.pending:
                items = await sub.mailbox.take(timeout=0.5)
                if time.monotonic() >= next_check or not items:  # a gone client is noticed within ~0.5 s
                    next_check = time.monotonic() + 0.5
                    if await request.is_disconnected():
                        return
                for i, item in sorted(items.items()):
                    if isinstance(item, Exception):
                        raise item
                    if item.finished:
                        sub.pending.discard(i)
                    yield i, item
                if sub.pending and self.shutdown.expired():
                    raise BadRequest("the server shut down before the request finished", status=503)
        finally:
            sub.close()

    def usage(self, finals: list[RequestOutput], score_only: bool = False) -> dict:
        p = sum(len(o.prompt_token_ids) for o in finals)
        c = 0 if score_only else sum(len(comp.token_ids) for o in finals for comp in o.outputs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in finals)}}

    def stream_response(self, request: Request, sub: Submission, head: dict, delta, stream_options,
                        score_only: bool = False) -> Response:
        """A server-sent event stream of `outputs`: per output, one event per choice `delta(i, out)` returns."""
        include_usage = bool(stream_options and stream_options.include_usage)

        async def events():
            finals = []
            try:
                async for i, out in self.outputs(request, sub):
                    if out.finished:
                        finals.append(out)
                    for choice in delta(i, out):  # one event per choice, as the OpenAI API streams them
                        yield f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"
            except Exception as e:  # noqa: BLE001 - headers are sent: report in-band, as error_response would have
                yield stream_error_event(e)
                yield "data: [DONE]\n\n"
                return
            if include_usage and len(finals) == len(sub.rids):
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': self.usage(finals, score_only)})}\n\n"
            yield "data: [DONE]\n\n"

        return EventStream(events(), sub)


class SampleStream:
    """What a stream has sent of one sample: its text, its token count, and how many of its tokens had their
    logprobs sent: those whose text begins inside the text sent (`shown_tokens`; held-back text holds them), at the
    end all of them unless a stop string or stop token ended the sample. Token offsets (from `base`, the sample's
    start in the choice's text) are tracked only when `logprobs`."""

    def __init__(self, tokenizer, base: int, logprobs: bool):
        self.text, self.num_tokens, self.shown, self.base = "", 0, 0, base
        self.offsets = TextOffsets(tokenizer, base) if logprobs else None
        self.last = None  # the CompletionOutput of the last `advance`

    def unchanged(self, comp, finished: bool) -> bool:
        """Nothing to send: the engine gave the same CompletionOutput again (it rebuilds only the samples that
        stepped), and the request has not finished (its end sends every sample's finish reason)."""
        return comp is self.last and not finished

    def advance(self, comp, text: str, finished: bool) -> tuple[str, bool, slice]:
        """The sample's output now, with `text` its text shown -> (the text not sent yet, whether tokens came since
        the last call, the tokens whose logprobs go out now)."""
        self.last = comp
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
