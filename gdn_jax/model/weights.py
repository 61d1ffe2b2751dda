"""Weights: HF safetensors folders (text or multimodal layout) -> NNX params; orbax save / restore of converted params."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdn_jax.config import FULL, LINEAR, PRESETS, ModelConfig, NotAModelFolder, get_preset
from gdn_jax.model.mtp import mtp_layer_config
from gdn_jax.model.qwen35 import Qwen35Model, init_model
from gdn_jax.model import sharding
from gdn_jax.model.layers import fused_parts

SKIPPED_PREFIXES = ("mtp.", "model.visual.")  # the MTP block's are read where the config builds it
WEIGHT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names of the dtypes a weight may be stored in


def _hf_names(cfg: ModelConfig, fused_experts: bool = False) -> dict[str, tuple[tuple, object]]:
    """HF tensor name (text layout) -> (param path in the NNX state, part): which part of the param the tensor is
    (`_part_shape`, `_assemble`, `_extract`). None: the whole param; a slice: the rows of a fused projection
    (`model.fused_parts`); "T": an MoE layer's experts stored as one [experts, out, in] tensor, the param's last two
    axes swapped (`fused_experts`, else ("expert", e, "gate" | "up" | "down"): expert e's projection);
    ("next", "qkvz" | "ba"): Qwen3-Next's GDN input projections, grouped per key head. Projection matrices keep the
    HF layout [out, in]."""
    names = {"model.embed_tokens.weight": (("embed_tokens",), None), "model.norm.weight": (("norm", "weight"), None)}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = (("lm_head", "kernel"), None)
    fused = fused_parts(cfg)
    next_gdn = cfg.model_type == "qwen3_next"

    def rows(module_path, prefix, parts):
        offset = 0
        for proj, n in parts:
            names[prefix + f"{proj}.weight"] = ((*module_path, "kernel"), slice(offset, offset + n))
            offset += n

    def layer(cfg, i, t, p, at):  # decoder layer i (of type t) of `cfg`, its tensors under p, its params at `at`
        names[p + "input_layernorm.weight"] = ((*at, "input_layernorm", "weight"), None)
        names[p + "post_attention_layernorm.weight"] = ((*at, "post_attention_layernorm", "weight"), None)
        mixer = "linear_attn" if t == LINEAR else "self_attn"
        names[p + f"{mixer}.{'out_proj' if t == LINEAR else 'o_proj'}.weight"] = (
            (*at, mixer, "out_proj" if t == LINEAR else "o_proj", "kernel"), None)
        if t == LINEAR and next_gdn:
            for part in ("qkvz", "ba"):
                names[p + f"linear_attn.in_proj_{part}.weight"] = ((*at, mixer, "in_proj", "kernel"), ("next", part))
        else:
            for name, parts in fused[mixer].items():
                rows((*at, mixer, name), p + f"{mixer}.", parts)
        mlp = (*at, "mlp")
        if not cfg.is_moe_layer(i):
            rows((*mlp, "gate_up_proj"), p + "mlp.", fused["mlp"]["gate_up_proj"])
            names[p + "mlp.down_proj.weight"] = ((*mlp, "down_proj", "kernel"), None)
        else:
            rows((*mlp, "gate"), p + "mlp.", (("gate", cfg.num_experts),) + (  # the router and the shared gate
                (("shared_expert_gate", 1),) if cfg.shared_expert_intermediate_size else ()))
            gate_up, down = (*mlp, "experts_gate_up", "kernel"), (*mlp, "experts_down", "kernel")
            if fused_experts:
                names[p + "mlp.experts.gate_up_proj"], names[p + "mlp.experts.down_proj"] = (gate_up, "T"), (down, "T")
            for e in range(0 if fused_experts else cfg.num_experts):
                for proj in ("gate", "up", "down"):
                    names[p + f"mlp.experts.{e}.{proj}_proj.weight"] = (down if proj == "down" else gate_up,
                                                                        ("expert", e, proj))
            if size := cfg.shared_expert_intermediate_size:
                rows((*mlp, "shared_expert", "gate_up_proj"), p + "mlp.shared_expert.",
                     (("gate_proj", size), ("up_proj", size)))
                names[p + "mlp.shared_expert.down_proj.weight"] = ((*mlp, "shared_expert", "down_proj", "kernel"), None)
        if t == LINEAR:
            for leaf in ("conv1d", "dt_bias", "A_log"):
                key = p + f"linear_attn.{leaf}" + (".weight" if leaf == "conv1d" else "")
                names[key] = ((*at, "linear_attn", leaf), None)
            names[p + "linear_attn.norm.weight"] = ((*at, "linear_attn", "norm", "weight"), None)
        else:
            for norm in ("q_norm", "k_norm"):
                names[p + f"self_attn.{norm}.weight"] = ((*at, "self_attn", norm, "weight"), None)

    for i, t in enumerate(cfg.layer_types):
        layer(cfg, i, t, f"model.layers.{i}.", ("layers", i))
    if cfg.mtp_num_hidden_layers:  # the drafting block (`model.mtp`): its own norms, fc and full-attention layers
        for leaf in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            names[f"mtp.{leaf}.weight"] = (("mtp", leaf, "weight"), None)
        names["mtp.fc.weight"] = (("mtp", "fc", "kernel"), None)
        for j in range(cfg.mtp_num_hidden_layers):
            layer(mtp_layer_config(cfg), 0, FULL, f"mtp.layers.{j}.", ("mtp", "layers", j))
    return names


def _next_groups(cfg: ModelConfig, part: str) -> list[int]:
    """Rows per key head of Qwen3-Next's grouped projection `part`: q, k, v, z (qkvz) or b, a (ba)."""
    r = cfg.linear_num_value_heads // cfg.linear_num_key_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    return [dk, dk, r * dv, r * dv] if part == "qkvz" else [r, r]


def _part_shape(cfg: ModelConfig, shape: tuple, part) -> tuple:
    """The HF tensor's shape for `part` of a param of `shape` (`_hf_names`)."""
    if part is None:
        return tuple(shape)
    if isinstance(part, slice):
        return (part.stop - part.start, *shape[1:])
    if part == "T":
        return (shape[0], shape[2], shape[1])
    if part[0] == "expert":
        return (shape[2] // 2, shape[1]) if part[2] != "down" else (shape[2], shape[1])
    return (cfg.linear_num_key_heads * sum(_next_groups(cfg, part[1])), shape[1])


def _assemble(cfg: ModelConfig, parts: dict, xp=jnp):
    """A param from its HF tensors, {part key (`_part_key`): array}."""
    if list(parts) == [None]:
        return parts[None]
    keys = sorted(parts, key=repr)
    if keys[0][0] == "rows":
        return xp.concatenate([parts[k] for k in sorted(parts)], axis=0)
    if keys == [("T",)]:
        return xp.swapaxes(parts[("T",)], 1, 2)
    if keys[0][0] == "expert":
        experts = sorted({k[1] for k in parts})
        if all(("expert", e, "down") in parts for e in experts):
            return xp.stack([parts[("expert", e, "down")].T for e in experts])
        return xp.stack([xp.concatenate([parts[("expert", e, "gate")].T, parts[("expert", e, "up")].T], axis=1)
                         for e in experts])
    nk = cfg.linear_num_key_heads  # Qwen3-Next: [q | k | v | z | b | a], each part over every key head
    pieces = []
    for name in ("qkvz", "ba"):
        grouped = parts[("next", name)].reshape(nk, -1, parts[("next", name)].shape[-1])
        cuts = list(itertools.accumulate(_next_groups(cfg, name)))[:-1]
        pieces += [piece.reshape(-1, grouped.shape[-1]) for piece in xp.split(grouped, cuts, axis=1)]
    return xp.concatenate(pieces, axis=0)


def _part_key(part):
    return None if part is None else ("rows", part.start) if isinstance(part, slice) else tuple(part)


def _extract(cfg: ModelConfig, arr: np.ndarray, part) -> np.ndarray:
    """`part` of a param (HF order) as its HF tensor: `_assemble`'s inverse."""
    if part is None:
        return arr
    if isinstance(part, slice):
        return arr[part]
    if part == "T":
        return np.swapaxes(arr, 1, 2)
    if part[0] == "expert":
        _, e, proj = part
        half = arr.shape[2] // 2
        return arr[e].T if proj == "down" else arr[e, :, :half].T if proj == "gate" else arr[e, :, half:].T
    kd, vd, nv = cfg.linear_key_dim, cfg.linear_value_dim, cfg.linear_num_value_heads
    q, k, v, z, b, a = np.split(arr, np.cumsum([kd, kd, vd, vd, nv])[:5], axis=0)
    nk = cfg.linear_num_key_heads
    own = (q, k, v, z) if part[1] == "qkvz" else (b, a)
    return np.concatenate([x.reshape(nk, -1, arr.shape[1]) for x in own], axis=1).reshape(-1, arr.shape[1])


def _shards(folder: Path) -> list[str]:
    """The safetensors files of a single-file or sharded checkpoint, as names inside `folder`."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
            if not all(isinstance(f, str) for f in files):
                raise TypeError
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{index} is no safetensors index (a JSON object with a 'weight_map')") from None
        outside = [f for f in files if Path(f).is_absolute() or ".." in Path(f).parts]
        if outside:  # (a shard may be a link to a file elsewhere, as in a download cache: its name is what counts)
            raise ValueError(f"{index} names shard(s) outside the folder: {', '.join(outside)}")
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise NotAModelFolder(f"{index} names shard(s) missing from {folder}: {', '.join(missing)}")
        return files
    if (folder / "model.safetensors").is_file():
        return ["model.safetensors"]
    raise NotAModelFolder(f"no model.safetensors or model.safetensors.index.json in {folder}")


@contextlib.contextmanager
def _safe_open(folder: Path, fname: str):
    """safetensors' `safe_open` of one shard; a truncated or corrupt file is a ValueError naming it (the library's
    message names no file)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(folder / fname), framework="flax") as f:
            yield f
    except SafetensorError as e:
        raise ValueError(f"{folder / fname} cannot be read as safetensors: {e}") from None


def _skipped(cfg: ModelConfig) -> tuple[str, ...]:
    """The tensor name prefixes a model of `cfg` does not read."""
    return tuple(p for p in SKIPPED_PREFIXES if not (p == "mtp." and cfg.mtp_num_hidden_layers))


def _tensor_names(folder: Path, shards: list[str], skipped: tuple[str, ...] = SKIPPED_PREFIXES) -> set[str]:
    """Every tensor's name (text layout, `_canonical`), from the shards' headers alone. A name held twice (in two
    shards, or under the text and the multimodal prefix) is a ValueError naming both: which copy a loader takes
    would decide the model's numbers. So is a dtype no weight is stored in."""
    where: dict[str, tuple[str, str]] = {}  # name -> (file, the name as stored)
    for fname in shards:
        with _safe_open(folder, fname) as f:
            names = [n for n in f.keys() if not n.startswith(skipped)]
            dtypes = {n: f.get_slice(n).get_dtype() for n in names}
        for raw in names:
            if dtypes[raw] not in WEIGHT_DTYPES:  # integers; float8, whose scales only a quantized config has
                raise ValueError(f"tensor {raw!r} in {folder / fname} has dtype {dtypes[raw]}, expected a "
                                 f"floating-point dtype ({', '.join(WEIGHT_DTYPES)})")
            name = _canonical(raw)
            if name in where:
                first, first_raw = where[name]
                raise ValueError(f"tensor {name!r} is stored twice in {folder}: as {first_raw!r} in {first} and as "
                                 f"{raw!r} in {fname}")
            where[name] = fname, raw
    return set(where)


def _open_tensors(folder: Path, shards: list[str], skipped: tuple[str, ...] = SKIPPED_PREFIXES):
    """Yields (name, array) for every tensor of the checkpoint's shards (their dtypes checked: `_tensor_names`)."""
    for fname in shards:
        with _safe_open(folder, fname) as f:
            for name in f.keys():
                if not name.startswith(skipped):
                    yield name, f.get_tensor(name)


def _has_nonfinite(arr) -> bool:
    """Whether a floating-point array holds a NaN or an infinity. A NaN or an infinity makes the float32 sum
    non-finite, so only a non-finite sum (or a sum that overflows, which no model's weights do) is looked at value
    by value. On the CPU backend in numpy (no copy); elsewhere on the device."""
    if jax.default_backend() == "cpu":
        host = np.asarray(arr)
        return not np.isfinite(np.sum(host, dtype=np.float32)) and not bool(np.isfinite(host).all())
    return not bool(jnp.isfinite(jnp.sum(arr, dtype=jnp.float32))) and not bool(jnp.isfinite(arr).all())


def _canonical(name: str) -> str:
    """Maps the multimodal layout (`model.language_model.*`) onto the text layout (`model.*`)."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name


def abstract_model(cfg: ModelConfig, dtype=jnp.float32, mesh=None):
    """(graphdef, abstract params) without allocating weights (`mesh`: see `Qwen35Model`)."""
    return nnx.split(nnx.eval_shape(lambda: Qwen35Model(cfg, dtype=dtype, rngs=nnx.Rngs(0), mesh=mesh)))


def load_hf_weights(folder: str | Path, cfg: ModelConfig | None = None, dtype=jnp.float32, mesh=None,
                    mtp: bool = False):
    """Loads a HF Qwen3.5 folder; returns (cfg, graphdef, params). Errors name the missing or mis-shaped tensor. A
    checkpoint that stores an lm_head.weight of its own under tie_word_embeddings true comes back untied (a warning
    says so), as transformers loads it.

    With a "tp" `mesh` the params come split over it in the tensor-parallel layout (`graphdef` is then that of
    `sharding.tp_config(cfg, tp)`; `cfg` stays the HF-order config): each parameter is placed as soon as its
    tensors are read, every device given only its slice, so the host holds one parameter at a time, never the
    model. `mtp`: the MTP block too (`model.mtp`; its tensors are otherwise skipped)."""
    folder = Path(folder)
    cfg = cfg or ModelConfig.from_pretrained(folder)
    if not mtp:  # the drafting block is built and read only for speculation
        cfg = dataclasses.replace(cfg, mtp_num_hidden_layers=0)
    elif not cfg.mtp_num_hidden_layers:
        raise ValueError(f"{folder}: the model config declares no MTP layers (mtp_num_hidden_layers) to draft with")
    # the names checked against the config from the files' headers, before the model is built: a config of many
    # more layers than the checkpoint holds took minutes to trace before its first missing tensor was named
    shards, skipped = _shards(folder), _skipped(cfg)
    stored = _tensor_names(folder, shards, skipped)
    expected = _hf_names(cfg, fused_experts=any(n.endswith(".mlp.experts.gate_up_proj") for n in stored))
    unexpected = [n for n in stored if n not in expected and not (n == "lm_head.weight" and cfg.tie_word_embeddings)]
    if unexpected:
        raise ValueError(f"unexpected tensor {unexpected[0]!r} in {folder} (not part of the {cfg.name} layout)"
                         + (f"; {len(unexpected) - 1} more" if len(unexpected) > 1 else ""))
    missing = [n for n in expected if n not in stored]
    if missing:
        raise ValueError(f"missing tensor(s) in {folder}: {', '.join(missing[:5])}"
                         + (" ..." if len(missing) > 5 else ""))
    tp_cfg = cfg if mesh is None else sharding.tp_config(cfg, mesh.shape[sharding.AXIS],
                                                         mesh.shape[sharding.EXPERTS])
    graphdef, abstract = abstract_model(tp_cfg, dtype, mesh)
    flat = dict(nnx.to_flat_state(abstract))
    shapes = flat if mesh is None else dict(nnx.to_flat_state(abstract_model(cfg, dtype)[1]))  # the HF order's
    parts_of = {}  # param path -> how many tensors fill it
    for path, _ in expected.values():
        parts_of[path] = parts_of.get(path, 0) + 1
    loaded = {}  # param path -> {part key: array}, until every part of it is read
    head = embed = None  # a tied model's stored lm_head.weight, and the embeddings it is compared with

    def place(path, parts):
        arr = _assemble(cfg, parts)
        if flat[path].get_value().dtype == jnp.uint16:  # a 16-bit expert kernel's bit patterns (`moe.ExpertKernel`)
            arr = jax.lax.bitcast_convert_type(arr, jnp.uint16)
        if mesh is not None:
            arr = sharding.split_param(cfg, tp_cfg, mesh, path, arr)
        flat[path] = flat[path].replace(arr)

    for name, arr in _open_tensors(folder, shards, skipped):
        name = _canonical(name)
        if _has_nonfinite(arr):  # the model would run, and every logit come out NaN: tokens 0, 0, 0, ...
            raise ValueError(f"tensor {name!r} in {folder} holds NaN or infinite values: the checkpoint is damaged")
        if name not in expected:  # (`stored` was checked: a tied model's lm_head.weight of its own)
            head = arr
            continue
        path, part = expected[name]
        want = _part_shape(cfg, shapes[path].get_value().shape, part)
        conv = name.endswith("conv1d.weight")
        if conv and arr.shape == (want[0], 1, want[1]):
            arr = arr[:, 0, :]  # HF [C, 1, K] -> [C, K] (a [C, K] weight is taken as it is)
        if tuple(arr.shape) != tuple(want):
            hf_want = (want[0], 1, want[1]) if conv else want  # the shape the HF layout has
            raise ValueError(f"tensor {name!r} has shape {tuple(arr.shape)}, expected {tuple(hf_want)}")
        parts = loaded.setdefault(path, {})
        kept = flat[path].get_value().dtype  # (uint16: a 16-bit expert kernel's bit patterns, placed as such)
        parts[_part_key(part)] = jnp.asarray(arr, dtype=dtype if kept == jnp.uint16 else kept)
        if path == ("embed_tokens",) and cfg.tie_word_embeddings and "lm_head.weight" in stored:
            embed = parts[None]
        if len(parts) == parts_of[path]:
            place(path, loaded.pop(path))
    if head is not None and not (head.shape == embed.shape and bool(jnp.array_equal(jnp.asarray(head, embed.dtype),
                                                                                     embed))):
        # transformers ties no lm_head.weight stored with values of its own: it computes with it, untied (compared
        # in the dtype the model runs in, where equal values are the tied model)
        warnings.warn(f"{folder}: tie_word_embeddings is true but the checkpoint stores an lm_head.weight other than "
                      f"its embeddings; it is used untied, as transformers does", stacklevel=2)
        return load_hf_weights(folder, dataclasses.replace(cfg, tie_word_embeddings=False), dtype, mesh, mtp)
    params = nnx.from_flat_state(flat)
    return cfg, graphdef, params


def shard_model(cfg: ModelConfig, params, mesh, dtype=jnp.float32):
    """The HF-order model (`cfg`, params) split over `mesh`'s "tp" axis -> (its config `sharding.tp_config`,
    graphdef, params): each parameter converted to the tensor-parallel layout on the host, one at a time, and each
    device given its slice only."""
    tp_cfg = sharding.tp_config(cfg, mesh.shape[sharding.AXIS], mesh.shape[sharding.EXPERTS])
    graphdef, abstract = abstract_model(tp_cfg, dtype, mesh)
    flat = dict(nnx.to_flat_state(abstract))
    for path, var in nnx.to_flat_state(params):
        flat[path] = flat[path].replace(sharding.split_param(cfg, tp_cfg, mesh, path, var.get_value()))
    return tp_cfg, graphdef, nnx.from_flat_state(flat)


def hf_tensors(cfg: ModelConfig, params, fused_experts: bool = False) -> dict:
    """The params as HF tensors (text layout, numpy): name -> array, fused projections split back into theirs; an
    MoE layer's experts one tensor per expert and projection, or (`fused_experts`) one per projection."""
    if cfg.layout_shards != 1:
        raise ValueError(f"{cfg.name} is in the tensor-parallel layout (layout_shards={cfg.layout_shards}): save the "
                         f"model it was split from")
    flat = dict(nnx.to_flat_state(params))
    tensors = {}
    for name, (path, part) in _hf_names(cfg, fused_experts).items():
        arr = np.asarray(flat[path].get_value())
        if arr.dtype == np.uint16:  # a 16-bit expert kernel's bit patterns (`moe.ExpertKernel`)
            arr = arr.view(jnp.bfloat16)
        arr = _extract(cfg, arr, part)
        if name.endswith("conv1d.weight"):
            arr = arr[:, None, :]  # [C, K] -> HF [C, 1, K]
        tensors[name] = np.ascontiguousarray(arr)
    return tensors


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor of `cfg`'s checkpoint (text layout) with its shape, nothing allocated: to write a checkpoint
    of random weights tensor by tensor, say, where building the model first would hold it twice."""
    flat = {path: v.get_value().shape for path, v in nnx.to_flat_state(abstract_model(cfg)[1])}
    shapes = {}
    for name, (path, part) in _hf_names(cfg).items():
        shape = _part_shape(cfg, flat[path], part)
        shapes[name] = (shape[0], 1, shape[1]) if name.endswith("conv1d.weight") else shape
    return shapes


def save_hf_weights(folder: str | Path, cfg: ModelConfig, params) -> None:
    """Writes a HF folder (`config.json` + `model.safetensors`, text layout) that `load_hf_weights` reads back."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(hf_tensors(cfg, params), str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(cfg.to_hf_config(), indent=2) + "\n")


def save_params(params, path: str | Path) -> None:
    """Saves converted params with orbax (fast reload, no safetensors conversion)."""
    import orbax.checkpoint as ocp

    ckpt = ocp.StandardCheckpointer()
    ckpt.save(Path(path).absolute(), nnx.to_pure_dict(params), force=True)
    ckpt.wait_until_finished()


def restore_params(path: str | Path, cfg: ModelConfig, dtype=jnp.float32):
    """Restores params saved by `save_params`; returns (graphdef, params)."""
    import orbax.checkpoint as ocp

    graphdef, abstract = abstract_model(cfg, dtype)
    target = nnx.to_pure_dict(abstract)
    path = Path(path).absolute()
    if not path.is_dir():
        raise NotAModelFolder(f"no params saved at {path} (save_params writes a folder)")
    try:
        restored = ocp.StandardCheckpointer().restore(path, target)
    except Exception as e:  # orbax's and TensorStore's errors name neither the folder nor, often, what is wrong
        raise ValueError(f"{path}: cannot restore params for {cfg.name} (saved by save_params for this config?): "
                         f"{type(e).__name__}: {str(e)[:400]}") from e
    nnx.replace_by_pure_dict(abstract, restored)
    return graphdef, abstract


MODELS_DIR = Path(__file__).resolve().parents[1] / "models"


def shipped_models() -> list[str]:
    """Names of the trained model folders installed with the package (`LLM("tiny")`)."""
    if not MODELS_DIR.is_dir():
        return []
    return sorted(p.name for p in MODELS_DIR.iterdir() if (p / "config.json").is_file())


def model_folder(model: "str | ModelConfig") -> Path | None:
    """The folder a model name loads from: a shipped model's name (it wins over a same-named folder in the working
    directory; pass "./name" for that one), or an existing folder; None for presets and configs."""
    if isinstance(model, ModelConfig) or model in PRESETS:
        return None
    if not isinstance(model, (str, Path)) or not str(model).strip():  # "" would be the working directory
        raise ValueError(f"model must be a preset name, a shipped model's name or a model folder, got {model!r}")
    if model in shipped_models():
        return MODELS_DIR / model
    path = Path(model).expanduser()  # "~/models/x" from Python, where no shell expands it
    return path if path.is_dir() else None


def load_model(model: "str | ModelConfig", dtype=jnp.float32, seed: int = 0, mesh=None, mtp: bool = False):
    """A preset name or a `ModelConfig` (random deterministic weights), a shipped model's name, or a HF folder
    -> (cfg, graphdef, params); with a "tp" `mesh`, split over it (`load_hf_weights`, `shard_model`: `cfg` is the
    HF-order config, the graphdef that of its tensor-parallel layout). `mtp`: with the MTP block (a random model
    gets one layer where its config declares none)."""
    if isinstance(model, ModelConfig) or model in PRESETS:
        cfg = model if isinstance(model, ModelConfig) else get_preset(model)
        cfg = dataclasses.replace(cfg, mtp_num_hidden_layers=(cfg.mtp_num_hidden_layers or 1) if mtp else 0)
        graphdef, params = init_model(cfg, seed=seed, dtype=dtype)
        if mesh is not None:
            graphdef, params = shard_model(cfg, params, mesh, dtype)[1:]
        return cfg, graphdef, params
    folder = model_folder(model)
    if folder is None:
        raise ValueError(f"model {model!r} is neither a shipped model ({', '.join(shipped_models()) or 'none'}), "
                         f"a random-weight preset ({', '.join(PRESETS)}) nor a folder")
    return load_hf_weights(folder, dtype=dtype, mesh=mesh, mtp=mtp)
