"""Per-request sampling settings with vLLM's names and conventions, range-checked at construction.

Every field is checked here, where the check needs nothing but the value; the checks that need the model's vocabulary
(`stop_token_ids`) run in `LLMEngine.validate_request`. A bad value raises ValueError naming the field, before the
request reaches the scheduler, so it can never fail later inside a step.
"""
import math
import numbers
from dataclasses import dataclass

MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 32     # the device bans them during `min_tokens` through a fixed-width list (plus EOS)
MAX_N = 256                 # sequences one request may create
INT32_MAX = (1 << 31) - 1
MAX_TOKENS = INT32_MAX      # generation also ends at the engine's max_model_len
SEED_BOUND = 1 << 32        # seeds are uint32 on the device
# the device holds the penalty in float32: outside its normal range it would round to 0 or overflow to inf
REPETITION_PENALTY_RANGE = (1.1754944e-38, 3.4028235e38)
GREEDY_BELOW = 1e-5         # temperatures below this are greedy (vLLM's epsilon): logits / 1e-30 overflows
# Above this the tempered distribution is flat to within 1e-4 over any logit range a model produces (60 apart:
# exp(60 / 1e6) - 1 < 1e-4); far above it float32 flushes the tempered logits to zero (top-k, top-p and min-p lose
# the tokens' order) and past 3.4e38 the temperature itself overflows.
MAX_TEMPERATURE = 1e6
MAX_STOP_STRINGS = 64       # each is looked for in every sample's new text after every step, on the engine's thread


def _integer(name: str, value, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r}")
    value = int(value)
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
    return value


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass
class SamplingParams:
    """Per-request sampling settings (vLLM conventions).

    The order on the device: penalties on the raw logits (`repetition_penalty` divides positive and multiplies
    non-positive logits of every token seen in the prompt or the output; `frequency_penalty` subtracts per output
    occurrence; `presence_penalty` once per token present in the output), then the `min_tokens` ban (`stop_token_ids`
    and the model's end-of-sequence ids, also under `ignore_eos` as in vLLM, get -inf while fewer than `min_tokens`
    tokens were generated), then greedy (argmax) or: temperature, `min_p` (keep p >= min_p * p_max of the tempered
    distribution), `top_k` (keep every token at least as likely as the k-th: ties at the k-th value are all kept; a k
    above the vocabulary is clamped to it, i.e. off), `top_p` (keep the smallest set of most likely tokens whose renormalised mass reaches top_p,
    plus every token tied with the least likely kept one; a boundary that falls exactly on a cumulative sum closes
    the set there), then one categorical draw. Reported logprobs are those of the raw model distribution.

    Randomness: the key of output token i is `fold_in(PRNGKey(seed), i)`, so a request with a `seed` produces the
    same output whatever the batch it shares, the shape bucket, a preemption or a prefix-cache hit. Without a seed
    the key comes from the engine seed and the request's sequence id. With `n > 1` the prompt is prefilled once and
    forked; child i samples with seed `(seed + i) mod 2**32` (vLLM's derivation), so child 0 equals the same request
    with n=1 and child i equals a separate request with that seed.
    """

    temperature: float = 1.0  # < GREEDY_BELOW: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    max_tokens: int | None = 16  # None: until the context is full (max_model_len), as in vLLM
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token
    n: int = 1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    # Text stop sequences (vLLM semantics): generation stops once the output text contains one; the returned text is
    # cut before it. Prompt logprobs: top-k per prompt position (-1: the whole row). skip_reading_prefix_cache: admit
    # this request with no reuse (it still populates the cache), so every prompt position is computed; by default (None)
    # True when prompt_logprobs is asked for, as in vLLM (False: reuse, and the positions reused have no logprobs).
    stop: str | list[str] | None = None
    prompt_logprobs: int | None = None
    skip_reading_prefix_cache: bool | None = None
    # vLLM's: keep the stop string that ended the text (the text is cut after it) and a stop token's text
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        self.temperature = _real("temperature", self.temperature)
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        self.top_p = _real("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or an int >= 1, got {self.top_k!r}")
        self.top_k = int(self.top_k)
        self.min_p = _real("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _real(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _real("repetition_penalty", self.repetition_penalty)
        if not REPETITION_PENALTY_RANGE[0] <= self.repetition_penalty <= REPETITION_PENALTY_RANGE[1]:
            raise ValueError(f"repetition_penalty must be > 0 and a normal float32 number, in "
                             f"[{REPETITION_PENALTY_RANGE[0]:.4g}, {REPETITION_PENALTY_RANGE[1]:.4g}], got "
                             f"{self.repetition_penalty}")
        if self.max_tokens is not None:
            self.max_tokens = _integer("max_tokens", self.max_tokens, 1, MAX_TOKENS)
        self.min_tokens = _integer("min_tokens", self.min_tokens, 0,
                                   MAX_TOKENS if self.max_tokens is None else self.max_tokens)
        self.n = _integer("n", self.n, 1, MAX_N)
        if self.seed is not None:
            self.seed = _integer("seed", self.seed, 0, SEED_BOUND - 1)
        if self.stop_token_ids is not None:
            if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
                raise ValueError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
            ids = [_integer("stop_token_ids", t, 0, INT32_MAX) for t in self.stop_token_ids]
            if len(ids) > MAX_STOP_TOKEN_IDS:
                raise ValueError(f"stop_token_ids holds {len(ids)} ids; at most {MAX_STOP_TOKEN_IDS} are supported")
            self.stop_token_ids = ids
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.logprobs is not None:
            self.logprobs = _integer("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        self._check_stop_and_prompt_logprobs()

    def _check_stop_and_prompt_logprobs(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
                raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
            self.stop = list(self.stop)
            if len(self.stop) > MAX_STOP_STRINGS:
                raise ValueError(f"stop holds {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are supported")
        if self.prompt_logprobs is not None and (isinstance(self.prompt_logprobs, bool) or not isinstance(
                self.prompt_logprobs, numbers.Integral) or not -1 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be None, -1 (whole row) or in [0, {MAX_LOGPROBS}], "
                             f"got {self.prompt_logprobs!r}")
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = int(self.prompt_logprobs)
        if self.skip_reading_prefix_cache is None:  # vLLM's default: prompt logprobs at every position
            self.skip_reading_prefix_cache = self.prompt_logprobs is not None
        if not isinstance(self.skip_reading_prefix_cache, bool):
            raise ValueError(f"skip_reading_prefix_cache must be a bool, got {self.skip_reading_prefix_cache!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
