"""The HTTP server's settings, apart from the server itself: `gdn-jax serve` reads their defaults without FastAPI."""

from __future__ import annotations

import dataclasses
import math

from gdn_jax.entrypoints.openai.reasoning import REASONING_PARSERS

TIMEOUTS = ("stream_timeout", "header_timeout", "body_timeout", "keep_alive_timeout", "shutdown_timeout")


@dataclasses.dataclass
class ServerConfig:
    """The HTTP server's settings (the engine has its own). Times are in seconds."""

    model_name: str = "tiny"                 # the id clients pass as `model` (another id is a 404, as in vLLM)
    api_key: str | None = None
    max_request_bytes: int = 1 << 20         # request bodies above this get a 413
    max_tokens_limit: int = 1024             # the largest `max_tokens` accepted
    max_prompts: int = 64                    # prompts in one /v1/completions request
    max_sequences_per_request: int = 1024    # prompts x n of one request; more is a 400
    max_waiting_sequences: int = 4096        # sequences submitted and not started; a request past it gets a 429
    stream_timeout: float = 60.0             # a response its client leaves unread this long is dropped, its requests
                                             # aborted
    header_timeout: float = 10.0             # from a request's first byte to the end of its headers
    body_timeout: float = 30.0               # from the end of the headers to the end of the body (else a 408)
    keep_alive_timeout: float = 5.0          # a connection idle this long (before its first request too) is closed
    shutdown_timeout: float = 20.0           # after SIGTERM, running requests' time to finish before they are ended
    chat_template: str | None = None         # jinja source; None: /v1/chat/completions answers 400
    special_tokens: dict[str, str] = dataclasses.field(default_factory=dict)  # the template's bos_token, ...
    reasoning_parser: str | None = None      # "qwen3": a chat reply's think block goes to `reasoning` (vLLM's way)

    def __post_init__(self):
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS} or None, got "
                             f"{self.reasoning_parser!r}")
        for name in TIMEOUTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive finite number of seconds, got {value!r}")
        for name in ("max_sequences_per_request", "max_waiting_sequences"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_sequences_per_request > self.max_waiting_sequences:
            raise ValueError(f"max_sequences_per_request ({self.max_sequences_per_request}) must not exceed "
                             f"max_waiting_sequences ({self.max_waiting_sequences}): a request that large would "
                             f"never fit the queue")
