"""The sparse MoE block of Qwen3.5-MoE and Qwen3-Next: a router picks each token's top-k experts, each a SwiGLU; a
shared expert behind a sigmoid gate is added (transformers' `Qwen3_5MoeSparseMoeBlock`, `Qwen3NextSparseMoeBlock`).

Dropless, with no capacity: the (token, expert) pairs are sorted by expert and each expert multiplies its own rows,
tile by tile (`tiled`, a grouped product), so the experts' part of a token's result depends on its own row only,
never on the other rows of the step, as "cache on == cache off" and "alone == in a batch" need. The shapes depend on the step's shape only,
never on the routing: a new routing compiles nothing. Padding tokens route to no expert.

With an "ep" mesh axis the experts are split over it, each device holding num_experts / ep of them: each device
multiplies the rows routed to its experts (the tokens are replicated there already: the hidden state between the
layers is), and one all-reduce sums the devices' parts, as the row-parallel projections' does. That needs no
all-to-all, whose buffers need a capacity or shapes that follow the routing (`docs/design.md`, "Experts on a mesh").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from gdn_jax.config import ModelConfig
from gdn_jax.model.dense import LayerKernel
from gdn_jax.model.forms import GENERIC, Forms
from gdn_jax.model.layers import MLP, _linear, silu_mul, split_parts
from gdn_jax.model.state import from_pool, pool_dtype, to_pool


class ExpertKernel(nnx.Module):
    """Every expert's matrix of one projection, [experts, n_in, n_out] (the product's layout: rows times it), a
    16-bit float kept as its bit patterns (`state.pool_dtype`): XLA's CPU backend converts a whole bfloat16 array to
    float32 to slice one expert's matrix out of it, or copies it whole into the loop of `tiled`, on every call: for
    hundreds of experts, far more than the products cost. Sliced as integers, only the tile's matrix is read."""

    def __init__(self, experts: int, n_in: int, n_out: int, dtype, std: float, rngs: nnx.Rngs):
        w = nnx.initializers.normal(std)(rngs.params(), (experts, n_in, n_out), dtype)
        self.kernel = nnx.Param(to_pool(w, jnp.zeros((), pool_dtype(dtype))))


TILE_ROWS = 16  # rows of one product of the grouped product: the same for every step shape (see `tiled`)


def tiled(rows, kernel, sizes):
    """rows [M, n_in] sorted by expert, `sizes` [experts] of them per expert (rows past their sum: zeros out), `kernel`
    an `ExpertKernel`'s (bit patterns for a 16-bit `rows` dtype) ->
    [M, n_out] float32, each row times its expert's matrix: the rows cut into tiles of `TILE_ROWS` rows of one
    expert each, a product per tile with its expert's matrix, read where it lies (a loop over the tiles).

    A row's result is then the same [TILE_ROWS, n_in] x [n_in, n_out] product whatever the step's shape, so a token's
    output does not depend on its batch (`jax.lax.ragged_dot` on XLA's CPU backend is one product of every row with
    every expert, masked, whose rounding follows the number of rows). The tiles: every expert's rows rounded up to
    whole tiles, at most M / TILE_ROWS + min(experts, M) of them; those past the routed rows compute on zeros."""
    M, E, t = rows.shape[0], kernel.shape[0], TILE_ROWS
    T = -(-M // t) + min(E, M)
    tiles = (sizes + t - 1) // t
    tile_end = jnp.cumsum(tiles)
    first = jnp.cumsum(sizes) - sizes  # each expert's first row
    j = jnp.arange(T)
    expert = jnp.minimum(jnp.searchsorted(tile_end, j, side="right"), E - 1)
    index = (first[expert] + (j - tile_end[expert] + tiles[expert]) * t)[:, None] + jnp.arange(t)[None, :]
    ok = (j < tile_end[-1])[:, None] & (index < (first + sizes)[expert][:, None])
    x = jnp.where(ok[..., None], rows[jnp.clip(index, 0, M - 1)], 0)  # [T, t, n_in]
    y = jax.lax.map(lambda a: jnp.dot(a[0], from_pool(kernel[a[1]], rows.dtype), preferred_element_type=jnp.float32),
                    (x, expert))  # (a 16-bit kernel is sliced as its bit patterns: `ExpertKernel`)
    out = jnp.zeros((M + 1, kernel.shape[2]), jnp.float32)
    return out.at[jnp.where(ok, index, M)].set(y)[:M]


@functools.partial(jax.jit, static_argnames=("mesh",))
def grouped(rows, kernel, sizes, mesh=None):
    """`tiled`; with `mesh`, the experts' axis of `kernel` is split over "ep": each device multiplies the rows of
    its own experts (the others' rows are zero there) and an all-reduce sums the devices' parts."""
    if mesh is None or mesh.shape.get("ep", 1) == 1:
        return tiled(rows, kernel, sizes)
    P = jax.sharding.PartitionSpec

    def local(rows, kernel, sizes):
        e = kernel.shape[0]  # this device's experts: [i * e, (i + 1) * e)
        i = jax.lax.axis_index("ep")
        before = jnp.sum(jnp.where(jnp.arange(sizes.shape[0]) < i * e, sizes, 0))
        mine = jax.lax.dynamic_slice(sizes, (i * e,), (e,))
        # this device's rows first: a rotation by the rows of the experts before them
        out = tiled(jnp.roll(rows, -before, axis=0), kernel, mine)
        return jax.lax.psum(jnp.roll(out, before, axis=0), "ep")

    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P("ep"), P()), out_specs=P(), check_vma=False,
                         axis_names={"ep"})(rows, kernel, sizes)


def ordered_sum(x, axis: int = -1):
    """The sum over `axis`, kept, added left to right: a reduction's order on XLA's CPU backend follows the array's
    shape (how it is vectorised), so a row's sum would depend on how many rows its step has."""
    parts = jnp.moveaxis(x, axis, 0)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return jnp.expand_dims(total, axis) if axis == -1 else total


def _apply(kernel, fn, *args):
    """fn(the layer's matrix, *args): through the layer loop's switch for a `LayerKernel`, else directly."""
    return kernel.select(fn, *args) if isinstance(kernel, LayerKernel) else fn(kernel, *args)


class SparseMoeBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs, std, mesh=None):
        E, D, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.cfg, self.dtype, self.mesh = cfg, dtype, mesh
        shared = cfg.shared_expert_intermediate_size
        # the router, with the shared expert's gate as one more row: a one-column product's rounding would follow
        # the number of rows (XLA's matrix-vector form), and a token's output would depend on its batch
        self.gate = _linear(rngs, D, E + bool(shared), dtype, std,
                            (("gate", E),) + ((("shared_expert_gate", 1),) if shared else ()))
        self.experts_gate_up = ExpertKernel(E, D, 2 * I, dtype, std, rngs)  # [gate | up] per expert
        self.experts_down = ExpertKernel(E, I, D, dtype, std, rngs)
        if shared:
            self.shared_expert = MLP(cfg, dtype, rngs, std, shared)

    def route(self, x, forms: Forms = GENERIC):
        """x [N, D] -> (experts [N, k] int32, weights [N, k] in x's dtype, the shared expert's gate logit [N, 1] or
        None): the softmax in float32 over the router's logits, its top k, renormalised to sum to one
        (`norm_topk_prob`)."""
        logits, *shared_gate = self.gate(x, forms)
        logits, k = logits.astype(jnp.float32), self.cfg.num_experts_per_tok
        if self.cfg.norm_topk_prob:  # the softmax's denominator cancels: a softmax over the top k's logits
            top, experts = jax.lax.top_k(logits, k)
            weights = jnp.exp(top - top[:, :1])
            weights = weights / ordered_sum(weights)
        else:
            probs = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
            weights, experts = jax.lax.top_k(probs, k)
            weights = weights / ordered_sum(probs)
        return experts.astype(jnp.int32), weights.astype(x.dtype), (shared_gate or [None])[0]

    def __call__(self, x, forms: Forms = GENERIC, valid=None):
        """x [..., D] -> [..., D]; `valid` [...] (default: every token) False for padding tokens, which route
        nowhere (their routed part is zero)."""
        cfg, shape = self.cfg, x.shape
        E, k, D = cfg.num_experts, cfg.num_experts_per_tok, shape[-1]
        xs = x.reshape(-1, D)
        experts, weights, shared_gate = self.route(xs, forms)
        flat = experts.reshape(-1)
        if valid is not None:
            flat = jnp.where(jnp.repeat(valid.reshape(-1), k), flat, E)  # padding: after every expert's rows
        order = jnp.argsort(flat, stable=True)
        sizes = jnp.bincount(flat, length=E + 1)[:E].astype(jnp.int32)
        rows = xs[order // k]  # the (token, slot) pairs' rows, by expert
        h = _apply(self.experts_gate_up.kernel[...], functools.partial(_grouped_in, mesh=self.mesh), rows, sizes)
        gate, up = split_parts(h.astype(x.dtype), [cfg.moe_intermediate_size] * 2)  # (experts: never split by tp)
        y = _apply(self.experts_down.kernel[...], functools.partial(_grouped_in, mesh=self.mesh),
                   silu_mul(gate, up), sizes).astype(x.dtype)
        y = y[jnp.argsort(order)].reshape(-1, k, D)  # back to (token, slot)
        out = ordered_sum(y * weights[..., None], axis=1)  # each token's k parts, in its own slot order
        if cfg.shared_expert_intermediate_size:
            out = out + jax.nn.sigmoid(shared_gate) * self.shared_expert(xs, forms)
        return out.reshape(shape)


def _grouped_in(kernel, rows, sizes, mesh=None):
    """`grouped` with the matrix first (as `LayerKernel.select` passes it)."""
    return grouped(rows, kernel, sizes, mesh=mesh)
