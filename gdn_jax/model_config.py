"""The model's configuration: a frozen, hashable dataclass (static under jit), built from presets or a HF
config.json (dense Qwen3.5, Qwen3.5-MoE, Qwen3-Next). `gdn_jax.config` re-exports its names."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path

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
SUPPORTED_MODEL_TYPES = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next")
MOE_MODEL_TYPES = ("qwen3_5_moe_text", "qwen3_next")  # (text level) their MLPs are sparse-MoE blocks
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
    # sparse MoE (Qwen3.5-MoE, Qwen3-Next; 0 experts: dense): layer i is an MoE layer unless i is in mlp_only_layers or
    # (i + 1) % decoder_sparse_step; its block is a router's top-k of the experts plus, if sized, a shared expert
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    model_type: str = "qwen3_5_text"  # the HF family (its tensor names): qwen3_5_text, qwen3_5_moe_text, qwen3_next
    # the tensor-parallel layout (`model.sharding.tp_config`): the shards a fused projection's rows and the GDN conv
    # channels are interleaved for, so that each shard's slice holds its heads of every part (1: the HF order)
    layout_shards: int = 1
    # multi-token prediction (`model.mtp`): full-attention decoder layers that draft the token after next from the
    # model's last hidden state; 0: none built or loaded (the engine builds them only to speculate)
    mtp_num_hidden_layers: int = 0

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
        moe_ok = 0 < self.num_experts_per_tok <= self.num_experts and min(self.moe_intermediate_size,
                                                                          self.decoder_sparse_step) > 0
        if self.layout_shards < 1 or self.num_experts and not moe_ok:
            raise ValueError(f"layout_shards ({self.layout_shards}) must be >= 1, and an MoE config needs 1 <= "
                             f"num_experts_per_tok ({self.num_experts_per_tok}) <= num_experts ({self.num_experts}), "
                             f"a positive moe_intermediate_size and decoder_sparse_step")

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def num_kv_layers(self) -> int:
        """Layers whose keys and values the KV pools hold: the full-attention ones, then the MTP block's."""
        return len(self.full_layer_ids) + self.mtp_num_hidden_layers

    @property
    def linear_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def full_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

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

    def prefill_flops(self) -> tuple[float, float]:
        """(FLOPs per prefilled token, FLOPs per (query, earlier-or-same key) pair): what prefilling a prefix costs,
        linear * L + quadratic * L (L + 1) / 2, the measure of what a checkpoint hit saves (the "flop_aware"
        eviction). Per token: 2 per multiply-add of every matrix a token meets (the LM head and embedding excluded:
        a prefix's prefill samples nothing), the conv taps, and the GDN rule's state products (decay, two reads, one
        rank-1 write); per pair: attention's scores and values in every full-attention layer."""
        D, H, hd, kvh = self.hidden_size, self.num_attention_heads, self.head_dim, self.num_key_value_heads
        nv = self.linear_num_value_heads
        gdn = (D * (self.conv_dim + self.linear_value_dim + 2 * nv) + self.linear_value_dim * D
               + self.conv_dim * self.linear_conv_kernel_dim + 4 * nv * self.linear_key_head_dim
               * self.linear_value_head_dim)
        attention = D * (2 * H * hd + 2 * kvh * hd) + H * hd * D
        dense = 3 * D * self.intermediate_size
        moe = (self.num_experts * D + 3 * D * (self.num_experts_per_tok * self.moe_intermediate_size
                                                + self.shared_expert_intermediate_size) + D)
        per_token = sum((gdn if t == LINEAR else attention) + (moe if self.is_moe_layer(i) else dense)
                        for i, t in enumerate(self.layer_types))
        return 2.0 * per_token, 2.0 * 2 * H * hd * len(self.full_layer_ids)

    def fingerprint(self) -> str:
        """Identifies the model's state layout; mixed into the prefix-cache hash domains."""
        fields = dataclasses.asdict(self)
        fields.pop("mtp_num_hidden_layers")  # (the drafting layers hold none of the state a checkpoint holds)
        blob = json.dumps(fields, sort_keys=True).encode()
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
        if model_type in ("qwen3_5", "qwen3_5_moe"):
            if not isinstance(cfg.get("text_config"), dict):
                raise ValueError("a qwen3_5 config needs its text_config (a JSON object)")
            # Tied where either field says so. transformers' Qwen3_5ForConditionalGeneration (the class these
            # checkpoints name) ties as the top-level field says, and its save_pretrained writes a tied model with
            # false in text_config; its AutoModelForCausalLM builds the text model, tied as text_config says. A
            # checkpoint that stores an lm_head.weight of its own is untied either way (`load_hf_weights`).
            ties.append(cfg["text_config"].get("tie_word_embeddings"))
            cfg = {**cfg["text_config"], "model_type": model_type + "_text"}
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
        model_type = cfg.get("model_type", "qwen3_5_text")
        moe = _moe_fields(cfg) if model_type in MOE_MODEL_TYPES else {}
        if model_type == "qwen3_5_moe_text":  # no dense MLP: an intermediate_size is not read
            cfg = {"intermediate_size": 1, **cfg}
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
            model_type=model_type,
            mtp_num_hidden_layers=_mtp_layers(cfg),
            **moe,
        )

    def to_hf_config(self) -> dict:
        """The HF `config.json` dict (its `model_type`'s) that `from_hf_config` maps back to this config."""
        moe = {} if not self.num_experts else {
            "num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size}
        if self.model_type == "qwen3_next":
            moe.update(norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=self.decoder_sparse_step,
                       mlp_only_layers=list(self.mlp_only_layers))
        return moe | {
            "architectures": [ARCHITECTURES[self.model_type]], "model_type": self.model_type,
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
        } | ({"mtp_num_hidden_layers": self.mtp_num_hidden_layers} if self.mtp_num_hidden_layers else {})

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
ARCHITECTURES = {"qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
                 "qwen3_next": "Qwen3NextForCausalLM"}


def _mtp_layers(cfg: dict) -> int:
    """The MTP decoder layers a config declares: Qwen3.5's `mtp_num_hidden_layers`, Qwen3-Next's
    `num_nextn_predict_layers` (absent: none)."""
    value = cfg.get("mtp_num_hidden_layers", cfg.get("num_nextn_predict_layers")) or 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"model config field 'mtp_num_hidden_layers' must be an int >= 0, got {value!r}")
    return value


def _moe_fields(cfg: dict) -> dict:
    """The MoE fields of a `qwen3_5_moe_text` or `qwen3_next` config (Qwen3.5-MoE always renormalises the top k and
    has every layer sparse)."""
    fields = {"num_experts": cfg.get("num_experts"), "num_experts_per_tok": cfg.get("num_experts_per_tok"),
              "moe_intermediate_size": cfg.get("moe_intermediate_size"),
              "shared_expert_intermediate_size": cfg.get("shared_expert_intermediate_size") or 0}
    if cfg.get("model_type") == "qwen3_next":
        fields.update(decoder_sparse_step=cfg.get("decoder_sparse_step") or 1,
                      norm_topk_prob=cfg.get("norm_topk_prob", True), mlp_only_layers=cfg.get("mlp_only_layers") or [])
    for name, value in fields.items():
        ints = value if name == "mlp_only_layers" else [value]
        if name == "norm_topk_prob" and not isinstance(value, bool) or name != "norm_topk_prob" and (
                not isinstance(ints, list) or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ints)
                or name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size") and value < 1):
            raise ValueError(f"model config field {name!r} has a bad value {value!r}")
    return fields | ({"mlp_only_layers": tuple(fields["mlp_only_layers"])} if "mlp_only_layers" in fields else {})


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
    # A tiny sparse-MoE model (Qwen3-Next's layout): 8 experts, top 2, a shared expert, layer 1 dense.
    "tiny-random-moe": ModelConfig(
        name="tiny-random-moe", eos_token_id=1, max_position_embeddings=4096, model_type="qwen3_next",
        intermediate_size=96, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, mlp_only_layers=(1,)),
}
# The MoE releases' shapes (random weights; for the compile and memory benches): hidden, layers, experts, top k,
# expert and shared-expert sizes, GDN value heads, vocabulary, model type. Each layer sparse; 2 KV heads of 256,
# 16 GDN key heads, heads of 128.
for _name, (_d, _n, _e, _k, _i, _vh, _vocab, _type) in {
        "qwen3.5-35b-a3b": (2048, 40, 256, 8, 512, 32, 248320, "qwen3_5_moe_text"),
        "qwen3.5-122b-a10b": (3072, 48, 256, 8, 1024, 64, 248320, "qwen3_5_moe_text"),
        "qwen3-next-80b-a3b": (2048, 48, 512, 10, 512, 32, 151936, "qwen3_next")}.items():
    PRESETS[_name] = ModelConfig(
        name=_name, vocab_size=_vocab, hidden_size=_d, intermediate_size=_i, layer_types=hybrid_layer_types(_n),
        num_attention_heads=16 if _d == 2048 else 32, num_key_value_heads=2, head_dim=256, rope_theta=10_000_000.0,
        linear_num_key_heads=16, linear_num_value_heads=_vh, linear_key_head_dim=128, linear_value_head_dim=128,
        max_position_embeddings=262144, model_type=_type, num_experts=_e, num_experts_per_tok=_k,
        moe_intermediate_size=_i, shared_expert_intermediate_size=_i)


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(PRESETS)}")
    return PRESETS[name]
