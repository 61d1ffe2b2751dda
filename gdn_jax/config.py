"""Model configuration: a frozen, hashable dataclass (static under jit), built from presets or a HF config.json."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import types
import typing
from pathlib import Path
from typing import Literal

import numpy as np

from scheduler.sampling_params import MAX_N, SEED_BOUND


def folder_file(folder: str | Path | None, name: str) -> Path | None:
    """The path of a model folder's optional file `name`, None without the folder or the file. An entry of that name
    that is no readable file (a link to nothing, as a download cut short leaves in a cache; a directory) is a
    ValueError naming it, not an absent file: the model would run without its tokenizer or settings."""
    if folder is None:
        return None
    path = Path(folder) / name
    if path.is_file():
        return path
    if path.is_symlink() or path.exists():
        what = "a link to nothing" if path.is_symlink() and not path.exists() else "not a file"
        raise ValueError(f"{path} is {what}: a model folder's {name} must be a readable file (or absent)")
    return None


def folder_json(folder: str | Path | None, name: str) -> dict:
    """A model folder's JSON file `name` as a dict ({} without the folder or the file); one that is not a JSON object
    is a ValueError naming it."""
    path = folder_file(folder, name)
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not valid JSON (an object is due, got {type(data).__name__})")
    return data


LINEAR = "linear_attention"
# transformers' Qwen3_5TextConfig default for a config.json without head_dim: a fixed 256, not hidden_size / heads
HF_DEFAULT_HEAD_DIM = 256
FULL = "full_attention"
SUPPORTED_MODEL_TYPES = ("qwen3_5_text", "qwen3_5")
# older layer type names that transformers maps onto the current ones (configuration_utils.remap_legacy_layer_types)
LEGACY_LAYER_TYPES = {"mamba": LINEAR, "attention": FULL}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    layer_types: tuple[str, ...] = (LINEAR, LINEAR, LINEAR, FULL)
    # gated full attention
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10000.0
    # Gated DeltaNet
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    eos_token_id: int | None = None
    name: str = "custom"
    # the tensor-parallel layout (`model.sharding.tp_config`): the shards a fused projection's rows and the GDN conv
    # channels are interleaved for, so that each shard's slice holds its heads of every part (1: the HF order)
    layout_shards: int = 1

    def __post_init__(self):
        bad = [t for t in self.layer_types if t not in (LINEAR, FULL)]
        if bad:
            raise ValueError(f"unsupported layer type(s) {sorted(set(bad))}; expected {LINEAR!r} or {FULL!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.linear_num_key_heads})")
        if self.rotary_dim % 2:
            raise ValueError(f"rotary dim head_dim * partial_rotary_factor = {self.rotary_dim} must be even")
        if self.layout_shards < 1:
            raise ValueError(f"layout_shards must be >= 1, got {self.layout_shards}")

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def linear_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def full_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:  # channels of the qkv conv: [Q | K | V]
        return 2 * self.linear_key_dim + self.linear_value_dim

    def fingerprint(self) -> str:
        """Identifies the model's state layout; mixed into the prefix-cache hash domains."""
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @classmethod
    def from_hf_config(cls, cfg: dict, name: str = "custom") -> "ModelConfig":
        """Builds the config from a HF `config.json` dict (`qwen3_5_text`, or the text part of `qwen3_5`). A missing
        field or one of the wrong type is a ValueError naming it."""
        if not isinstance(cfg, dict):
            raise ValueError(f"a model config must be a JSON object, got {type(cfg).__name__}")
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        if cfg.get("text_config") is not None and not isinstance(cfg["text_config"], dict):
            raise ValueError(f"model config field 'text_config' must be a JSON object, got {cfg['text_config']!r}")
        for quant in (cfg.get("quantization_config"), (cfg.get("text_config") or {}).get("quantization_config")):
            if quant:  # its weights come with scales, in formats this loader does not dequantize
                method = quant.get("quant_method") if isinstance(quant, dict) else None
                raise ValueError(f"a quantized checkpoint (quantization_config, quant_method {method!r}) is not "
                                 f"supported: load the unquantized model")
        ties = [cfg.get("tie_word_embeddings")]
        if model_type == "qwen3_5":
            if not isinstance(cfg.get("text_config"), dict):
                raise ValueError("a qwen3_5 config needs its text_config (a JSON object)")
            # Tied where either field says so. transformers' Qwen3_5ForConditionalGeneration (the class these
            # checkpoints name) ties as the top-level field says, and its save_pretrained writes a tied model with
            # false in text_config; its AutoModelForCausalLM builds the text model, tied as text_config says. A
            # checkpoint that stores an lm_head.weight of its own is untied either way (`load_hf_weights`).
            ties.append(cfg["text_config"].get("tie_word_embeddings"))
            cfg = cfg["text_config"]
        for tie in ties:
            if tie is not None and not isinstance(tie, bool):
                raise ValueError(f"model config field 'tie_word_embeddings' must be true or false, got {tie!r}")
        tie = any(ties)  # a null is an absent value: untied, transformers' default
        try:
            return cls._from_text_config(cfg, tie, name)
        except KeyError as e:
            raise ValueError(f"the model config lacks {e.args[0]!r}") from None

    @classmethod
    def _from_text_config(cls, cfg: dict, tie, name: str) -> "ModelConfig":
        for field in _POSITIVE_INT_FIELDS:
            if cfg.get(field) is None:
                raise ValueError(f"the model config lacks {field!r}")
        for field in (*_POSITIVE_INT_FIELDS, "head_dim", "linear_conv_kernel_dim", "max_position_embeddings",
                      "full_attention_interval"):
            value = cfg.get(field)  # None: an optional field's default
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"model config field {field!r} must be a positive int, got {value!r}")
        eps = cfg.get("rms_norm_eps", 1e-6)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:  # 1e30: constant logits
            raise ValueError(f"model config field 'rms_norm_eps' must be a small positive number (0 < eps < 1), got "
                             f"{eps!r}")
        if not isinstance(tie, bool):
            raise ValueError(f"model config field 'tie_word_embeddings' must be true or false, got {tie!r}")
        act = cfg.get("hidden_act") or "silu"
        if act not in ("silu", "swish"):  # the MLP's and the GDN conv's activation; this model computes SiLU only
            raise ValueError(f"unsupported hidden_act {act!r} in the model config: only 'silu' is implemented")
        if cfg.get("attention_bias"):  # biases on q/k/v/o_proj in transformers; the checkpoint would hold them
            raise ValueError(f"unsupported attention_bias {cfg['attention_bias']!r} in the model config: the attention "
                             f"projections here have no biases")
        rope_theta, prf = _rope_fields(cfg)
        n = cfg["num_hidden_layers"]
        layer_types = cfg.get("layer_types")
        if layer_types is None:
            interval = cfg.get("full_attention_interval") or 4
            layer_types = [LINEAR if (i + 1) % interval else FULL for i in range(n)]
        if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
            raise ValueError(f"model config field 'layer_types' must be a list of layer type names, got {layer_types!r}")
        layer_types = [LEGACY_LAYER_TYPES.get(t, t) for t in layer_types]
        if len(layer_types) != n:
            raise ValueError(f"layer_types has {len(layer_types)} entries but num_hidden_layers is {n}")
        eos = cfg.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if eos is not None and (isinstance(eos, bool) or not isinstance(eos, int) or eos < 0):
            raise ValueError(f"model config field 'eos_token_id' must be a token id (an int >= 0), got {eos!r}")
        if eos is not None and eos >= cfg["vocab_size"]:  # the model could never produce it: nothing would end
            raise ValueError(f"model config field 'eos_token_id' is {eos}, outside the vocabulary "
                             f"[0, {cfg['vocab_size']})")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            layer_types=tuple(layer_types),
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg["num_key_value_heads"],
            head_dim=cfg.get("head_dim") or HF_DEFAULT_HEAD_DIM,
            partial_rotary_factor=prf,
            rope_theta=rope_theta,
            linear_num_key_heads=cfg["linear_num_key_heads"],
            linear_num_value_heads=cfg["linear_num_value_heads"],
            linear_key_head_dim=cfg["linear_key_head_dim"],
            linear_value_head_dim=cfg["linear_value_head_dim"],
            linear_conv_kernel_dim=cfg.get("linear_conv_kernel_dim") or 4,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(tie),
            max_position_embeddings=cfg.get("max_position_embeddings") or 32768,
            eos_token_id=eos,
            name=name,
        )

    def to_hf_config(self) -> dict:
        """The HF `config.json` dict (`qwen3_5_text`) that `from_hf_config` maps back to this config."""
        return {
            "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "layer_types": list(self.layer_types), "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.partial_rotary_factor},
            "linear_num_key_heads": self.linear_num_key_heads, "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim, "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim, "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings, "max_position_embeddings": self.max_position_embeddings,
            "eos_token_id": self.eos_token_id, "hidden_act": "silu", "torch_dtype": "float32",
        }

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise NotAModelFolder(f"no config.json in model folder {path}")
        data = folder_json(path, "config.json")
        try:
            return cls.from_hf_config(data, name=path.name)
        except ValueError as e:  # the file named, as the folder's other files' errors name theirs
            raise ValueError(f"{cfg_file}: {e}") from None


# RoPE types that are the plain rotation this model computes: "mrope" (Qwen-VL's legacy name) rotates text positions
# exactly so, its three position grids being equal for text
PLAIN_ROPE_TYPES = ("default", "mrope")


def _rope_fields(cfg: dict) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) as transformers reads them: the RoPE dict is a legacy `rope_scaling` if set,
    else `rope_parameters`; its rope_theta and partial_rotary_factor win over the top-level fields, then the defaults
    10000 and 0.25 (a null is an absent value). A scaled RoPE (yarn, linear, dynamic, ...) is refused by name: this
    model computes the plain rotation only, and another RoPE would be another model."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"model config field 'rope_parameters' must be a JSON object, got {rope!r}")
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type not in PLAIN_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r} in the model config: only the plain RoPE "
                         f"({', '.join(map(repr, PLAIN_ROPE_TYPES))}) is implemented")
    values = []
    for field, default in (("rope_theta", 10000.0), ("partial_rotary_factor", 0.25)):
        value = rope.get(field)
        value = cfg.get(field) if value is None else value
        value = default if value is None else value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"model config field {field!r} must be a finite positive number, got {value!r}")
        values.append(float(value))
    if values[1] > 1:
        raise ValueError(f"model config field 'partial_rotary_factor' must be at most 1, got {values[1]!r}")
    return values[0], values[1]


# config.json fields a model cannot do without (each a positive int)
_POSITIVE_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                        "linear_value_head_dim")


class NotAModelFolder(FileNotFoundError, ValueError):
    """A model folder without the files a model needs. A ValueError too, so that a command line that reports bad
    settings in one line (a ValueError naming what is wrong) reports this one so."""


def hybrid_layer_types(n_layers: int, interval: int = 4) -> tuple[str, ...]:
    """The Qwen3.5 layout: every `interval`-th layer is full attention, the others Gated DeltaNet."""
    return tuple(LINEAR if (i + 1) % interval else FULL for i in range(n_layers))


PRESETS: dict[str, ModelConfig] = {
    # Deterministic random weights, byte-level vocabulary (256 bytes + specials): small and fast, for tests and for
    # arbitrary shapes. The trained default `tiny` is a model folder shipped in the package (gdn_jax/models/tiny).
    "tiny-random": ModelConfig(name="tiny-random", eos_token_id=1, max_position_embeddings=4096),
    # The 8-layer hidden-1024 config of the forward and TTFT benchmarks.
    "hybrid-1024": ModelConfig(
        name="hybrid-1024", vocab_size=8192, hidden_size=1024, intermediate_size=3072, layer_types=hybrid_layer_types(8),
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, linear_num_key_heads=8,
        linear_num_value_heads=16, linear_key_head_dim=64, linear_value_head_dim=64, eos_token_id=1,
    ),
    # Qwen3.5-9B shapes (random weights; for memory sizing and GPU benchmarks).
    "qwen3.5-9b": ModelConfig(
        name="qwen3.5-9b", vocab_size=248320, hidden_size=4096, intermediate_size=12288, layer_types=hybrid_layer_types(32),
        num_attention_heads=16, num_key_value_heads=4, head_dim=256, rope_theta=10_000_000.0,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        max_position_embeddings=262144, eos_token_id=248044,
    ),
}


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(PRESETS)}")
    return PRESETS[name]


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
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduling: SchedulingConfig = dataclasses.field(default_factory=SchedulingConfig)
    compile: CompileConfig = dataclasses.field(default_factory=CompileConfig)

    def __post_init__(self):
        if not isinstance(self.model, (str, os.PathLike, ModelConfig)):  # LLM(3) failed inside pathlib
            raise ValueError(f"model must be a model name, a folder or a ModelConfig, got {self.model!r} "
                             f"({type(self.model).__name__})")
        _check_fields(self)
        for name, kind in SUB_CONFIGS.items():
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"{name} must be a {kind.__name__}, got {getattr(self, name)!r}")
        if not 0 <= self.seed < SEED_BOUND:  # reduced modulo 2**32 before: seeds 0 and 2**32 gave the same model
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
        if self.token_budget < self.cache.chunk_stride:
            raise ValueError(f"max_num_batched_tokens ({self.token_budget}) must be >= chunk_stride "
                             f"({self.cache.chunk_stride})")

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
