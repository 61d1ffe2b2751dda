from dataclasses import dataclass

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """Per-request sampling settings (vLLM conventions)."""

    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token
    # Text stop sequences (vLLM semantics): generation stops once the output text contains one; the returned text is
    # cut before it. Prompt logprobs: top-k per prompt position (-1: the whole row). skip_reading_prefix_cache: admit
    # this request with no reuse (it still populates the cache), so every prompt position is computed.
    stop: str | list[str] | None = None
    prompt_logprobs: int | None = None
    skip_reading_prefix_cache: bool = False

    def __post_init__(self):
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.stop_token_ids is not None:
            self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be None or in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        self._check_stop_and_prompt_logprobs()

    def _check_stop_and_prompt_logprobs(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
                raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
            self.stop = list(self.stop)
        if self.prompt_logprobs is not None and (isinstance(self.prompt_logprobs, bool) or not isinstance(
                self.prompt_logprobs, int) or not -1 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be None, -1 (whole row) or in [0, {MAX_LOGPROBS}], "
                             f"got {self.prompt_logprobs!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
