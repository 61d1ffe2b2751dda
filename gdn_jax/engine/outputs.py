"""What the engine returns: a request's outputs, their logprobs and metrics, and the error of a failed step."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int                       # 1 = most likely
    decoded_token: str | None = None


class LogprobRow(Mapping):
    """The whole log-distribution at one prompt position (`prompt_logprobs=-1`): a read-only {token_id: Logprob}
    mapping over every vocabulary id, backed by one float32 row (`.array`) instead of V Python objects; `decode(id)`
    gives an entry's decoded_token."""

    def __init__(self, row: np.ndarray, decode):
        self.array, self._decode, self._sorted = row, decode, None

    def __getitem__(self, token_id: int) -> Logprob:
        if not (isinstance(token_id, (int, np.integer)) and 0 <= token_id < len(self.array)):
            raise KeyError(token_id)
        if self._sorted is None:  # sorted once: a rank is then a binary search, and dict(row) takes O(V log V)
            self._sorted = np.sort(self.array)
        lp = self.array[token_id]
        greater = len(self._sorted) - int(np.searchsorted(self._sorted, lp, side="right"))
        return Logprob(float(lp), 1 + greater, self._decode(int(token_id)))

    def __iter__(self):
        return iter(range(len(self.array)))

    def __len__(self) -> int:
        return len(self.array)


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    kv_match: int = 0               # tokens the KV prefix cache matched
    linear_reach: int = 0           # deepest checkpoint boundary the linear index matched
    num_cached_tokens: int = 0      # reuse = deepest checkpoint <= min(kv_match, linear_reach)
    reuse_lost: int = 0             # kv_match - reuse: lost to alignment / clamp / missing checkpoints
    restored: bool = False          # a warm restore ran at admission
    num_preemptions: int = 0
    spec_draft_tokens: int = 0      # speculative decoding: drafts its decode steps verified (all its samples)
    spec_accepted_tokens: int = 0   # and those accepted

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted drafts per draft verified (None: none verified)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # None unless the request asked for logprobs (as vLLM)
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop_token_ids token that ended the text, if one did

    def finished(self) -> bool:
        """Whether this sample is done (vLLM's `CompletionOutput.finished()`)."""
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    # SamplingParams.prompt_logprobs: per prompt position a dict like `logprobs` (the prompt token and the top k), or
    # None where nothing was computed: position 0, and, if the request read the prefix cache
    # (`skip_reading_prefix_cache=False`; a request with prompt logprobs does not by default), positions
    # p <= num_cached_tokens (their logits came from the cache).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: str | None = None        # set when the request ended with finish_reason "error": what the step raised


class EngineStepError(RuntimeError):
    """A step raised: its device step, or the host's work between its planning and its postprocess (the requests of
    that step), or the host's work for some requests after the scheduler advanced the rows (those requests). They
    were finished with finish_reason "error" (their final outputs are in `outputs`) and everything they held was
    released; the engine goes on serving the others. `step_failed` is False in the last case: the step itself ran,
    and the others' outputs of it come with the next step."""

    def __init__(self, request_ids: list[str], outputs: list[RequestOutput], cause: BaseException,
                 step_failed: bool = True):
        self.request_ids, self.outputs, self.step_failed = request_ids, outputs, step_failed
        ids = ", ".join(map(repr, request_ids))
        where = f"step failed for request(s) {ids}" if step_failed else f"request(s) {ids} failed after their step"
        super().__init__(f"{where}: {type(cause).__name__}: {cause}")


class EngineFull(RuntimeError):
    """`add_request` refused a request because its sequences would take the waiting queue past
    `max_waiting_sequences`; nothing was added, and the same request may be retried once the queue has moved (a
    server answers 429 with Retry-After)."""

    def __init__(self, num_waiting: int, num_new: int, max_waiting_sequences: int):
        self.num_waiting, self.num_new, self.max_waiting_sequences = num_waiting, num_new, max_waiting_sequences
        super().__init__(f"the engine is full: {num_waiting} sequences wait to run and the request adds {num_new}, "
                         f"past max_waiting_sequences={max_waiting_sequences}; retry later")
