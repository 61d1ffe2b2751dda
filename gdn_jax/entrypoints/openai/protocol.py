"""The OpenAI API's request bodies, their parsing, and the error responses.

Bodies are parsed strictly: a string is not silently taken as a number, nor a number as a string. Unknown fields are
ignored, as vLLM does, except the OpenAI fields this server does not implement (`logit_bias`, `suffix`, tools,
`response_format` other than text, and vLLM's extra fields of the same kind), which are refused with a 400 naming the
field when set to anything but their "off" value.
"""

from __future__ import annotations

import json
from typing import Any, get_args

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError


class BadRequest(Exception):
    """A request the server refuses: answered with `status` (400 unless told), the field named in `param`, and
    `headers` (a 429's Retry-After, ...)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, headers: dict | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.headers = message, param, status, headers


class EngineError(Exception):
    """The engine failed this request (a step raised); reported as a 500 or an in-band stream error."""


def error_kind(status: int) -> str:
    """The OpenAI API's error type of an HTTP status."""
    return {401: "authentication_error", 429: "rate_limit_error"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error")


def error_response(status: int, message: str, param: str | None = None, kind: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    """The OpenAI API's error body."""
    return JSONResponse({"error": {"message": message, "type": kind or error_kind(status), "param": param,
                                   "code": status}}, status, headers=headers)


def stream_error_event(e: Exception) -> str:
    """An error inside a stream whose headers are sent: the error body as a server-sent event."""
    status = e.status if isinstance(e, BadRequest) else 500
    return f"data: {json.dumps({'error': {'message': str(e), 'type': error_kind(status), 'code': status}})}\n\n"


class _Body(BaseModel):
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
    """A 400 naming the first `UNSUPPORTED` field the request sets to other than its off value."""
    for name, off in UNSUPPORTED.items():
        value = getattr(req, name, None)
        if not any(value == v and type(value) is type(v) for v in off):
            raise BadRequest(f"{name} is not supported by this server (got {json.dumps(value, default=str)[:80]})",
                             name)


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingRequest(_Body):
    """The fields /v1/completions and /v1/chat/completions share: the model, sampling and streaming."""

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
    # gdn-jax's: prompt positions (token counts) whose states to keep as checkpoints, e.g. where a shared system
    # prompt ends (each at the KV block boundary at or below it; for every prompt of the request)
    checkpoint_positions: list[int] | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None  # only equal to n (`sampling_params`)
    suffix: Any = None  # UNSUPPORTED


class ChatMessage(_Body):
    role: str
    content: Any = None  # a string, or a list of text parts ({"type": "text", "text": ...})
    name: str | None = None
    tool_calls: Any = None  # refused when set (`chat_message`): tools are not supported


class ChatRequest(SamplingRequest):
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


def parse_body(model: type[BaseModel], body: bytes) -> Any:
    """A request body -> `model`, or a 400 naming the first field that does not fit."""
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
        field = error_field(model, err["loc"])
        msg = err["msg"]
        if field == "prompt" and err["type"] != "missing":
            msg = "must be a string, a list of token ids, a list of strings or a list of token-id lists"
        got = json.dumps(err.get("input"), default=str)
        raise BadRequest(f"invalid field '{field}': {msg} (got {got[:80]})", param=field) from None


def error_field(model: type[BaseModel], loc: tuple) -> str:
    """The field a validation error's location names, into nested bodies: `messages[2].role`,
    `stream_options.include_usage`; a union's member names, which pydantic puts in the location, are left out."""
    path, body = "", model
    for part in loc:
        if isinstance(part, int) and body is not None and path:
            path += f"[{part}]"
        elif isinstance(part, str) and body is not None and part in body.model_fields:
            path += f".{part}" if path else part
            body = _body_in(body.model_fields[part].annotation)
        else:
            break
    return path or "body"


def _body_in(annotation) -> type[BaseModel] | None:
    """The request body type inside a field's annotation (`ChatMessage` of `list[ChatMessage]`), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((b for a in get_args(annotation) if (b := _body_in(a)) is not None), None)
