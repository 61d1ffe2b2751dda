"""What /v1/completions and /v1/chat/completions share: the server's settings, and the base of their handlers.

`OpenAIServing` checks a request (API key, model name, body size, sampling parameters, the prompt against the engine's
limits: pure reads of the engine's configuration), submits it to the `EngineLoop`, and reads its outputs back. A
request's `model`, if given, must be the served name: another is a 404, as in vLLM. A client that disconnects has its
request aborted (its slots and blocks are freed at once).
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import hmac
import itertools
import json
import re
import time
import uuid

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from gdn_jax.engine import RequestOutput
from gdn_jax.entrypoints.openai.engine_loop import EngineLoop, Sink
from gdn_jax.entrypoints.openai.protocol import (BadRequest, CompletionRequest, SamplingRequest, refuse_unsupported,
                                                 stream_error_event)
from gdn_jax.entrypoints.openai.reasoning import REASONING_PARSERS
from gdn_jax.tokenizer import TextOffsets
from scheduler import SamplingParams


@dataclasses.dataclass
class ServerConfig:
    """The HTTP server's settings (the engine has its own)."""

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


class OpenAIServing:
    """The checks, submission and streaming that the endpoints' handlers share."""

    def __init__(self, loop: EngineLoop, config: ServerConfig):
        self.loop, self.config, self.engine = loop, config, loop.engine
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

    async def run(self, request: Request, prompts: list[tuple[str | None, list[int]]], params: SamplingParams,
                  arrival: float):
        """Submits one engine request per prompt; yields (index, RequestOutput) until all finish. Leaving early
        (client gone, error) aborts whatever is unfinished."""
        aloop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        base = f"{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        rids = [f"{base}-{i}" for i in range(len(prompts))]
        for i, (text, ids) in enumerate(prompts):
            self.loop.submit(rids[i], {"prompt_token_ids": ids, "prompt": text}, params, Sink(aloop, q, i), arrival)
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

    def stream_response(self, request: Request, prompts, params, arrival, head: dict, delta, stream_options,
                        score_only: bool = False) -> Response:
        """A server-sent event stream of `run`'s outputs: per output, one event per choice `delta(i, out)` returns."""
        include_usage = bool(stream_options and stream_options.include_usage)

        async def events():
            finals = []
            try:
                async for i, out in self.run(request, prompts, params, arrival):
                    if out.finished:
                        finals.append(out)
                    for choice in delta(i, out):  # one event per choice, as the OpenAI API streams them
                        yield f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"
            except Exception as e:  # noqa: BLE001 - headers are sent: report in-band, as error_response would have
                yield stream_error_event(e)
                yield "data: [DONE]\n\n"
                return
            if include_usage and len(finals) == len(prompts):
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': self.usage(finals, score_only)})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class SampleStream:
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
