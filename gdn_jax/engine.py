"""The engine and its public API (vLLM conventions): `LLMEngine` (step level) and `LLM` (batch `generate`)."""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Iterable

import jax.numpy as jnp
import numpy as np

from gdn_jax.config import ModelConfig
from gdn_jax.weights import load_model, model_folder
from gdn_jax.tokenizer import get_tokenizer
from gdn_jax.worker import Worker, plan_memory
from scheduler import SamplingParams, Scheduler, SchedulerConfig, Sequence

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int                       # 1 = most likely
    decoded_token: str | None = None


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

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics


@dataclasses.dataclass
class _Request:
    request_id: str
    prompt: str | None
    seq: Sequence
    metrics: RequestMetrics
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float = 0.0


def _token_list(ids) -> list:
    """Token ids as Python ints (numpy integers included); anything else is kept as is for the error message."""
    out = []
    for t in np.asarray(ids).tolist() if isinstance(ids, np.ndarray) else ids:
        is_int = isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_))
        out.append(int(t) if is_int else t)
    return out


class LLMEngine:
    """Step-level engine: `add_request`, `step`, `abort_request`, `has_unfinished_requests`."""

    def __init__(self, model: str | ModelConfig = "tiny", dtype: str = "float32", seed: int = 0, enable_prefix_caching: bool = True,
                 block_size: int = 16, chunk_stride: int = 64, max_num_seqs: int = 16, max_model_len: int = 4096,
                 num_kv_blocks: int | None = None, num_linear_slots: int | None = None,
                 max_num_batched_tokens: int | None = None, memory_budget_bytes: int = 1 << 30, verbose: bool = True):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if block_size < 1 or chunk_stride < 1 or chunk_stride % block_size:
            raise ValueError(f"chunk_stride ({chunk_stride}) must be a positive multiple of block_size ({block_size})")
        self.cfg, graphdef, params = load_model(model, dtype=DTYPES[dtype], seed=seed)
        if max_model_len > self.cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                             f"{self.cfg.max_position_embeddings}")
        folder = model_folder(model)
        self.tokenizer = get_tokenizer(folder, self.cfg.vocab_size, self.cfg.eos_token_id)
        has_linear = bool(self.cfg.linear_layer_ids)
        self.memory = plan_memory(self.cfg, DTYPES[dtype], block_size, max_num_seqs, max_model_len, num_kv_blocks,
                                  num_linear_slots, memory_budget_bytes)
        self.scheduler_config = SchedulerConfig(
            num_kv_blocks=self.memory.num_kv_blocks, num_linear_slots=self.memory.num_linear_slots,
            block_size=block_size, chunk_stride=chunk_stride, max_num_seqs=max_num_seqs,
            max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching, has_linear_attention_layers=has_linear,
            state_fingerprint=f"{self.cfg.fingerprint()}:{dtype}", eos_token_id=self.cfg.eos_token_id)
        self.scheduler = Scheduler(self.scheduler_config)
        self.worker = Worker(self.cfg, graphdef, params, self.memory, block_size, max_num_seqs, max_model_len,
                             chunk_stride, DTYPES[dtype], seed=seed)
        if verbose:
            print(f"[gdn_jax] {self.cfg.name}: {self.memory.describe()}")
        self._requests: dict[str, _Request] = {}
        self._by_seq: dict[int, _Request] = {}
        self._seq_ids = itertools.count(1)
        self.max_model_len = max_model_len
        self.last_step_info: dict = {}

    # ---- requests -------------------------------------------------------------------------------------------
    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _token_list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise ValueError("a dict prompt needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, (list, tuple, np.ndarray)):
            return None, _token_list(prompt)
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}: use str, list[int] or a dict")

    def validate_request(self, prompt, sampling_params: SamplingParams | None = None):
        """Checks a request without touching the engine; returns (text, token ids, params) or raises ValueError."""
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.__post_init__()  # re-validate: the object may have been mutated after construction
        text, ids = self._tokenize(prompt)
        if not ids:
            raise ValueError("empty prompt: at least one token is needed")
        bad = [t for t in ids if type(t) is not int or not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]!r} outside the vocabulary [0, {self.cfg.vocab_size})")
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens is longer than max_model_len {self.max_model_len}")
        return text, ids, params

    def add_request(self, request_id: str, prompt, sampling_params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Validates everything before anything runs: a bad request raises ValueError and changes nothing."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        text, ids, params = self.validate_request(prompt, sampling_params)
        seq = Sequence(next(self._seq_ids), ids, params)
        self.scheduler.add(seq)
        req = _Request(request_id, text, seq, RequestMetrics(arrival_time or time.perf_counter()),
                       [] if params.logprobs is not None else None)
        self._requests[request_id] = req
        self._by_seq[seq.seq_id] = req

    def abort_request(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None:
            self._by_seq.pop(req.seq.seq_id, None)
            self.scheduler.abort(req.seq.seq_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- stepping -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules and runs one step; returns an output for every request that got a token or finished."""
        plan = self.scheduler.schedule()
        if plan is None:
            return []
        now = time.perf_counter()
        for s in plan.seqs:
            m = self._by_seq[s.seq_id].metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
        result = self.worker.execute(plan)
        self.last_step_info = {
            "is_prefill": plan.is_prefill, "rows": len(plan.seqs), "tokens": sum(len(s.token_ids) for s in plan.seqs),
            "warm_restores": sum(1 for s in plan.seqs if s.linear_op is not None and s.linear_op.is_warm_restore)}
        sampled = [int(result.tokens[i]) if s.sample else None for i, s in enumerate(plan.seqs)]
        self.scheduler.postprocess(plan, sampled)
        now = time.perf_counter()
        outputs = []
        for i, s in enumerate(plan.seqs):
            req = self._by_seq.get(s.seq_id)
            if req is None or not s.sample:
                continue
            self._record_token(req, sampled[i], result, i, now)
            outputs.append(self._output(req))
            if req.seq.is_finished:
                self._requests.pop(req.request_id, None)
                self._by_seq.pop(s.seq_id, None)
        return outputs

    def _record_token(self, req: _Request, token: int, result, row: int, now: float) -> None:
        m, seq = req.metrics, req.seq
        if m.first_token_time is None:
            m.first_token_time = now
            m.kv_match, m.linear_reach = seq.kv_match, seq.linear_reach
            m.num_cached_tokens, m.reuse_lost, m.restored = seq.num_cached_tokens, seq.reuse_lost, seq.restored
        m.num_preemptions = seq.num_preemptions
        if seq.is_finished:
            m.finished_time = now
        req.cumulative_logprob += float(result.logprobs[row])
        k = seq.sampling_params.logprobs
        if k is not None:
            entry = {token: Logprob(float(result.logprobs[row]), 1 + int((result.top_logprobs[row] >
                                                                        result.logprobs[row]).sum()))}
            for rank, (tid, lp) in enumerate(zip(result.top_ids[row][:k], result.top_logprobs[row][:k]), start=1):
                entry.setdefault(int(tid), Logprob(float(lp), rank))
            for tid, lp in entry.items():
                lp.decoded_token = self.tokenizer.decode([tid])
            req.logprobs.append(entry)

    def _output(self, req: _Request) -> RequestOutput:
        seq = req.seq
        ids = list(seq.output_token_ids)
        completion = CompletionOutput(0, self.tokenizer.decode(ids), ids, req.cumulative_logprob,
                                      list(req.logprobs) if req.logprobs is not None else None, seq.finish_reason)
        return RequestOutput(req.request_id, req.prompt, seq.token_ids[:seq.num_prompt_tokens], [completion],
                             seq.is_finished, req.metrics.num_cached_tokens, req.metrics)

    def warm_up(self) -> int:
        """Compiles every step shape now, so that no request pays a compilation later."""
        return self.worker.warm_up()

    # ---- statistics -----------------------------------------------------------------------------------------
    def cache_stats(self) -> dict:
        stats = dict(self.scheduler.stats())
        stats["compilations"] = self.worker.num_compilations
        q = stats.get("queries", 0)
        stats["hit_rate"] = stats.get("hits", 0) / q if q else 0.0
        return stats


class LLM:
    """Batch API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str | ModelConfig = "tiny", **kwargs):
        self.engine = LLMEngine(model, **kwargs)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict, np.ndarray)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        ids = []
        for prompt, sp in zip(prompts, params):  # validate all first: nothing is added if one is bad
            self.engine.validate_request(prompt, sp)
        for prompt, sp in zip(prompts, params):
            rid = str(next(self._ids))
            self.engine.add_request(rid, prompt, sp)
            ids.append(rid)
        return self._run(ids, use_tqdm)

    def _run(self, ids: Iterable[str], use_tqdm: bool) -> list[RequestOutput]:
        ids = list(ids)
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(ids), desc="generate", unit="req")
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids if i in done]

    def cache_stats(self) -> dict:
        return self.engine.cache_stats()
