"""The model's building blocks: bias-free projections (fused where they share an input) and RMSNorms."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
from flax import nnx

from gdn_jax.config import ModelConfig
from gdn_jax.model.dense import dense
from gdn_jax.model.forms import GENERIC, Forms


def split_parts(y, sizes, shards: int = 1) -> list:
    """The parts of sizes `sizes` that y's last axis stacks: in order ([a | b | c]), or with `shards` > 1 shard by
    shard, each shard's slice holding its share of every part ([a0 b0 c0 | a1 b1 c1 | ...], the tensor-parallel
    layout of `ModelConfig.layout_shards`). Sharded along that axis, every shard then splits its own slice: the
    reshapes keep the sharding on the leading axis, and no value crosses devices."""
    cuts = lambda n: list(itertools.accumulate(sizes[:-1] if n == 1 else [s // n for s in sizes[:-1]]))  # noqa: E731
    if shards == 1:
        return jnp.split(y, cuts(1), axis=-1)
    lead = y.shape[:-1]
    parts = jnp.split(y.reshape(*lead, shards, y.shape[-1] // shards), cuts(shards), axis=-1)
    return [p.reshape(*lead, -1) for p in parts]


class Linear(nnx.Module):
    """Bias-free projection with its matrix in the HF layout, kernel [n_out, n_in], accumulating in float32 (the
    fast bfloat16 path on CPU and GPU) and returning the activation dtype. `parts` names the HF projections a fused
    matrix stacks along its rows, with their sizes (see `fused_parts`), in the order `split_parts` reads with
    `shards`."""

    def __init__(self, n_in: int, n_out: int, dtype, std: float, rngs: nnx.Rngs, parts: tuple = (), shards: int = 1):
        self.kernel = nnx.Param(nnx.initializers.normal(std)(rngs.params(), (n_out, n_in), dtype))
        self.dtype, self.parts, self.shards = dtype, parts, shards

    def __call__(self, x, forms: Forms = GENERIC):
        y = dense(x.astype(self.dtype), self.kernel[...], forms).astype(self.dtype)
        if not self.parts:
            return y
        return split_parts(y, [n for _, n in self.parts], self.shards)


def _linear(rngs, n_in, n_out, dtype, std, parts: tuple = (), shards: int = 1):
    return Linear(n_in, n_out, dtype, std, rngs, parts, shards)


def fused_parts(cfg: ModelConfig) -> dict[str, dict[str, tuple[tuple[str, int], ...]]]:
    """The fused projections: per submodule of a layer, fused matrix -> ((HF projection name, output rows), ...) in
    the order its rows stack them. Projections of one input are one matrix, so a step runs one product per input
    (a decode step reads the weights in fewer, larger passes); the loader (`weights.load_hf_weights`) stacks the HF
    tensors, the writer splits them back."""
    H, kvh, hd, nv = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.linear_num_value_heads
    return {
        "linear_attn": {"in_proj": (("in_proj_qkv", cfg.conv_dim), ("in_proj_z", cfg.linear_value_dim),
                                    ("in_proj_b", nv), ("in_proj_a", nv))},
        "self_attn": {"qkv_proj": (("q_proj", 2 * H * hd), ("k_proj", kvh * hd), ("v_proj", kvh * hd))},
        "mlp": {"gate_up_proj": (("gate_proj", cfg.intermediate_size), ("up_proj", cfg.intermediate_size))},
    }


def _fused(rngs, cfg, module: str, name: str, dtype, std):
    parts = fused_parts(cfg)[module][name]
    return _linear(rngs, cfg.hidden_size, sum(n for _, n in parts), dtype, std, parts, cfg.layout_shards)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs, std, intermediate_size: int | None = None):
        """The SwiGLU MLP of `intermediate_size` (default the config's; an MoE block's shared expert has its own)."""
        size = cfg.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_up_proj = _linear(rngs, cfg.hidden_size, 2 * size, dtype, std,  # [gate | up]
                                    (("gate_proj", size), ("up_proj", size)), cfg.layout_shards)
        self.down_proj = _linear(rngs, size, cfg.hidden_size, dtype, std)

    def __call__(self, x, forms: Forms = GENERIC, valid=None):
        gate, up = self.gate_up_proj(x, forms)
        return self.down_proj(silu_mul(gate, up), forms)


def silu_mul(gate, up):
    """silu(gate) * up in the dtype of `gate`, each of the two results rounded once to that dtype, as transformers
    computes them (in float32 inside each kernel).

    For a 16-bit dtype the silu runs in float32 and `lax.reduce_precision` rounds it, and the product, to the dtype:
    XLA removes no reduce_precision, while it may keep float32 values where a program converts to bfloat16 and back
    inside one fusion (`xla_allow_excess_precision`), so that a result would depend on how XLA fuses the step, and so
    on the batch. `jax.nn.silu` on a bfloat16 input is instead five operations each rounded to bfloat16: 16
    conversions in the fused kernel, which made the MLP's silu the forward's costliest elementwise fusion
    (docs/design.md, "The MLP's silu in bfloat16")."""
    if gate.dtype == jnp.float32:
        return jax.nn.silu(gate) * up
    info = jnp.finfo(gate.dtype)

    def rounded(a):
        return jax.lax.reduce_precision(a, exponent_bits=info.nexp, mantissa_bits=info.nmant)

    s = rounded(jax.nn.silu(gate.astype(jnp.float32)))
    return rounded(s * up.astype(jnp.float32)).astype(gate.dtype)


def rms_norm(x, eps):
    xf = x.astype(jnp.float32)
    return xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """Zero-centred RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), in float32."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        return (rms_norm(x, self.eps) * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """GDN output norm (not zero-centred): w * rmsnorm(o) * silu(z), per value head."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, o, z):
        h = self.weight[...] * rms_norm(o, self.eps).astype(o.dtype)
        return (h.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(o.dtype)
