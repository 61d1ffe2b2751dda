"""Tensor parallelism: a model split over the devices of a mesh axis "tp", in the Megatron layout.

The step program is the one-device program: its arrays carry `NamedSharding`s and XLA's SPMD partitioner splits
the computation (no per-device code, no home-made communication). What is split:

- the fused column-parallel projections (q/k/v, gate/up, the GDN input projection) and the GDN conv taps by rows,
  each shard holding its heads of every part (`ModelConfig.layout_shards`, `layers.split_parts`), so that the
  split of a fused product, the convolution and the gated delta rule stay on their shard;
- o, down and the GDN output projection by columns: one all-reduce each;
- the embedding and the LM head by vocabulary: the logits are gathered before sampling (a [rows, vocab] float32
  array per step, small beside the weights, and sampling then sees the whole distribution, so top-p, penalties
  and logprobs need no distributed version);
- the pools by heads: KV by KV heads, conv and SSM state by GDN heads, so a restore, a checkpoint save and a fork
  copy move slots within each shard, never between devices;
- norms, and the GDN gates' per-head constants by heads; the norms replicated.

Where `tp` exceeds the KV heads (or the GDN key heads), each shard holds a copy of the one its query (value) heads
read, as vLLM replicates KV heads: `tp_config` gives the model those copies as heads of their own.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gdn_jax.config import ModelConfig

AXIS = "tp"
EXPERTS = "ep"


def tp_config(cfg: ModelConfig, tp: int, ep: int = 1) -> ModelConfig:
    """The config of `cfg` laid out for `tp` shards: KV and GDN key heads copied up to `tp` where fewer, the fused
    rows interleaved per shard. A size `tp` (or the expert-parallel size `ep`) does not divide is a ValueError naming
    the field."""
    if ep > 1 and (not cfg.num_experts or cfg.num_experts % ep):
        raise ValueError(f"expert_parallel_size={ep} does not divide num_experts={cfg.num_experts} of {cfg.name}"
                         + ("" if cfg.num_experts else " (a dense model: it has no experts to split)"))
    if tp == 1:
        return cfg
    dense = any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    for name, used in (("num_attention_heads", cfg.full_layer_ids), ("linear_num_value_heads", cfg.linear_layer_ids),
                       ("intermediate_size", dense), ("shared_expert_intermediate_size", True), ("vocab_size", True)):
        if used and getattr(cfg, name) % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide {name}={getattr(cfg, name)} of {cfg.name}")
    for name in ("num_key_value_heads", "linear_num_key_heads"):
        n = getattr(cfg, name)
        if n % tp and tp % n:
            raise ValueError(f"tensor_parallel_size={tp} and {name}={n} of {cfg.name}: one must divide the other "
                             f"(the heads are split, or each shard holds a copy of one)")
    return dataclasses.replace(cfg, num_key_value_heads=max(cfg.num_key_value_heads, tp),
                               linear_num_key_heads=max(cfg.linear_num_key_heads, tp), layout_shards=tp)


def make_mesh(tp: int, ep: int = 1, devices=None) -> Mesh:
    """A mesh of axes ("ep", "tp") over the first ep x tp devices: the experts split over "ep", everything else
    over "tp" (and replicated over "ep")."""
    devices, n = jax.devices() if devices is None else list(devices), tp * ep
    if len(devices) < n:
        hint = (f"; on the CPU, XLA_FLAGS=--xla_force_host_platform_device_count={n} (set before JAX starts) "
                f"makes {n} host devices" if devices and devices[0].platform == "cpu" else "")
        raise ValueError(f"tensor_parallel_size={tp} x expert_parallel_size={ep} needs {n} devices, {len(devices)} "
                         f"visible{hint}")
    return Mesh(np.array(devices[:n]).reshape(ep, tp), (EXPERTS, AXIS))


# -- the parameters ---------------------------------------------------------------------------------------------------

def _copy_heads(rows: np.ndarray, heads: int, copies: int) -> np.ndarray:
    """Rows of `heads` heads -> each head's rows `copies` times in a row (the KV or GDN key heads a shard reads)."""
    if copies == 1:
        return rows
    return np.repeat(rows.reshape(heads, -1, *rows.shape[1:]), copies, axis=0).reshape(-1, *rows.shape[1:])


def _interleave(parts: list[np.ndarray], shards: int) -> np.ndarray:
    """[a | b | c] -> [a0 b0 c0 | a1 b1 c1 | ...]: shard s's slice holds the s-th share of every part."""
    split = [p.reshape(shards, p.shape[0] // shards, *p.shape[1:]) for p in parts]
    return np.concatenate(split, axis=1).reshape(-1, *parts[0].shape[1:])


def _cut(arr: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    return np.split(arr, np.cumsum(sizes)[:-1], axis=0)


def layout_tensor(cfg: ModelConfig, tp_cfg: ModelConfig, path: tuple, arr: np.ndarray) -> np.ndarray:
    """One parameter of the HF-order model `cfg` (its flat-state path) in the layout of `tp_cfg`."""
    tp = tp_cfg.layout_shards
    if tp == 1:
        return arr
    kv = tp_cfg.num_key_value_heads // cfg.num_key_value_heads
    gk = tp_cfg.linear_num_key_heads // cfg.linear_num_key_heads
    kd, vd, nv = cfg.linear_key_dim, cfg.linear_value_dim, cfg.linear_num_value_heads
    nk = cfg.linear_num_key_heads
    name = path[-2] if path[-1] == "kernel" else path[-1]
    if name in ("in_proj", "conv1d"):
        sizes = [kd, kd, vd] + ([vd, nv, nv] if name == "in_proj" else [])
        q, k, *rest = _cut(arr, sizes)
        return _interleave([_copy_heads(q, nk, gk), _copy_heads(k, nk, gk), *rest], tp)
    if name == "qkv_proj":
        H, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q, k, v = _cut(arr, [2 * H * hd, kvh * hd, kvh * hd])
        return _interleave([q, _copy_heads(k, kvh, kv), _copy_heads(v, kvh, kv)], tp)
    if name == "gate_up_proj":  # an MLP's, or a shared expert's
        return _interleave(_cut(arr, [arr.shape[0] // 2] * 2), tp)
    return arr


def param_spec(path: tuple, ndim: int) -> P:
    """Where a parameter lies on the mesh (its flat-state path; see the module's docstring)."""
    name = path[-2] if path[-1] == "kernel" else path[-1]
    if name in ("embed_tokens", "lm_head", "in_proj", "qkv_proj", "gate_up_proj", "conv1d", "A_log", "dt_bias"):
        return P(AXIS, *([None] * (ndim - 1)))
    if name in ("o_proj", "out_proj", "down_proj"):
        return P(None, AXIS)
    if name in ("experts_gate_up", "experts_down"):  # [experts, n_in, n_out]: whole experts per device
        return P(EXPERTS)
    return P()  # norms, the router, the shared expert's gate


def split_param(cfg: ModelConfig, tp_cfg: ModelConfig, mesh: Mesh, path: tuple, arr) -> jax.Array:
    """One parameter of the HF-order model `cfg` (a host array, or one on the CPU backend, which np.asarray views
    without a copy) in `tp_cfg`'s layout on the mesh, each device given only its slice
    (`jax.make_array_from_callback`)."""
    host = layout_tensor(cfg, tp_cfg, path, np.asarray(arr))
    sharding = NamedSharding(mesh, param_spec(path, host.ndim))
    return jax.make_array_from_callback(host.shape, sharding, lambda index: np.ascontiguousarray(host[index]))


# -- the pools ----------------------------------------------------------------------------------------------------

def state_specs() -> dict[str, P]:
    """Where each pool lies: KV [kv_heads, layers, blocks, block, hd] by KV heads; conv [layers, slots, K-1, C] by
    channels (shard-interleaved, so by GDN heads); SSM [layers, slots, Hv, dk, dv] by value heads."""
    return {"k": P(AXIS), "v": P(AXIS), "conv": P(None, None, None, AXIS), "ssm": P(None, None, AXIS)}


def state_shardings(mesh: Mesh) -> tuple[NamedSharding, ...]:
    """(k, v, conv, ssm) shardings, in `DeviceState`'s field order (hashable: it keys the step functions)."""
    return tuple(NamedSharding(mesh, spec) for spec in state_specs().values())


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def bytes_on_device(tree, device) -> int:
    """Bytes of the arrays of `tree` that lie on `device` (the addressable shards there)."""
    return sum(s.data.nbytes for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array)
               for s in x.addressable_shards if s.device == device)
