"""Every setting: the engine's (EngineConfig, each knob declared once) and, re-exported from `gdn_jax.model_config`,
the model's (ModelConfig, presets, HF config.json)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import types
import typing
from typing import Literal

import numpy as np

from gdn_jax.model_config import (  # noqa: F401  (re-exported: the model's settings)
    ARCHITECTURES, FULL, HF_DEFAULT_HEAD_DIM, LEGACY_LAYER_TYPES, LINEAR, MOE_MODEL_TYPES, PRESETS,
    SUPPORTED_MODEL_TYPES, ModelConfig, NotAModelFolder, folder_file, folder_json, get_preset, hybrid_layer_types)
from scheduler.sampling_params import MAX_N, SEED_BOUND


# ---- the engine's settings: every knob of LLMEngine, LLM and the command line, declared once ----------------------

GPU_MEMORY_UTILIZATION = 0.9  # default fraction of an accelerator's memory for weights + pools
MAX_NUM_BATCHED_TOKENS = 2048  # a step's default token budget, unless chunk_stride is larger


def _setting(default, doc: str, **metadata):
    """A setting's field: its default, its one-line doc (the CLI's help) and options of its CLI flag (`flag`: the
    flag's name, `aliases`: further names (a bool's "--no-..." alias turns it off), `cli`: False for none, `min`: an
    int's lower bound)."""
    return dataclasses.field(default=default, metadata={"help": doc, **metadata})


def setting_type(hint) -> tuple[type | None, bool, tuple | None]:
    """A setting's type annotation as (its type: int, float, bool or str, None for a union of several; whether None
    is allowed; a Literal's choices, else None)."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    kinds = [a for a in args if a is not type(None)]
    kind = kinds[0] if len(kinds) == 1 else None
    if typing.get_origin(kind) is typing.Literal:
        return type(typing.get_args(kind)[0]), type(None) in args, typing.get_args(kind)
    return kind, type(None) in args, None


def _check_fields(config) -> None:
    """Checks each field's value against its type (int, float, bool, str, a Literal's choices, None where the type
    allows it), numpy scalars made Python ones; a bad value is a ValueError naming the field and the value."""
    for f in dataclasses.fields(config):
        kind, optional, choices = setting_type(_hints(type(config))[f.name])
        value = getattr(config, f.name)
        if value is None and optional:
            continue
        if choices is not None:
            if value not in choices:
                raise ValueError(f"{f.name} must be one of {((None,) if optional else ()) + choices}, got {value!r}")
        elif kind is bool:
            if not isinstance(value, (bool, np.bool_)):  # a string such as "false" read as true: the other mode
                raise ValueError(f"{f.name} must be a bool, got {value!r}")
            object.__setattr__(config, f.name, bool(value))
        elif kind is int:  # a float here failed later, in a shape or a slice, naming nothing
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"{f.name} must be an int, got {value!r} ({type(value).__name__})")
            object.__setattr__(config, f.name, int(value))
            low = f.metadata.get("min")
            if low is not None and value < low:
                raise ValueError(f"{f.name} must be >= {low}, got {value}")
        elif kind is float:
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.floating, np.integer)):
                raise ValueError(f"{f.name} must be a number, got {value!r}")
            object.__setattr__(config, f.name, float(value))
            low = f.metadata.get("min")
            if low is not None and not value >= low:  # NaN too
                raise ValueError(f"{f.name} must be >= {low}, got {value}")
        elif kind is str and not isinstance(value, str):
            raise ValueError(f"{f.name} must be a str{' or None' if optional else ''}, got {value!r}")


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The KV-block and linear-state pools and the prefix cache over them."""

    enable_prefix_caching: bool = _setting(
        True, "reuse cached KV blocks and linear-state checkpoints across requests", aliases=("--no-prefix-caching",))
    block_size: int = _setting(16, "tokens per KV block", min=1)
    chunk_stride: int = _setting(64, "tokens between linear-state checkpoints (a multiple of block_size)", min=1)
    checkpoint_mode: Literal["scan", "promote"] = _setting(
        "scan", "checkpoints written from the prefill scan, or promoted one stride per step")
    checkpoint_policy: Literal["all", "last"] = _setting(
        "all", "the boundaries a prefill row saves (\"scan\" mode): all it crosses, or its deepest")
    checkpoint_eviction: Literal["lru", "flop_aware"] = _setting(
        "lru", "which unpinned checkpoint an eviction takes: the least recently used, or the least useful by "
               "Marconi's recency + alpha x prefill FLOPs saved (scheduler/eviction.py)")
    eviction_alpha: float = _setting(
        1.0, "flop_aware eviction: the weight of the FLOPs saved against recency (0: LRU)", min=0)
    checkpoint_placement: Literal["stride", "overlap", "end_of_turn"] = _setting(
        "stride", "the boundaries a \"scan\" prefill saves: every one it crosses, or those the shared-prefix lengths "
                  "seen so far make most useful (a dynamic program, scheduler/placement.py); end_of_turn: every "
                  "one, and the states at the end of each prompt and of each output so far")
    host_checkpoint_bytes: int = _setting(
        0, "host memory for checkpoints the device pool evicts: a later hit copies one back before its step (0: "
           "none; one device only)", min=0)
    checkpoint_dtype: Literal["float32", "bfloat16", "int8", "float8_e4m3fn"] = _setting(
        "float32", "how checkpoints are stored: float32 as the live state, or compressed (per-head scales for int8 and "
                   "float8) and expanded at restore, 2x (bfloat16) or 4x as many in the same bytes; drifts from exact")
    num_kv_blocks: int | None = _setting(None, "KV blocks (None: from the memory budget)", min=1)
    num_linear_slots: int | None = _setting(None, "linear-state slots (None: from the memory budget)", min=1)
    memory_budget_bytes: int | None = _setting(
        None, "bytes for the KV and linear-state pools (None: gpu_memory_utilization of an accelerator's memory "
              "less the weights; 2 GiB on the CPU); explicit pool counts win", min=1)
    gpu_memory_utilization: float = _setting(
        GPU_MEMORY_UTILIZATION, "fraction of the memory XLA may allocate on an accelerator (by default 75% of it: "
                                "XLA_PYTHON_CLIENT_MEM_FRACTION) for the weights and the caches, a share per engine")
    unsafe_reuse: Literal["cold", "stale"] | None = _setting(
        None, "an ablation for accuracy studies, never for serving: reuse the whole KV match with a zero (\"cold\") "
              "or an earlier (\"stale\") GDN state, the two errors the exact cache prevents", cli=False)

    def __post_init__(self):
        _check_fields(self)
        if self.chunk_stride % self.block_size:
            raise ValueError(f"chunk_stride ({self.chunk_stride}) must be a positive multiple of block_size "
                             f"({self.block_size})")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:  # also where no budget is asked for (both counts given)
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.unsafe_reuse is not None and not self.enable_prefix_caching:
            raise ValueError("unsafe_reuse needs enable_prefix_caching=True: it is an ablation of the prefix cache")
        if self.checkpoint_dtype != "float32" and self.host_checkpoint_bytes:
            raise ValueError(f"checkpoint_dtype={self.checkpoint_dtype!r} keeps its compressed checkpoints on the "
                             f"device, host_checkpoint_bytes on the host: set one of them")


@dataclasses.dataclass(frozen=True)
class SchedulingConfig:
    """How many requests run at once and how a step is cut (the scheduler package's SchedulerConfig is built from
    it and the cache settings)."""

    max_num_seqs: int = _setting(16, "requests running at once", min=1)
    max_model_len: int = _setting(4096, "longest prompt + output, tokens", min=1)
    max_num_batched_tokens: int | None = _setting(
        None, f"prompt tokens a step prefills at most (None: max(chunk_stride, {MAX_NUM_BATCHED_TOKENS}))", min=1)
    mixed_steps: bool = _setting(
        True, "a step decodes every running sequence and prefills within the rest of the token budget (\"scan\" "
              "mode; \"promote\" never mixes)")
    new_request_steps: bool = _setting(
        True, "with mixed_steps, a new request's first prefill runs ahead of its turn in a step of its own, at most "
              "every other step, so that its first token waits for no one else's prefill")
    max_running_per_request: int | None = _setting(
        None, "sequences of one request (the server's: one HTTP request's prompts x n) running at once; the rest "
              "wait while other requests' are admitted, so that one client's flood keeps the steps short (None: "
              "max_num_seqs)", min=1)
    async_scheduling: bool = _setting(
        False, "plan the next step while the device runs this one: its sampled tokens feed the next step on the "
               "device, and a request that ends computes one more token, dropped (vLLM's name; not with "
               "speculation)")
    # (no flags: `gdn-jax serve` bounds a whole HTTP request, prompts x n, and its queue with flags of its own)
    max_seqs_per_request: int = _setting(
        MAX_N, "sequences one request may add (its n); more is a ValueError", min=1, cli=False)
    max_waiting_sequences: int | None = _setting(
        None, "sequences that may wait to run; a request that would pass it is refused with EngineFull, to be "
              "retried later (None: unbounded)", min=1, cli=False)

    def __post_init__(self):
        _check_fields(self)


@dataclasses.dataclass(frozen=True)
class CompileConfig:
    """How steps are compiled and where compiled steps are kept."""

    gdn_schedule: Literal["auto", "fused", "parallel"] = _setting(
        "auto", "how prefill steps compute the GDN rule (same maths; auto: the compiled kernel on the CPU where it "
                "builds, else fused; parallel on accelerators)")
    compilation_cache_dir: str | None = _setting(
        None, "JAX persistent compilation cache folder ('' disables it; None: $GDN_JAX_CACHE_DIR, else "
              "$XDG_CACHE_HOME/gdn_jax/jax or ~/.cache/gdn_jax/jax)", flag="--compilation-cache")

    def __post_init__(self):
        _check_fields(self)


MAX_SPECULATIVE_TOKENS = 8


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, under vLLM's name and keys: `{"method": "mtp", "num_speculative_tokens": k}`. The model's
    MTP block drafts k tokens per running sequence, and one step of the model verifies them (docs/design.md,
    "Speculative decoding")."""
    method: Literal["mtp"] = "mtp"
    num_speculative_tokens: int = 1

    def __post_init__(self):
        if self.method != "mtp":
            raise ValueError(f"speculative_config: method must be 'mtp' (the model's own MTP block), got "
                             f"{self.method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an int in [1, "
                             f"{MAX_SPECULATIVE_TOKENS}], got {k!r}")
        object.__setattr__(self, "num_speculative_tokens", int(k))

    @classmethod
    def of(cls, value) -> "SpeculativeConfig | None":
        """A SpeculativeConfig from one, a dict of its keys, or its JSON text (the command line's); None stays."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config: not JSON ({exc}): {value!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict such as {{\"method\": \"mtp\", "
                             f"\"num_speculative_tokens\": 2}}, got {value!r}")
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; the keys are method and "
                             f"num_speculative_tokens")
        return cls(**value)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Every setting of an engine: the model, its dtype and seed, and the cache, scheduling and compile settings.
    `EngineConfig.create(**flat)` builds one from the fields' flat names (`chunk_stride=64`), as `LLM`, `LLMEngine`
    and the command line take them."""

    model: str | os.PathLike | ModelConfig = _setting(
        "tiny", "preset name (tiny, hybrid-1024, ...) or HF model folder")
    dtype: Literal["float32", "bfloat16"] = _setting("float32", "weights and activations")
    seed: int = _setting(0, "weights of random presets; default sampling seed")
    generation_config: Literal["auto", "vllm"] = _setting(
        "auto", "auto: the model folder's generation_config.json sampling defaults (temperature, top_p, top_k, "
                "min_p, repetition_penalty, max_new_tokens) for what a request leaves unset, as vLLM does; vllm: "
                "the neutral defaults")
    verbose: bool = _setting(True, "print the memory plan when the engine starts", cli=False)
    tensor_parallel_size: int = _setting(
        1, "devices the model is split over: tensor parallelism on a mesh axis 'tp' (Megatron layout, pools split "
           "by heads)", min=1)
    expert_parallel_size: int = _setting(
        1, "devices an MoE model's experts are split over (a mesh axis 'ep'; the engine uses ep x tp devices)", min=1)
    deterministic: bool = _setting(
        False, "the batch-invariant forward: a request's logits, bit for bit, alone or batched, with the cache on or "
               "off, however its prompt is split into steps (slower; one device)")
    speculative_config: SpeculativeConfig | None = _setting(
        None, "speculative decoding with the model's MTP block, as JSON: {\"method\": \"mtp\", "
              "\"num_speculative_tokens\": k} (greedy and seeded outputs as without it)")
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduling: SchedulingConfig = dataclasses.field(default_factory=SchedulingConfig)
    compile: CompileConfig = dataclasses.field(default_factory=CompileConfig)

    def __post_init__(self):
        if not isinstance(self.model, (str, os.PathLike, ModelConfig)):  # LLM(3) failed inside pathlib
            raise ValueError(f"model must be a model name, a folder or a ModelConfig, got {self.model!r} "
                             f"({type(self.model).__name__})")
        object.__setattr__(self, "speculative_config", SpeculativeConfig.of(self.speculative_config))
        _check_fields(self)
        for name, kind in SUB_CONFIGS.items():
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"{name} must be a {kind.__name__}, got {getattr(self, name)!r}")
        if not 0 <= self.seed < SEED_BOUND:  # reduced modulo 2**32 before: seeds 0 and 2**32 gave the same model
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
        if self.deterministic and self.tensor_parallel_size * self.expert_parallel_size > 1:
            raise ValueError(f"deterministic=True runs on one device: tensor_parallel_size "
                             f"({self.tensor_parallel_size}) and expert_parallel_size ({self.expert_parallel_size}) "
                             f"must be 1")
        tier = ("host_checkpoint_bytes" if self.cache.host_checkpoint_bytes else
                "checkpoint_dtype" if self.cache.checkpoint_dtype != "float32" else None)
        if tier and self.tensor_parallel_size * self.expert_parallel_size > 1:
            raise ValueError(f"{tier} runs on one device: tensor_parallel_size "
                             f"({self.tensor_parallel_size}) and expert_parallel_size ({self.expert_parallel_size}) "
                             f"must be 1")
        if self.speculative_config is not None:
            refused = ("deterministic=True" if self.deterministic else
                       "tensor or expert parallelism" if self.tensor_parallel_size * self.expert_parallel_size > 1
                       else "checkpoint_mode 'promote'" if self.cache.checkpoint_mode == "promote" else None)
            if refused:
                raise ValueError(f"speculative_config runs on one device, in the default forms and checkpoint_mode "
                                 f"'scan': not with {refused}")
        if self.scheduling.async_scheduling and self.speculative_config is not None:
            raise ValueError("async_scheduling runs without speculative_config: a verify step's tokens are known "
                             "only once its drafts are checked")
        if self.token_budget < self.cache.chunk_stride:
            raise ValueError(f"max_num_batched_tokens ({self.token_budget}) must be >= chunk_stride "
                             f"({self.cache.chunk_stride})")

    @property
    def num_speculative_tokens(self) -> int:
        """Drafts per running sequence and step (0: no speculation)."""
        return 0 if self.speculative_config is None else self.speculative_config.num_speculative_tokens

    @property
    def token_budget(self) -> int:
        """Prompt tokens a step prefills at most: max_num_batched_tokens, else max(chunk_stride,
        MAX_NUM_BATCHED_TOKENS)."""
        given = self.scheduling.max_num_batched_tokens
        return max(self.cache.chunk_stride, MAX_NUM_BATCHED_TOKENS) if given is None else given

    @classmethod
    def create(cls, **settings) -> "EngineConfig":
        """The config of these flat settings (`chunk_stride=64, max_num_seqs=8`), defaults for the rest; an unknown
        name is a ValueError naming it."""
        unknown = [name for name in settings if name not in SETTINGS]
        if unknown:
            raise ValueError(f"unknown engine setting(s) {', '.join(map(repr, unknown))}; the settings are "
                             f"EngineConfig's fields: {', '.join(SETTINGS)}")
        parts = {name: {} for name in SUB_CONFIGS}
        top = {}
        for name, value in settings.items():
            (top if SETTINGS[name] is None else parts[SETTINGS[name]])[name] = value
        return cls(**top, **{name: SUB_CONFIGS[name](**parts[name]) for name in SUB_CONFIGS})

    def replace(self, **settings) -> "EngineConfig":
        """A copy with these flat settings changed."""
        return EngineConfig.create(**{**self.settings(), **settings})

    def settings(self) -> dict:
        """Every setting by its flat name."""
        return {name: getattr(self if part is None else getattr(self, part), name) for name, part in SETTINGS.items()}


SUB_CONFIGS = {"cache": CacheConfig, "scheduling": SchedulingConfig, "compile": CompileConfig}
# flat setting name -> the sub-config holding it (None: EngineConfig itself)
SETTINGS = {f.name: None for f in dataclasses.fields(EngineConfig) if f.name not in SUB_CONFIGS} | {
    f.name: part for part, kind in SUB_CONFIGS.items() for f in dataclasses.fields(kind)}


def setting_fields() -> list[tuple[dataclasses.Field, object]]:
    """Every setting's field with its resolved type, in declaration order (EngineConfig's own, then each
    sub-config's): what the command line's flags are generated from."""
    out = []
    for cls in (EngineConfig, *SUB_CONFIGS.values()):
        out += [(f, _hints(cls)[f.name]) for f in dataclasses.fields(cls) if f.name not in SUB_CONFIGS]
    return out
