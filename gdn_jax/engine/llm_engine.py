"""The engine and its public API (vLLM conventions): `LLMEngine` (step level) and `LLM` (batch `generate`)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import numbers
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from gdn_jax import envs
from gdn_jax.diagnostics import user_stacklevel
from gdn_jax.chat import ChatTemplate
from gdn_jax.config import ModelConfig, folder_json
from gdn_jax.worker.executable_store import StaleExecutable, jax_cache_folder, tag_jax_cache_keys
from gdn_jax.model.weights import load_model, model_folder
from gdn_jax.tokenizer import get_tokenizer, text_stream
from gdn_jax.worker.memory import GPU_MEMORY_UTILIZATION, default_memory_budget, plan_memory
from gdn_jax.worker.step import PromptLogprobs
from gdn_jax.worker.worker import Worker
from scheduler import SamplingParams, Scheduler, SchedulerConfig, Sequence
from scheduler.sampling_params import MAX_STOP_TOKEN_IDS, SEED_BOUND

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
GDN_SCHEDULES = ("auto", "fused", "parallel")  # the prefill GDN rule's forms (model.GatedDeltaNet)
MAX_FULL_ROW_VOCAB = 65_536  # prompt_logprobs=-1 returns whole rows only for vocabularies up to this size


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


@dataclasses.dataclass
class _Request:
    request_id: str
    prompt: str | None
    seqs: list[Sequence]                               # one per sample; seqs[0] prefills, the others fork
    metrics: RequestMetrics
    logprobs: list[list[dict[int, Logprob]] | None]    # per sample
    cumulative_logprob: list[float]                    # per sample
    error: str | None = None                           # what the failed step raised, if one did
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_scored: int = 0                             # prompt positions up to here have their values (None: cached)
    texts: list[str] = dataclasses.field(default_factory=list)                # per sample, cut before a stop string
    stop_reasons: list[str | int | None] = dataclasses.field(default_factory=list)  # per sample
    # per sample: a stop string counts only if it ends past here (the end of the first min_tokens text, then of the
    # text already searched)
    stop_from: list[int] = dataclasses.field(default_factory=list)
    streams: list = dataclasses.field(default_factory=list)  # per sample: the tokenizer's incremental text decoder
    prompt_token_ids: list[int] = dataclasses.field(default_factory=list)  # shared by every output of the request
    final_only: bool = False  # an output only when it finishes (`LLM.generate` reads no other)

    @property
    def seq(self) -> Sequence:
        return self.seqs[0]

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def __post_init__(self):
        self._indices = {s.seq_id: i for i, s in enumerate(self.seqs)}

    def index(self, seq_id: int) -> int:
        return self._indices[seq_id]


# Default bound of the persistent compilation cache folder: a step shape's entry is 70-250 KB, Qwen3.5-9B's whole
# warm-up grid ~10 MB, so this holds about two hundred such grids before the least recently used entries go. The
# executable store beside JAX's entries (gdn_jax/executables.py; ~56 MB per 9B grid) is held to the same bound on
# its own, so the folder takes at most twice this.
CACHE_MAX_MB = 2048


def compilation_cache_max_bytes() -> int:
    """The persistent compilation cache's bound in bytes: `$GDN_JAX_CACHE_MAX_MB` MiB (default CACHE_MAX_MB; -1: no
    bound, the folder only grows)."""
    text = envs.get("GDN_JAX_CACHE_MAX_MB")
    if not text:
        return CACHE_MAX_MB << 20
    try:
        mb = int(text)
    except ValueError:
        mb = 0
    if mb < 1 and mb != -1:
        raise ValueError(f"GDN_JAX_CACHE_MAX_MB must be a positive whole number of MiB, or -1 for no bound; "
                         f"got {text!r}")
    return -1 if mb == -1 else mb << 20


def _stamp_entries(folder: str) -> None:
    """Gives every entry of JAX's cache folder (`<key>-cache`) the access stamp its eviction reads (`<key>-atime`,
    nanoseconds, little-endian) where it has none: entries written while eviction was off (by an older version, or
    with the bound off) carry none, and JAX's eviction fails on them. The stamp is the entry's modification time, so
    such entries go first."""
    try:
        for entry in Path(folder).glob("*-cache"):
            stamp = entry.with_name(entry.name.removesuffix("-cache") + "-atime")
            if not stamp.exists():
                stamp.write_bytes(entry.stat().st_mtime_ns.to_bytes(8, "little"))
    except OSError:  # a read-only or vanishing folder: JAX's own reads and writes will say so, or miss
        pass


def enable_compilation_cache() -> str | None:
    """Turns on JAX's persistent compilation cache, so a second process start reuses compiled steps. The folder is
    `$GDN_JAX_CACHE_DIR`, else `$XDG_CACHE_HOME/gdn_jax/jax`, else `~/.cache/gdn_jax/jax`; `GDN_JAX_CACHE_DIR=off`
    disables it; a folder already configured (jax_compilation_cache_dir) is kept. The folder is bounded
    (`compilation_cache_max_bytes`): past the bound JAX deletes the least recently used entries (a folder this
    process cannot write is read as it is, unbounded). On the CPU its entries are keyed by the host's CPU too
    (`executables.tag_jax_cache_keys`; where JAX cannot, they go to a subfolder per CPU kind:
    `executables.jax_cache_folder`), so that machines of two kinds can share the folder. Returns the folder in use."""
    tag_jax_cache_keys()
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    folder = envs.get("GDN_JAX_CACHE_DIR")
    if folder == "off":
        return None
    max_bytes = compilation_cache_max_bytes()
    if not folder:
        base = envs.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        folder = os.path.join(base, "gdn_jax", "jax")
    if os.path.exists(folder) and not os.path.isdir(folder):  # JAX would warn and compile everything every start
        raise ValueError(f"the compilation cache folder {folder} (GDN_JAX_CACHE_DIR, gdn-jax --compilation-cache) "
                         f"is a file, not a folder")
    folder = jax_cache_folder(folder)
    if max_bytes != -1 and os.path.isdir(folder) and not os.access(folder, os.W_OK):
        max_bytes = -1  # a read-only (shared, prefilled) folder: eviction's lock file could not be written, every
        # read would fail, and nothing is written there anyway
    if max_bytes != -1:
        _stamp_entries(folder)
    jax.config.update("jax_compilation_cache_max_size", max_bytes)
    jax.config.update("jax_compilation_cache_dir", folder)
    # every executable is kept, the quick ones too: a second start then compiles nothing
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return folder


def _token_list(ids, what: str = "a token-id prompt") -> list:
    """Token ids as Python ints (numpy integers included); anything else is kept as is for the error message. `ids`
    must be a list, a tuple or a 1-D array (`what` names it in the error)."""
    if not isinstance(ids, (list, tuple, np.ndarray)) or isinstance(ids, np.ndarray) and ids.ndim != 1:
        shape = f"a {np.ndim(ids)}-D array" if isinstance(ids, np.ndarray) else type(ids).__name__
        raise ValueError(f"{what} must be a list of token ids, got {shape}")
    out = []
    for t in np.asarray(ids).tolist() if isinstance(ids, np.ndarray) else ids:
        is_int = isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_))
        out.append(int(t) if is_int else t)
    return out


def model_eos_ids(folder: Path | None, vocab_size: int | None = None) -> list[int]:
    """The end-of-sequence ids a model folder lists: config.json's `eos_token_id` (an id or a list) and
    generation_config.json's (the same; [] without the files or the fields). A chat model's config.json may name one
    EOS while generation_config.json lists the end-of-turn token too (Qwen3.5: <|endoftext|> there, <|im_end|> and
    <|endoftext|> here); some models list several in config.json itself (the model's `eos_token_id` is the first).
    With `vocab_size`, an id outside the vocabulary is a ValueError naming its file (nothing could end on it)."""
    ids = []
    for name in ("config.json", "generation_config.json"):
        data = folder_json(folder, name)
        text = data.get("text_config")  # a multimodal config.json (qwen3_5) holds the text model's in text_config
        for eos in ((text.get("eos_token_id"),) if isinstance(text, dict) else ()) + (data.get("eos_token_id"),):
            listed = [] if eos is None else eos if isinstance(eos, list) else [eos]
            if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in listed):
                raise ValueError(f"{Path(folder) / name}: eos_token_id must be a token id or a list of them, "
                                 f"got {eos!r}")
            if vocab_size is not None and any(t >= vocab_size for t in listed):
                raise ValueError(f"{Path(folder) / name}: eos_token_id {eos!r} is outside the vocabulary "
                                 f"[0, {vocab_size})")
            ids += listed
    return list(dict.fromkeys(ids))


# generation_config.json's sampling fields a model's defaults take (vLLM's list; max_new_tokens is max_tokens), each
# with transformers' GenerationConfig default: a field set to that default is no default of the model's (vLLM reads
# the file's difference from GenerationConfig(), so top_k 50 there leaves top-k off)
GENERATION_CONFIG_SAMPLING = {"repetition_penalty": 1.0, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None,
                              "max_new_tokens": None}
GENERATION_CONFIGS = ("auto", "vllm")


def model_sampling_defaults(folder: Path | None) -> dict:
    """The sampling defaults a model folder's generation_config.json recommends, as SamplingParams keywords
    ({"temperature": 0.6, "top_k": 20, "top_p": 0.95} for Qwen3.5; {} without the file): the fields vLLM takes
    (`GENERATION_CONFIG_SAMPLING`) where they differ from transformers' defaults. A bad value names the file."""
    data = folder_json(folder, "generation_config.json")
    out = {}
    for field, hf_default in GENERATION_CONFIG_SAMPLING.items():
        value = data.get(field)
        if value is None or value == hf_default:
            continue
        name = "max_tokens" if field == "max_new_tokens" else field
        try:
            SamplingParams(**{name: value})
        except ValueError as e:
            raise ValueError(f"{Path(folder) / 'generation_config.json'}: {e}") from None
        out[name] = value
    return out


@contextlib.contextmanager
def _interrupts_held():
    """Holds back a Ctrl-C (SIGINT) that arrives inside the block, and hands it to its handler when the block ends
    (a KeyboardInterrupt raised there): for the engine's host work that must run to its end or leave its state half
    changed. Only the main thread receives signals, and only a Python handler can be held: elsewhere the block runs
    as it is."""
    if threading.current_thread() is not threading.main_thread() or not callable(handler := signal.getsignal(
            signal.SIGINT)):
        yield
        return
    held = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
        if held:
            handler(*held[0])


class LLMEngine:
    """Step-level engine: `add_request`, `step`, `abort_request`, `has_unfinished_requests`."""

    def __init__(self, model: str | ModelConfig = "tiny", dtype: str = "float32", seed: int = 0, enable_prefix_caching: bool = True,
                 block_size: int = 16, chunk_stride: int = 64, max_num_seqs: int = 16, max_model_len: int = 4096,
                 num_kv_blocks: int | None = None, num_linear_slots: int | None = None,
                 max_num_batched_tokens: int | None = None, memory_budget_bytes: int | None = None,
                 gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION, unsafe_reuse: str | None = None,
                 checkpoint_mode: str = "scan", checkpoint_policy: str = "all", mixed_steps: bool = True,
                 gdn_schedule: str = "auto", generation_config: str = "auto",
                 verbose: bool = True):
        """`memory_budget_bytes` bounds the KV and linear-state pools; None sizes it from the device: on a GPU
        `gpu_memory_utilization` of the memory XLA may allocate there (by default 75% of the GPU's,
        XLA_PYTHON_CLIENT_MEM_FRACTION) minus the weights, a share per engine (`worker.default_memory_budget`), on the
        CPU `CPU_MEMORY_BUDGET_BYTES` (2 GiB).
        Explicit `num_kv_blocks` / `num_linear_slots` win over the budget.

        `unsafe_reuse` ("cold" or "stale") is an ablation for accuracy studies, never for serving: it reuses the whole
        KV match with a zero ("cold") or an earlier ("stale") GDN state, the two errors the exact cache prevents.

        `checkpoint_mode`: "scan" (default) prefills as many chunk strides per step as `max_num_batched_tokens`
        allows and writes the checkpoints of the boundaries it crosses from the chunked scan, in the same step;
        "promote" is the original design: one stride per prefill step, the live slot promoted to the checkpoint.
        `checkpoint_policy` ("scan"): "all" boundaries crossed, or only the "last" one (see SchedulerConfig).
        `mixed_steps` ("scan"): a step decodes every running sequence and prefills within the rest of the token
        budget; False (and "promote"): a step is all-prefill or all-decode, prefill first.

        `gdn_schedule`: how a prefill step's GDN rule is computed: "auto" (on the CPU the compiled prefill kernel,
        token by token, `cpu_kernels.gdn_prefill`, where the kernels build, else "fused"; "parallel" on
        accelerators), or the chunked rule's "fused" or "parallel" schedule: the same maths, so outputs agree to
        float rounding.

        `generation_config` (vLLM's option): "auto" takes the sampling defaults of the model folder's
        generation_config.json (`model_sampling_defaults`: temperature, top_p, top_k, min_p, repetition_penalty,
        max_new_tokens as max_tokens) for a request given no SamplingParams, and the server for the fields a request
        leaves unset; "vllm": SamplingParams' own defaults."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        ints = dict(block_size=block_size, chunk_stride=chunk_stride, max_num_seqs=max_num_seqs,
                    max_model_len=max_model_len, num_kv_blocks=num_kv_blocks, num_linear_slots=num_linear_slots,
                    max_num_batched_tokens=max_num_batched_tokens, memory_budget_bytes=memory_budget_bytes, seed=seed)
        if seed is None:  # vLLM's LLM takes seed=None; here it failed deep in the weight initialisation
            raise ValueError("seed must be an int (it gives random presets their weights and requests without a "
                             "seed of their own their draws), got None")
        for name, value in ints.items():  # a float here failed later, in a shape or a slice, naming nothing
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
                raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
        if not 0 <= seed < SEED_BOUND:  # silently reduced modulo 2**32 before: seeds 0 and 2**32 gave the same model
            raise ValueError(f"seed must be in [0, 2**32), got {seed}")
        if not isinstance(model, (str, os.PathLike, ModelConfig)):  # LLM(3) failed inside pathlib, naming nothing
            raise ValueError(f"model must be a model name, a folder or a ModelConfig, got {model!r} "
                             f"({type(model).__name__})")
        for name, value in dict(enable_prefix_caching=enable_prefix_caching, mixed_steps=mixed_steps).items():
            if not isinstance(value, (bool, np.bool_)):  # a string such as "false" read as true: the other mode
                raise ValueError(f"{name} must be a bool, got {value!r}")
        if isinstance(gpu_memory_utilization, bool) or not isinstance(gpu_memory_utilization, (int, float)):
            raise ValueError(f"gpu_memory_utilization must be a number, got {gpu_memory_utilization!r}")
        if not 0.0 < gpu_memory_utilization <= 1.0:  # also where no budget is asked for (both pool counts given)
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if gdn_schedule not in GDN_SCHEDULES:
            raise ValueError(f"gdn_schedule must be one of {GDN_SCHEDULES}, got {gdn_schedule!r}")
        if generation_config not in GENERATION_CONFIGS:
            raise ValueError(f"generation_config must be one of {GENERATION_CONFIGS}, got {generation_config!r}")
        if block_size < 1 or chunk_stride < 1 or chunk_stride % block_size:
            raise ValueError(f"chunk_stride ({chunk_stride}) must be a positive multiple of block_size ({block_size})")
        enable_compilation_cache()
        self.cfg, graphdef, params = load_model(model, dtype=DTYPES[dtype], seed=seed)
        if max_model_len > self.cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                             f"{self.cfg.max_position_embeddings}")
        folder = self.model_folder = model_folder(model)  # None for presets and configs
        self.tokenizer = get_tokenizer(folder, self.cfg.vocab_size, self.cfg.eos_token_id)
        # the folder's other end-of-sequence ids end a request as stop tokens unless ignore_eos (vLLM's way)
        self.extra_eos_ids = [t for t in model_eos_ids(folder, self.cfg.vocab_size) if t != self.cfg.eos_token_id]
        # SamplingParams keywords of the model's recommended sampling (generation_config="auto")
        self.default_sampling = model_sampling_defaults(folder) if generation_config == "auto" else {}
        has_linear = bool(self.cfg.linear_layer_ids)
        if memory_budget_bytes is None and (num_kv_blocks is None or num_linear_slots is None):  # else unused
            params_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
            memory_budget_bytes = default_memory_budget(params_bytes, gpu_memory_utilization)
        self.memory = plan_memory(self.cfg, DTYPES[dtype], block_size, max_num_seqs, max_model_len, num_kv_blocks,
                                  num_linear_slots, memory_budget_bytes, enable_prefix_caching)
        self.scheduler_config = SchedulerConfig(
            num_kv_blocks=self.memory.num_kv_blocks, num_linear_slots=self.memory.num_linear_slots,
            block_size=block_size, chunk_stride=chunk_stride, max_num_seqs=max_num_seqs,
            max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching, has_linear_attention_layers=has_linear,
            state_fingerprint=f"{self.cfg.fingerprint()}:{dtype}", eos_token_id=self.cfg.eos_token_id,
            unsafe_reuse=unsafe_reuse, checkpoint_mode=checkpoint_mode, checkpoint_policy=checkpoint_policy,
            mixed_steps=mixed_steps)
        if unsafe_reuse is not None:
            warnings.warn(f"unsafe_reuse={unsafe_reuse!r}: reusing KV matches with a {unsafe_reuse} GDN state; "
                          f"outputs drift from the model's (an ablation for accuracy studies only)",
                          stacklevel=user_stacklevel())
        self.scheduler = Scheduler(self.scheduler_config)
        sc = self.scheduler_config
        self.worker = Worker(self.cfg, graphdef, params, self.memory, block_size, max_num_seqs, max_model_len,
                             chunk_stride, DTYPES[dtype], seed=seed, max_num_batched_tokens=sc.max_num_batched_tokens,
                             checkpoint_mode=checkpoint_mode, checkpoint_policy=checkpoint_policy,
                             enable_prefix_caching=enable_prefix_caching, gdn_schedule=gdn_schedule,
                             eos_token_ids=tuple(([] if self.cfg.eos_token_id is None else [self.cfg.eos_token_id])
                                                 + self.extra_eos_ids))
        if verbose:
            print(f"[gdn_jax] {self.cfg.name}: {self.memory.describe()}", file=sys.stderr)
        if enable_prefix_caching and has_linear and chunk_stride > max_model_len:  # (a step profile needs no cache)
            warnings.warn(f"chunk_stride ({chunk_stride}) exceeds max_model_len ({max_model_len}): no sequence reaches "
                          f"a checkpoint boundary, so the prefix cache will never reuse a token",
                          stacklevel=user_stacklevel())
        if enable_prefix_caching and has_linear and self.memory.num_checkpoint_slots < max_num_seqs:
            warnings.warn(f"only {self.memory.num_checkpoint_slots} checkpoint slots for {max_num_seqs} sequences: "
                          f"under full concurrency most boundaries cannot be saved", stacklevel=user_stacklevel())
        self._requests: dict[str, _Request] = {}
        self._by_seq: dict[int, _Request] = {}
        self._undelivered: dict[str, RequestOutput] = {}  # outputs of a step an interrupt ended: the next step's
        self._seq_ids = itertools.count(1)
        self.max_model_len = max_model_len
        self.last_step_info: dict = {}

    # ---- requests -------------------------------------------------------------------------------------------
    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            other = [k for k in prompt if k not in ("prompt", "prompt_token_ids")]
            if other:  # e.g. vLLM's multi_modal_data, or a misspelt key: ignoring it would run another request
                raise ValueError(f"a dict prompt takes 'prompt' and 'prompt_token_ids' only, got {other[0]!r}")
            text = prompt.get("prompt")
            if ("prompt" in prompt or text is not None) and not isinstance(text, str) and not (
                    text is None and "prompt_token_ids" in prompt):  # with token ids the text is optional
                raise ValueError(f"a dict prompt's 'prompt' must be a str, got {type(text).__name__}")
            if "prompt_token_ids" in prompt:
                return text, _token_list(prompt["prompt_token_ids"], "'prompt_token_ids'")
            if "prompt" in prompt:
                return text, self.tokenizer.encode(text)
            raise ValueError("a dict prompt needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, (list, tuple, np.ndarray)):
            return None, _token_list(prompt)
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}: use str, list[int] or a dict")

    def validate_request(self, prompt, sampling_params: SamplingParams | None = None):
        """Checks a request without touching the engine; returns (text, token ids, params) or raises ValueError."""
        params = self.default_sampling_params() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.__post_init__()  # re-validate: the object may have been mutated after construction
        bad = [t for t in params.stop_token_ids or () if t >= self.cfg.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids: id {bad[0]} outside the vocabulary [0, {self.cfg.vocab_size})")
        extra = [t for t in self.extra_eos_ids if t not in (params.stop_token_ids or ())]
        if extra:  # they end the request unless ignore_eos; min_tokens bans them in any case, with the stop ids
            stops = [*(params.stop_token_ids or ()), *extra]
            if len(stops) > MAX_STOP_TOKEN_IDS:
                raise ValueError(f"stop_token_ids holds {len(stops) - len(extra)} ids; with the model's {len(extra)} "
                                 f"further end-of-sequence ids (config.json, generation_config.json) at most "
                                 f"{MAX_STOP_TOKEN_IDS - len(extra)} are supported")
            if not params.ignore_eos:
                params = dataclasses.replace(params, stop_token_ids=stops)
        text, ids = self._tokenize(prompt)
        if not ids:
            raise ValueError("empty prompt: at least one token is needed")
        bad = [t for t in ids if type(t) is not int or not 0 <= t < self.cfg.vocab_size]
        if bad and type(bad[0]) is not int:
            raise ValueError(f"token ids must be ints, got {bad[0]!r} ({type(bad[0]).__name__})")
        if bad:
            raise ValueError(f"token id {bad[0]!r} outside the vocabulary [0, {self.cfg.vocab_size})")
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens is longer than max_model_len {self.max_model_len}")
        if params.prompt_logprobs == -1 and self.cfg.vocab_size > MAX_FULL_ROW_VOCAB:
            raise ValueError(f"prompt_logprobs=-1 (whole rows) needs a vocabulary of at most {MAX_FULL_ROW_VOCAB} "
                             f"entries; this model has {self.cfg.vocab_size}")
        return text, ids, params

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, *, sampling_params: SamplingParams | None = None) -> None:
        """Validates everything before anything runs: a bad request raises ValueError and changes nothing.
        `params` is vLLM's name; `sampling_params=` is taken too. `arrival_time` is on `time.perf_counter()`'s clock
        (default: now), as every time in `RequestMetrics`."""
        if sampling_params is not None:
            if params is not None:
                raise ValueError("give the sampling parameters once: params or sampling_params, not both")
            params = sampling_params
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a str, got {request_id!r}")
        if arrival_time is not None and (isinstance(arrival_time, bool) or not isinstance(arrival_time, numbers.Real)
                                         or not math.isfinite(arrival_time)):
            raise ValueError(f"arrival_time must be a finite number on time.perf_counter()'s clock, got "
                             f"{arrival_time!r}")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        text, ids, params = self.validate_request(prompt, params)
        # sample i of n draws with seed (seed + i) mod 2**32 (vLLM's derivation): sample 0 is the request itself
        params_of = [dataclasses.replace(params, n=1,
                                         seed=None if params.seed is None else (params.seed + i) % SEED_BOUND)
                     for i in range(params.n)]
        seqs = [Sequence(next(self._seq_ids), ids, params_of[0])]
        seqs += [seqs[0].sample(next(self._seq_ids), p) for p in params_of[1:]]  # the prompt converted once
        arrival = time.perf_counter() if arrival_time is None else float(arrival_time)
        req = _Request(request_id, text, seqs, RequestMetrics(arrival),
                       [[] if params.logprobs is not None else None for _ in seqs], [0.0] * len(seqs),
                       prompt_logprobs=[None] * len(ids) if params.prompt_logprobs is not None else None,
                       texts=[""] * len(seqs), stop_reasons=[None] * len(seqs), stop_from=[0] * len(seqs),
                       streams=[text_stream(self.tokenizer) for _ in seqs], prompt_token_ids=list(ids))
        # the engine knows the request before the scheduler does: interrupted after the scheduler's `add` (Ctrl-C),
        # it is an ordinary request of the engine, which `abort_request` removes, not a sequence no step can look up
        self._requests[request_id] = req
        self._by_seq.update((seq.seq_id, req) for seq in seqs)
        try:
            with _interrupts_held():  # half-added, a sample would be in no queue the scheduler or an abort reads
                self.scheduler.add(seqs[0], forks=seqs[1:])
        except BaseException:
            if not any(seq.seq_id in self.scheduler.seqs for seq in seqs):  # refused, or interrupted before it began
                del self._requests[request_id]
                for seq in seqs:
                    self._by_seq.pop(seq.seq_id, None)
            raise

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Aborts one request or several (an id, or an iterable of ids, as vLLM's engines take them); an id not in
        the engine (unknown, or finished already) is ignored. An aborted request gives no further output."""
        if isinstance(request_id, str) or not isinstance(request_id, Iterable):
            request_id = [request_id]
        with _interrupts_held():  # half-aborted, a request would hold its slots with no one to free them
            for rid in list(request_id):
                self._abort(rid)

    def _abort(self, request_id: str) -> None:
        self._undelivered.pop(request_id, None)
        req = self._requests.pop(request_id, None)
        if req is not None:
            for seq in reversed(req.seqs):  # samples waiting for their fork first, then the one they fork from
                self._by_seq.pop(seq.seq_id, None)
                self.scheduler.abort(seq.seq_id)

    def default_sampling_params(self) -> SamplingParams:
        """The parameters of a request given none: the model's recommended sampling (`default_sampling`) over
        SamplingParams' defaults."""
        return SamplingParams(**self.default_sampling)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._undelivered)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def seq_id_of(self, request_id: str) -> int | None:
        """The scheduler's sequence id of an unfinished request (to match it against a step plan)."""
        req = self._requests.get(request_id)
        return None if req is None else req.seq.seq_id

    # ---- stepping -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules and runs one step; returns an output for every request that got a token or finished.

        An interrupt (Ctrl-C) may land anywhere. While the device step is prepared, runs or is read back it stops the
        step, which is then recomputed (`_abandon_step`); the host's work before and after it (planning; advancing
        the sequences and building the outputs) is held to its end and the interrupt raised after it, and the
        outputs of a step so interrupted come with the next step's (`has_unfinished_requests` stays true until
        they did)."""
        try:
            with _interrupts_held():  # planning takes a moment: half-planned, the scheduler would hold no queue
                plan = self.scheduler.schedule()
            ran = None if plan is None else self._execute(plan)
            if ran is not None:
                with _interrupts_held():  # half-postprocessed, some live slots would be a step ahead of their rows
                    outputs, broken = self._postprocess(plan, *ran)
                    for out in outputs:
                        self._undelivered.pop(out.request_id, None)  # this one holds everything the older one did
                        self._undelivered[out.request_id] = out
                    if broken:  # the others' outputs come with the next step (`has_unfinished_requests` stays true)
                        reqs, errors = zip(*broken.values())
                        self._end_with_error(list(reqs), errors[0], step_failed=False)
        except EngineStepError:  # the step raised, or the host's work for some of its requests: those ended
            raise
        except Exception as exc:
            if self.scheduler.inflight is None:  # planning (a request's postprocess raising is `_end_with_error`'s)
                raise
            # raised between the planning and the postprocess, outside the worker (recording prompt logprobs, say):
            # the step's requests fail as if the device step had, nothing of the step is indexed (the device may
            # not have run it), and the engine goes on; the plan left in flight made every later step fail
            self._fail_step(self.scheduler.inflight, exc)
        except BaseException:  # e.g. Ctrl-C while the device step ran
            self._abandon_step()
            raise
        outputs, self._undelivered = list(self._undelivered.values()), {}
        return outputs

    def _postprocess(self, plan, result, sampled: list[int | None]) -> tuple[list[RequestOutput], dict]:
        """The host's part of a step that ran: the scheduler advances its sequences, the requests record their
        tokens, logprobs and text; returns their outputs (finished requests leave the engine) and {request: what
        it raised} for the requests whose own part raised (a defect of the host's code, a tokenizer's error): the
        step went on for the others, and `step` ends those with "error" (`_end_with_error`)."""
        self.scheduler.postprocess(plan, sampled)
        now = time.perf_counter()
        touched: dict[str, _Request] = {}  # one output per request, however many of its samples stepped
        broken: dict[str, tuple[_Request, Exception]] = {}
        for i, s in enumerate(plan.seqs):
            req = self._by_seq.get(s.seq_id)
            if req is None or not s.sample or req.request_id in broken:
                continue
            try:
                index = req.index(s.seq_id)
                self._record_token(req, index, sampled[i], result, i, now)
                self._update_text(req, index, now)
            except Exception as exc:
                broken[req.request_id] = req, exc
                touched.pop(req.request_id, None)
                continue
            touched[req.request_id] = req
        outputs = []
        for req in touched.values():
            req.metrics.num_preemptions = sum(s.num_preemptions for s in req.seqs)  # once per request, not per row
            if req.is_finished:
                req.metrics.finished_time = now
            if req.final_only and not req.is_finished:
                continue  # an output copies everything so far: built per step, that grew with the output
            try:
                out = self._output(req)
            except Exception as exc:
                broken[req.request_id] = req, exc
                continue
            outputs.append(out)
            if req.is_finished:
                self._requests.pop(req.request_id, None)
                for seq in req.seqs:
                    self._by_seq.pop(seq.seq_id, None)
        return outputs, broken

    def _execute(self, plan) -> tuple | None:
        """Runs `plan` on the worker: (its result, the token sampled per row, None where a row samples none), or
        None when the step is to be recomputed (a stale executable). A step that raises is failed here
        (`_fail_step`)."""
        now = time.perf_counter()
        for s in plan.seqs:
            m = self._by_seq[s.seq_id].metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
        targets = [self._prompt_targets(s) for s in plan.seqs] if plan.is_prefill else None
        full = any(t is not None and self._by_seq[s.seq_id].seq.sampling_params.prompt_logprobs == -1
                   for s, t in zip(plan.seqs, targets or ()))
        try:
            result = (self.worker.execute(plan, targets, full) if targets and any(targets)
                      else self.worker.execute(plan))
        except StaleExecutable:  # (the worker warned) the step is recomputed with that shape compiled again
            self.scheduler.redo_step(plan)
            self.worker.reset_state()
            return None
        except Exception as exc:
            self._fail_step(plan, exc)  # raises EngineStepError
        if result.prompt is not None:
            for i, (s, t) in enumerate(zip(plan.seqs, targets)):
                if t is not None:
                    self._record_prompt_logprobs(self._by_seq[s.seq_id], s.start_pos, t, result.prompt, i)
        self.last_step_info = {
            "is_prefill": plan.is_prefill, "decode_rows": len(plan.decode_seqs), "rows": len(plan.seqs),
            "tokens": sum(len(s.token_ids) for s in plan.seqs),
            "warm_restores": sum(1 for s in plan.seqs if s.linear_op is not None and s.linear_op.restores_checkpoint),
            "forks": sum(1 for s in plan.seqs if s.linear_op is not None and s.linear_op.fork)}
        sampled = [int(result.tokens[i]) if s.sample else None for i, s in enumerate(plan.seqs)]
        return result, sampled

    def _abandon_step(self) -> None:
        """A step was interrupted between its planning and its postprocess (a KeyboardInterrupt, or any other
        BaseException, wherever it landed: the device may have advanced its rows' live slots and written its
        checkpoints, or consumed the donated pools, and no result was kept). Nothing of it is kept and no request
        fails: every running request is preempted and computed again, so that the next step computes from a state
        the scheduler describes. The prefix cache stays while the worker holds its pools (those before the step or
        after it: the step wrote nothing the cache indexes, `Scheduler.redo_step`), so the requests match it again;
        if the pools were consumed, they are rebuilt and the cache is emptied. With no step in flight (it was
        postprocessed, failed or redone, or never planned) only pools that a failed step consumed and the interrupt
        kept from being rebuilt are replaced."""
        if self.scheduler.inflight is not None:
            self.scheduler.redo_step(self.scheduler.inflight, pools_kept=not self.worker.state_lost())
        elif self.worker.state_lost():  # interrupted in `_fail_step` or a redo, before the pools were rebuilt
            self.scheduler.drop_device_state()
        if self.worker.state_lost():
            self.worker.reset_state()

    def _fail_step(self, plan, exc: Exception) -> None:
        """Finish the step's requests with "error" (every sample of them), release what they held, and re-raise as an
        EngineStepError. If the failure consumed the donated device state, the pools are rebuilt and every other
        running request is recomputed from scratch (the prefix cache is emptied), so the engine keeps serving."""
        failed = self.scheduler.fail_step(plan)
        if self.worker.state_lost():
            self.scheduler.drop_device_state()
            self.worker.reset_state()
        reqs = {}
        for seq in failed:
            req = self._by_seq.get(seq.seq_id)
            if req is not None:
                reqs[req.request_id] = req
        self._end_with_error(list(reqs.values()), exc)

    def _end_with_error(self, reqs: list[_Request], exc: Exception, step_failed: bool = True) -> None:
        """Finish `reqs` with "error" (every sample; the unfinished ones leave the scheduler, which frees their slots
        and blocks as for any finish) and raise an EngineStepError with their final outputs."""
        if not step_failed:  # a failed step's samples are counted by `Scheduler.fail_step`
            self.scheduler.counters["failed_requests"] += sum(len(req.seqs) for req in reqs)
        now, text = time.perf_counter(), f"{type(exc).__name__}: {exc}"
        outputs = []
        for req in reqs:
            for seq in req.seqs:  # the request's other samples end with it
                if not seq.is_finished:
                    self.scheduler.abort(seq.seq_id)
                seq.finish_reason = "error"
                self._by_seq.pop(seq.seq_id, None)
            self._requests.pop(req.request_id, None)
            self._undelivered.pop(req.request_id, None)  # an interrupted step's output would come after the error
            req.error, req.metrics.finished_time = text, now
            outputs.append(self._output(req))
        raise EngineStepError([o.request_id for o in outputs], outputs, exc, step_failed) from exc

    def _record_token(self, req: _Request, index: int, token: int, result, row: int, now: float) -> None:
        m, first, seq = req.metrics, req.seq, req.seqs[index]
        if m.first_token_time is None:
            m.first_token_time = now
            m.kv_match, m.linear_reach = first.kv_match, first.linear_reach
            m.num_cached_tokens, m.reuse_lost, m.restored = first.num_cached_tokens, first.reuse_lost, first.restored
        req.cumulative_logprob[index] += float(result.logprobs[row])
        k = seq.sampling_params.logprobs
        if k is not None:
            req.logprobs[index].append(self._logprob_entry(token, result.logprobs[row], result.ranks[row],
                                                           result.top_ids[row][:k], result.top_logprobs[row][:k]))

    def _logprob_entry(self, token: int, logprob, rank: int, top_ids, top_logprobs) -> dict[int, Logprob]:
        """{token: its logprob and rank} plus the top entries (vLLM's convention: the actual token always)."""
        entry = {int(token): Logprob(float(logprob), int(rank))}
        for r, (tid, lp) in enumerate(zip(top_ids, top_logprobs), start=1):
            entry.setdefault(int(tid), Logprob(float(lp), r))
        for tid, lp in entry.items():
            lp.decoded_token = self.decode_token(tid)
        return entry

    def decode_token(self, token_id: int) -> str:
        """One id's text alone, as vLLM shows a logprob's token: a special token's text kept."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # ---- prompt logprobs and stop strings ------------------------------------------------------------------
    def _prompt_targets(self, row) -> list[int] | None:
        """The prompt tokens this prefill row's logits score: positions start+1 .. min(end, prompt_len - 1), or None
        when none of them is new. After a preemption the prompt is prefilled again: the positions scored before keep
        their values (`_record_prompt_logprobs`), the rest of the prompt is scored as it comes."""
        req = self._by_seq[row.seq_id]
        if req.prompt_logprobs is None or req.seq.seq_id != row.seq_id:
            return None  # samples forked from the prompt (n > 1) score nothing: the first one did
        lo, hi = row.start_pos + 1, min(row.start_pos + len(row.token_ids), req.seq.num_prompt_tokens - 1)
        return req.seq.token_ids[lo:hi + 1] if hi > req.prompt_scored and lo <= hi else None

    def _record_prompt_logprobs(self, req: _Request, start: int, targets: list[int], prompt: PromptLogprobs,
                                row: int) -> None:
        k = req.seq.sampling_params.prompt_logprobs
        for t, token in enumerate(targets):
            if start + 1 + t <= req.prompt_scored:
                continue  # scored before a preemption: that value stands
            if k == -1:
                entry = LogprobRow(prompt.rows[row, t], self.decode_token)
            else:
                entry = self._logprob_entry(token, prompt.logprobs[row, t], prompt.ranks[row, t],
                                            prompt.top_ids[row, t, :k], prompt.top_logprobs[row, t, :k])
            req.prompt_logprobs[start + 1 + t] = entry
        req.prompt_scored = max(req.prompt_scored, start + len(targets))

    def _update_text(self, req: _Request, index: int, now: float) -> None:
        """Decodes sample `index` (its new tokens only: the stream keeps the rest). A sample that a stop token ended
        (EOS, or one of `stop_token_ids`: its `stop_reason`) leaves that token's text out, as vLLM does; the first
        stop string found ends the sample, and its text is cut before it (with `include_stop_str_in_output`: the
        stop token's text stays, and the text is cut after the stop string). As in vLLM, stop strings are looked for
        once more than `min_tokens` tokens are out, and only one that ends after the text of the first `min_tokens`
        counts (it may begin inside that text)."""
        seq, stream = req.seqs[index], req.streams[index]
        new = seq.token_ids[seq.num_prompt_tokens + stream.num_ids:]
        include = seq.sampling_params.include_stop_str_in_output
        if new and seq.finish_reason == "stop" and not isinstance(req.stop_reasons[index], str):
            token = seq.token_ids[-1]  # the scheduler ends a sample on the token that stops it
            new = new if include else new[:-1]
            if seq.sampling_params.ignore_eos or token != self.cfg.eos_token_id:
                req.stop_reasons[index] = token
        req.texts[index] = stream.add(new)
        stops = seq.sampling_params.stop
        if not stops or seq.finish_reason == "abort":
            return
        if seq.num_generated <= seq.sampling_params.min_tokens:
            req.stop_from[index] = len(req.texts[index])  # where the text of the first min_tokens tokens ends
            return
        hits = [(i, s) for s in stops
                if (i := req.texts[index].find(s, max(0, req.stop_from[index] - len(s) + 1))) >= 0]
        if hits:
            i, req.stop_reasons[index] = min(hits)
            req.texts[index] = req.texts[index][:i + len(req.stop_reasons[index]) if include else i]
            if not seq.is_finished:
                self.scheduler.abort(seq.seq_id)  # frees its slots and blocks like any finish
                req.metrics.finished_time = now
            seq.finish_reason = "stop"
        elif getattr(stream, "appends_only", False):  # that text stays as it is: the next search starts past it
            req.stop_from[index] = max(req.stop_from[index], stream.num_chars)

    def _visible_text(self, req: _Request, index: int) -> str:
        """The text an unfinished sample can show without taking it back later: it holds back what later tokens may
        still change (the stream's `num_chars` end there: a trailing incomplete UTF-8 character, an open run of
        byte-fallback tokens) and the last (longest stop - 1) characters, which may begin a stop string."""
        seq = req.seqs[index]
        if seq.is_finished:
            return req.texts[index]
        text = req.texts[index][:req.streams[index].num_chars]
        stops = seq.sampling_params.stop
        return text[:max(0, len(text) - max(map(len, stops)) + 1)] if stops else text

    def _output(self, req: _Request) -> RequestOutput:
        completions = []
        for i, seq in enumerate(req.seqs):
            ids = seq.output_token_ids  # a fresh list (a slice)
            lps = req.logprobs[i]
            completions.append(CompletionOutput(i, self._visible_text(req, i), ids,
                                                req.cumulative_logprob[i] if lps is not None else None,
                                                list(lps) if lps is not None else None, seq.finish_reason,
                                                req.stop_reasons[i]))
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, completions,
                             req.is_finished, req.metrics.num_cached_tokens, req.metrics,
                             prompt_logprobs=req.prompt_logprobs, error=req.error)

    def warm_up(self, prompt_logprobs: bool = False) -> int:
        """Compiles every step shape now, so that no request pays a compilation later. The prompt-logprobs variant
        of the prefill shapes is compiled lazily (on the first step that has such a row) unless `prompt_logprobs`."""
        resets = self.worker.state_resets
        try:
            return self.worker.warm_up(prompt_logprobs)
        finally:
            if self.worker.state_lost():  # interrupted (Ctrl-C) after a step consumed the pools, before they were kept
                self.worker.reset_state()
            if self.worker.state_resets != resets:  # a stored executable failed on the pools (`Worker._drop_stale`)
                self.scheduler.drop_device_state()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached KV block and checkpoint no running request uses (e.g. between A/B rounds). Returns
        True when the prefix cache is then empty, False when running requests still hold part of it (as vLLM's)."""
        return self.scheduler.reset_prefix_cache()

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
        self._chat_templates: dict[str | None, ChatTemplate | None] = {}

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: what `generate` uses when given no SamplingParams (the model folder's generation_config.json
        sampling fields unless `generation_config="vllm"`)."""
        return self.engine.default_sampling_params()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """The outputs of `prompts` (a str, a list of token ids, a {"prompt_token_ids": ...} dict, or a list of
        these), in their order. If it is interrupted (KeyboardInterrupt, an error), the batch's unfinished requests
        are aborted, so that nothing of it runs on in a later call."""
        if prompts is None or isinstance(prompts, (bytes, int, float)):
            raise ValueError(f"prompts must be a str, a list of token ids, a dict, or a list of these; got "
                             f"{type(prompts).__name__}")
        if isinstance(prompts, (str, dict, np.ndarray)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        # validate all first: nothing is added if one is bad; each is then added as the token ids (and text) its
        # validation found, so that a text prompt is tokenized once
        checked = [self.engine.validate_request(prompt, sp)[:2] for prompt, sp in zip(prompts, params)]
        ids = []
        try:
            for (text, token_ids), sp in zip(checked, params):
                rid = str(next(self._ids))
                while rid in self.engine._requests:  # an id the caller gave a request of its own on this engine
                    rid = str(next(self._ids))
                ids.append(rid)  # before it is added: an interrupt right after the add still aborts it
                self.engine.add_request(rid, {"prompt": text, "prompt_token_ids": token_ids}, sp)
                self.engine._requests[rid].final_only = True
        except BaseException:  # interrupted while adding (a long batch): none of it stays to run in a later call
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """vLLM's: the replies to a conversation (a list of {"role", "content"} dicts) or to each of a list of
        conversations, in their order. Each is rendered with the model folder's chat template, as transformers'
        `apply_chat_template` renders it (`gdn_jax.chat.ChatTemplate.render`: `add_generation_prompt`,
        `continue_final_message`, `chat_template_kwargs` such as Qwen3.5's {"enable_thinking": False}; as in vLLM an
        add_generation_prompt or continue_final_message there wins over the keyword), or with `chat_template` (a
        template's text) instead, then generated as `generate` generates a text prompt (the output's `prompt` is the
        rendered text). A model without a template, or a bad message, is a ValueError before anything runs."""
        if isinstance(messages, (list, tuple)) and messages and all(isinstance(m, (list, tuple)) for m in messages):
            conversations = list(messages)
        else:
            conversations = [messages]
        template = self._chat_template(chat_template)
        prompts = []
        for i, conversation in enumerate(conversations):
            try:
                prompts.append(template.render(conversation, add_generation_prompt, continue_final_message,
                                               chat_template_kwargs))
            except ValueError as e:
                raise ValueError(f"conversation {i}: {e}" if len(conversations) > 1 else str(e)) from None
        return self.generate(prompts, sampling_params, use_tqdm)

    def _chat_template(self, source: str | None) -> ChatTemplate:
        """The compiled template of `source`, else of the model folder (compiled once each)."""
        if source is not None and not isinstance(source, str):
            raise ValueError(f"chat_template must be the template's text (a str) or None, got {source!r}")
        if source not in self._chat_templates:
            self._chat_templates[source] = ChatTemplate.from_folder(self.engine.model_folder, source)
        template = self._chat_templates[source]
        if template is None:
            raise ValueError("this model has no chat template (no chat_template.jinja or tokenizer_config.json "
                             "chat_template in its folder): pass chat_template=, or call generate with the prompt")
        return template

    def _run(self, ids: Iterable[str], use_tqdm: bool) -> list[RequestOutput]:
        ids = list(ids)
        batch = set(ids)
        done: dict[str, RequestOutput] = {}
        bar, complete = None, False
        try:
            if use_tqdm:
                from tqdm.auto import tqdm
                bar = tqdm(total=len(ids), desc="generate", unit="req")
            while self.engine.has_unfinished_requests():
                try:
                    outs = self.engine.step()
                except EngineStepError as err:  # those requests end with finish_reason "error"; the rest go on
                    warnings.warn(str(err), RuntimeWarning, stacklevel=user_stacklevel())
                    outs = err.outputs
                for out in outs:  # requests the caller added to the engine itself run too, uncounted
                    if out.finished and out.request_id in batch:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
            complete = True
        finally:
            if not complete:  # interrupted: the batch's requests leave the engine, their slots and blocks freed
                self.engine.abort_request([i for i in ids if i not in done])  # (first: a second Ctrl-C may come)
            if bar is not None:
                bar.close()
        return [done[i] for i in ids if i in done]

    def cache_stats(self) -> dict:
        return self.engine.cache_stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()
