"""Qwen3.5 hybrid model (Gated DeltaNet + gated full attention) as Flax NNX modules.

The modules hold parameters only. The recurrent and KV state lives outside them in `DeviceState`, so a jitted
step can take it as a donated argument: `forward(graphdef, params, batch, state) -> (logits, state)` (why donation
holds: `model/state.py`).

Batch layout: `B` rows (sequences), `T` tokens per row (a prefill chunk, or 1 for decode), rows right-padded.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from gdn_jax.backends.cpu import kernels as cpu_kernels
from gdn_jax.config import FULL, LINEAR, ModelConfig
from gdn_jax.model.gated_delta import (causal_conv1d, chunk_gated_delta_rule, decode_token, default_chunk_size, l2norm,
                                       new_state, recurrent_gated_delta_rule)
from gdn_jax.model.state import Batch, DeviceState, from_pool, layer_ids, read_slots, write_rows
from gdn_jax.model.dense import LayerKernel, _identity, dense
from gdn_jax.model.forms import GENERIC, Forms
from gdn_jax.model.layers import MLP, GatedRMSNorm, RMSNorm, _fused, _linear, split_parts
from gdn_jax.model.attention import Attention, rows_per_iteration
from gdn_jax.model.moe import SparseMoeBlock
from gdn_jax.model.mtp import MultiTokenPredictor, mtp_layer_config
from gdn_jax.model import deterministic


class GatedDeltaNet(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs, std):
        self.cfg = cfg
        nv, K = cfg.linear_num_value_heads, cfg.linear_conv_kernel_dim
        self.in_proj = _fused(rngs, cfg, "linear_attn", "in_proj", dtype, std)  # [qkv | z | b | a]
        self.conv1d = nnx.Param(jax.random.normal(rngs.params(), (cfg.conv_dim, K), dtype) * 0.3)  # [C, K]
        self.dt_bias = nnx.Param(jnp.ones((nv,), jnp.float32))
        # Mild decay by default (exp(A_log) in [0.01, 0.3]) so the state carries information over many tokens.
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (nv,), jnp.float32, 0.01, 0.3)))
        self.norm = GatedRMSNorm(cfg.linear_value_head_dim, cfg.rms_norm_eps, dtype)
        self.out_proj = _linear(rngs, cfg.linear_value_dim, cfg.hidden_size, dtype, std)

    def __call__(self, x, conv_state, ssm_state, lengths, chunk_size: int | None = None, rule=None, saves=None,
                 schedule: str = "auto", forms: Forms = GENERIC):
        """x: [B, T, D]; conv_state: [B, K-1, C]; ssm_state: [B, Hv, dk, dv] -> (out, conv_state, ssm_state).
        `chunk_size` of the chunked rule (same maths; None: `gated_delta.default_chunk_size`). `rule`, if given,
        replaces the gated delta rule and the ssm_state argument: (q, k, v, g, beta) -> (o, new ssm state); the engine's
        decode and verify steps pass one that advances the states inside their pool. `saves` = (rows, offsets), [S]
        each, offsets multiples of `chunk_size`: also returns the states after those tokens of those rows, (conv [S,
        K-1, C], ssm [S, Hv, dk, dv]), from the chunked scan's chunk-boundary states (or copied out by the CPU kernel as
        it passes them); with a `rule`, the conv states only (ssm None: the rule writes its own). `schedule`: the
        chunked rule's (`chunk_gated_delta_rule`'s impl, "fused" or "parallel"; same maths), or "auto": "fused" with the
        CPU forms, else "parallel", and a step of more than one token per row runs the compiled kernel instead where the
        forms have the kernels (`cpu_kernels.gdn_prefill`, which has no gradient: training's forms have no kernels)."""
        mixed, z, b, a = self.in_proj(x, forms)
        o, *states = self.mix(mixed, z, b, a, conv_state, ssm_state, lengths, chunk_size, rule, saves, schedule, forms)
        return (self.out_proj(o, forms), *states)

    def mix(self, mixed, z, b, a, conv_state, ssm_state, lengths, chunk_size: int | None = None, rule=None, saves=None,
            schedule: str = "auto", forms: Forms = GENERIC):
        """`__call__` between the input and the output projections: from the input projection's parts (mixed
        [B, T, C], z [B, T, Hv * dv], b, a [B, T, Hv]) to the gated norm's output [B, T, Hv * dv], with the states
        (and the saved ones) as `__call__` returns them."""
        cfg = self.cfg
        chunk_size = chunk_size or default_chunk_size(forms.cpu)
        impl = schedule if schedule != "auto" else "fused" if forms.cpu else "parallel"
        B, T, _ = mixed.shape
        nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        saved_conv = None
        if saves is not None:  # the K-1 conv inputs before each boundary, as causal_conv1d keeps them
            rows, offsets = saves
            xx = jnp.concatenate([conv_state.astype(mixed.dtype), mixed], axis=1)  # [B, K-1+T, C]
            idx = offsets[:, None] + jnp.arange(conv_state.shape[1], dtype=jnp.int32)[None, :]
            saved_conv = xx[rows[:, None], idx].astype(conv_state.dtype)       # [S, K-1, C]
        qkv, conv_state = causal_conv1d(mixed, self.conv1d[...], conv_state, lengths)  # [B, T, C]
        q, k, v = split_parts(qkv, [cfg.linear_key_dim, cfg.linear_key_dim, cfg.linear_value_dim], cfg.layout_shards)
        q = l2norm(q.reshape(B, T, nk, dk).astype(jnp.float32)) * dk**-0.5
        k = l2norm(k.reshape(B, T, nk, dk).astype(jnp.float32))
        v = v.reshape(B, T, nv, dv)
        beta = jax.nn.sigmoid(b.astype(jnp.float32))  # [B, T, Hv]
        g = -jnp.exp(self.A_log[...]) * jax.nn.softplus(a.astype(jnp.float32) + self.dt_bias[...])
        if rule is not None:  # the caller's (a decode or verify step: the states advance in their pool)
            q, k = jnp.repeat(q, nv // nk, axis=2), jnp.repeat(k, nv // nk, axis=2)
            o, ssm_state = rule(q, k, v, g, beta)  # o: [B, T, Hv, dv]
            saved = (saved_conv, None)  # (the rule wrote the saved states)
        elif T > 1 and schedule == "auto" and cpu_kernels.prefill_applies(k, v, forms):
            # the CPU kernel: token by token, each state in the core's cache, the key heads read where they lie
            # (cpu_kernels.gdn_prefill)
            o, ssm_state, *saved_ssm = cpu_kernels.gdn_prefill(q, k, v, g, beta, ssm_state, lengths, saves)
            saved = (saved_conv, *saved_ssm)  # (used only with saves)
        else:
            # value head h reads key head h // (nv / nk)
            q, k = jnp.repeat(q, nv // nk, axis=2), jnp.repeat(k, nv // nk, axis=2)
            if saves is not None:
                rows, offsets = saves
                o, ssm_state, saved_ssm = chunk_gated_delta_rule(
                    q, k, v, g, beta, initial_state=ssm_state, lengths=lengths, chunk_size=chunk_size,
                    save_chunks=(rows, jnp.maximum(offsets // chunk_size - 1, 0)), impl=impl,
                    saves_in_place=forms.cpu)  # [S, Hv, dk, dv]
                saved = (saved_conv, saved_ssm)
            else:
                kw = {} if T == 1 else {"chunk_size": chunk_size, "impl": impl}
                rule = partial(recurrent_gated_delta_rule if T == 1 else chunk_gated_delta_rule,
                               initial_state=ssm_state, lengths=lengths, **kw)
                o, ssm_state = rule(q, k, v, g, beta)  # o: [B, T, Hv, dv]
        o = self.norm(o.astype(mixed.dtype), z.reshape(B, T, nv, dv)).reshape(B, T, nv * dv)
        return (o, conv_state, ssm_state) if saves is None else (o, conv_state, ssm_state, saved)


def advance_in_pool(pool, src, live, warm, lengths, q, k, v, g, beta, *, layer, forms: Forms):
    """One decode token of the gated delta rule for every row, on the states of GDN layer `layer` kept in their
    stacked pool [layers, num_slots, Hv, dk, dv]: a few rows at a time
    (`rows_per_iteration`), each reads its initial state from slot `src` (zeros where not `warm`) and writes the
    new one to its live slot in place. Returns (o [B, 1, Hv, dv], pool).

    Why a few rows at a time: XLA schedules every layer's state gather at the start of the step, so the batch's
    states of all GDN layers are live at once (a state per row and layer: 256 KiB at hidden 1024, 2 MiB at
    Qwen3.5-9B's shapes): tens of MB of temporaries, which a few rows at a time shrink several times. Rows are
    independent, and no row reads a slot another row writes (in a one-token step a restore source is never a live
    slot: `validate_cache_ops`), so the order does not matter.

    One row at a time (a state of 2 MiB or more, as in Qwen3.5-9B, or a batch of one) reads its state with a dynamic
    slice rather than `read_slots`' gather, which reads a padding slot besides (twice the state). The rule's output
    comes from its product with the state it read (`gated_delta.decode_token`), never from the new state, so
    nothing reads the pool after the write: XLA keeps the update in place.

    With the CPU forms each row's new state is written by a dynamic update slice of its own that computes it
    (e S + k delta^T, from the state read and the token's gate and delta): XLA fuses that arithmetic into the write.
    (Elsewhere one scatter writes them all: a loop over the rows would cost a device round trip per row.) A scatter of
    the iteration's new states needed them materialised first, and XLA gave `where(warm, ...)` a pass of its own: 9
    passes over the states' bytes against 5 now (docs/benchmarks.md).

    Where the forms have the compiled CPU kernels (`cpu_kernels`), the kernel does all of this instead: each state
    read once, written once, the rows' heads shared among the CPU threads (XLA's write above runs on one)."""
    if cpu_kernels.applies(pool, forms):
        return cpu_kernels.gdn_decode(pool, src, live, warm, lengths, q, k, v, g, beta, layer)
    B = q.shape[0]
    chunk = rows_per_iteration(B, math.prod(pool.shape[2:]) * pool.dtype.itemsize, "gdn_decode", forms)

    def rows(i, a):
        return jax.lax.dynamic_slice_in_dim(a, i * chunk, chunk)

    def read(pool, ids):
        if chunk > 1:
            return read_slots(pool, ids, layer)
        return jax.lax.dynamic_slice(pool, (layer, ids[0]) + (0,) * (pool.ndim - 2), (1, 1) + pool.shape[2:])[0]

    def body(i, carry):
        pool, o = carry
        s0 = jnp.where(rows(i, warm)[:, None, None, None], read(pool, rows(i, src)), 0.0)
        oi, e, kf, delta = decode_token(s0, *(rows(i, a) for a in (q, k, v, g, beta)), lengths=rows(i, lengths))
        ids = rows(i, live)
        o = jax.lax.dynamic_update_slice_in_dim(o, oi, i * chunk, 0)
        if not forms.cpu:  # one scatter (a loop over the rows costs a device round trip a turn)
            return write_rows(pool, (layer_ids(layer, ids), ids), new_state(s0, e, kf, delta)), o

        def write(r, pool):  # the row's new state, computed where it is written
            s1 = new_state(s0[r], e[r], kf[r], delta[r])
            return jax.lax.dynamic_update_slice(pool, s1[None, None], (layer, ids[r]) + (0,) * (pool.ndim - 2))

        # With the layer known (layers unrolled) and one row per iteration, XLA would inline a loop of one turn and
        # fuse the next layer's read of the pool with this write, then copy the whole pool around every layer (many
        # times slower); a trip count it cannot fold keeps
        # the loop, as with two rows (live slots are never negative: `n` is `chunk`).
        n = chunk if not isinstance(layer, int) else jnp.where(ids[0] >= 0, chunk, 0)
        return jax.lax.fori_loop(0, n, write, pool), o

    carry = (pool, jnp.zeros(v.shape, v.dtype))
    # off the CPU every row in one turn: no loop (XLA's GPU runtime may read a loop's condition back every turn)
    pool, o = body(0, carry) if B == chunk and not forms.cpu else jax.lax.fori_loop(0, B // chunk, body, carry)
    return o, pool




def advance_positions_in_pool(pool, src, live, warm, lengths, dst, q, k, v, g, beta, *, layer, forms: Forms):
    """A short step's tokens (a verify row's, T = k + 1) of the gated delta rule, one position at a time, on the
    states kept in their pool (`advance_in_pool` per position): position t reads the state position t - 1 wrote
    (t = 0: slot `src`, zeros where not `warm`) and writes its own to `dst[:, t]` [B, T] (a draft slot, the live slot
    at the row's last token); positions past a row's end read and write its live slot, inert. Returns (o [B, T, Hv,
    dv], pool)."""
    outs, before = [], src
    for t in range(q.shape[1]):
        on = t < lengths
        to = jnp.where(on, dst[:, t], live)
        o, pool = advance_in_pool(pool, before, to, warm if t == 0 else jnp.ones_like(warm), on.astype(jnp.int32),
                                  *(a[:, t:t + 1] for a in (q, k, v, g, beta)), layer=layer, forms=forms)
        outs.append(o)
        before = to
    return jnp.concatenate(outs, axis=1), pool


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, i: int, dtype, rngs, std, mesh=None):
        self.layer_type = layer_type = cfg.layer_types[i]
        self.kind = (layer_type, cfg.is_moe_layer(i))  # layers of one kind have the same parameters
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if layer_type == LINEAR:
            self.linear_attn = GatedDeltaNet(cfg, dtype, rngs, std)
        else:
            self.self_attn = Attention(cfg, dtype, rngs, std)
        self.mlp = SparseMoeBlock(cfg, dtype, rngs, std, mesh) if self.kind[1] else MLP(cfg, dtype, rngs, std)

    def residual(self, x, h, forms: Forms = GENERIC, valid=None):
        """The layer's output from its input x and its mixer's (GDN or attention) output h: both residual adds
        around the MLP. `valid` (x's shape less its last axis): False at padding tokens, which an MoE block routes
        to no expert."""
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x), forms, valid)


def layer_groups(layer_types) -> tuple[tuple[tuple[str, int], ...], int]:
    """The layer list as `repeats` copies of one group, the group as runs of consecutive layers of one kind:
    Qwen3.5's 3 GDN + 1 full attention, repeated -> (((LINEAR, 3), (FULL, 1)), layers / 4). The group is the
    shortest one that repeats to the whole list; a list with none (say G G A G) is a single group of its runs."""
    types, n = tuple(layer_types), len(layer_types)
    p = next(p for p in range(1, n + 1) if n % p == 0 and types[:p] * (n // p) == types)
    return tuple((kind, len(list(run))) for kind, run in itertools.groupby(types[:p])), n // p


def _repeat(n: int, body, carry, unroll: bool = False):
    """carry = body(i, carry) for i in range(n): a loop (its body compiled once), a plain call when n == 1; unrolled
    (every layer traced with its index known) when `unroll`."""
    if unroll:
        for i in range(n):
            carry = body(i, carry)
        return carry
    return body(0, carry) if n == 1 else jax.lax.fori_loop(0, n, body, carry)


class Qwen35Model(nnx.Module):
    """Qwen3_5ForCausalLM: embeddings, hybrid decoder layers, final norm, lm_head (tied or not)."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs, std: float = 0.02, mesh=None):
        """`mesh`: with an "ep" axis, the MoE blocks' experts are split over it (`moe.grouped`)."""
        self.cfg = cfg
        self.embed_tokens = nnx.Param(jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size), dtype) * std)
        mesh = mesh if mesh is not None and mesh.shape.get("ep", 1) > 1 else None
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype, rngs, std, mesh) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = _linear(rngs, cfg.hidden_size, cfg.vocab_size, dtype, std)
        if cfg.mtp_num_hidden_layers:  # the drafting block (`model.mtp`), outside the layer loop
            layer_cfg = mtp_layer_config(cfg)
            self.mtp = MultiTokenPredictor(cfg, dtype, rngs, std, [
                DecoderLayer(layer_cfg, 0, dtype, rngs, std, mesh) for _ in range(cfg.mtp_num_hidden_layers)])

    def scan_layers(self, carry, linear, full, unroll: bool = False):
        """Runs the decoder layers in order on `carry`: `linear(layer, j, carry) -> carry` for the j-th GDN layer,
        `full(layer, j, carry)` for the j-th full-attention layer, where `layer` is a `DecoderLayer` with that
        layer's parameters and j (an int32 scalar, or an int) indexes its type's stacked pools (`DeviceState`). The
        loops run over layers of one kind, (type, MoE or not): a dense layer among MoE ones has other parameters.

        The layers run under loops, one over the repeats of the layer group (`layer_groups`) and inside it one per
        run of same-kind layers, so a step compiles one GDN and one full-attention layer whatever the depth
        (Qwen3.5-9B's 32 layers compile as 2). In the loop body `layer` holds, for each projection matrix, a
        `LayerKernel` (every layer's matrix, each in its own buffer; `dense` multiplies by the loop's layer's), and
        the loop's layer's small parameters (norms, conv taps, gates), picked together by one switch. With `unroll`
        (`Forms.unrolled`) every layer is traced in turn with its index known: no loop and no switch. For comparisons:
        XLA's GPU runtime reads each conditional's branch index back to the host, and unrolled layers have none, but
        compile in about twice the time (docs/design.md, "On a GPU")."""
        layer_kinds = [layer.kind for layer in self.layers]  # (type, MoE): Qwen3-Next mixes dense and MoE layers
        runs, repeats = layer_groups(layer_kinds)
        fns = {LINEAR: linear, FULL: full}
        kinds = {}  # kind -> (graphdef, treedef of its state, per leaf: the tuple of every layer's array)
        for kind in dict.fromkeys(layer_kinds):
            layers = [layer for layer in self.layers if layer.kind == kind]
            if layers:
                paths, treedef = jax.tree_util.tree_flatten_with_path(nnx.state(layers[0]))
                leaves = zip(*(jax.tree.leaves(nnx.state(layer)) for layer in layers))
                kinds[kind] = (nnx.graphdef(layers[0]), treedef,
                               [(jax.tree_util.DictKey("kernel") in path, arrays)
                                for (path, _), arrays in zip(paths, leaves)])

        def layer_at(kind, j):
            graphdef, treedef, leaves = kinds[kind]
            small = [arrays for is_kernel, arrays in leaves if not is_kernel]
            per_layer = list(zip(*small))  # per layer, the tuple of its small parameters
            picked = iter(per_layer[j] if isinstance(j, int) else
                          jax.lax.switch(j, [partial(_identity, arrays) for arrays in per_layer]))
            return nnx.merge(graphdef, jax.tree_util.tree_unflatten(
                treedef, [LayerKernel(arrays, j) if is_kernel else next(picked) for is_kernel, arrays in leaves]))

        def group(g, carry):
            seen, seen_type = dict.fromkeys(kinds, 0), dict.fromkeys(fns, 0)
            for kind, n in runs:
                t = kind[0]
                base = g * sum(m for k, m in runs if k == kind) + seen[kind]  # the layer among its kind's
                pool = g * sum(m for k, m in runs if k[0] == t) + seen_type[t]  # among its type's (its pools)
                seen[kind] += n
                seen_type[t] += n
                carry = _repeat(n, lambda i, c, kind=kind, base=base, pool=pool: fns[kind[0]](
                    layer_at(kind, base + i), pool + i, c), carry, unroll)
            return carry

        return _repeat(repeats, group, carry, unroll)

    def __call__(self, batch: Batch, state: DeviceState, all_logits: bool = False, chunk_size: int | None = None,
                 gdn_schedule: str = "auto", forms: Forms = GENERIC, hidden: bool = False, by_position: bool = False):
        """`by_position`: a short step (a verify row's few tokens) on the one-token step's forms, each position in
        turn: the GDN states advance in their pool (`advance_positions_in_pool`; the batch's saves name the slot
        each position but a row's last writes, offset t + 1 for position t), and the attention runs per position
        (`Attention.attend_heads`); the products still take every position at once.
        `hidden`: also returns every position's output after the final norm [B, T, D], what the MTP block drafts
        from (`model.mtp`); the logits are still the last position's unless `all_logits`.
        `gdn_schedule`: the chunked GDN rule's schedule ("auto", "fused", "parallel"; same maths).
        `chunk_size`: the chunked GDN rule's (a divisor of the engine's chunk_stride, so that every checkpoint
        boundary is a chunk boundary of a row's scan; None: `gated_delta.default_chunk_size`). `forms`: the forms
        the step takes (`Forms`; the default: XLA's generic ones; `Forms.deterministic`: `deterministic.forward`)."""
        if hidden and forms.deterministic:
            raise ValueError("hidden states come in the default forms")
        if forms.deterministic:
            return deterministic.forward(self, batch, state, all_logits, forms)
        x = self.embed_tokens[...][batch.tokens]  # [B, T, D]
        warm = batch.has_initial_state
        ids = batch.linear_state_ids
        src = ids if batch.initial_state_ids is None else batch.initial_state_ids

        T = batch.tokens.shape[1]
        last = jnp.maximum(batch.lengths - 1, 0)  # each row's last real token
        valid = jnp.arange(T)[None, :] < batch.lengths[:, None]  # [B, T]: padding routes to no expert

        def at_last(a):  # [B, T, ...] -> [B, ...] at each row's last token
            return jnp.take_along_axis(a, last.reshape((-1,) + (1,) * (a.ndim - 1)), axis=1)[:, 0]

        # A step that samples needs the last layer's output at each row's last token only: there that layer's loop
        # turn computes what every position needs (its keys and values, its GDN state), keeps the rest of its inputs
        # at those tokens (`pending`), and `last_layer_tail` finishes one row each after the loop.
        defer = not all_logits and not hidden and T > 1
        last_kind, last_j = self.cfg.layer_types[-1], self.cfg.layer_types.count(self.cfg.layer_types[-1]) - 1

        def tail(kind, j, whole, at_tokens, x, pending):
            """(x, pending) after a layer: (whole(), pending) for any layer but the last of a deferring step,
            (x, at_tokens()) for that one; by a switch on j where the loop's layer is traced."""
            if not defer or kind != last_kind:
                return whole(), pending
            if isinstance(j, int):
                return (x, at_tokens()) if j == last_j else (whole(), pending)
            return jax.lax.cond(j == last_j, lambda: (x, at_tokens()), lambda: (whole(), pending))

        pending = ()
        if defer:
            B, cfg = batch.tokens.shape[0], self.cfg
            pending = (jnp.zeros((B, cfg.hidden_size), x.dtype),) + (
                (jnp.zeros((B, cfg.hidden_size), x.dtype),) if last_kind == LINEAR else
                (jnp.zeros((B, cfg.num_attention_heads, cfg.head_dim), x.dtype),
                 jnp.zeros((B, cfg.num_attention_heads * cfg.head_dim), x.dtype)))

        dst = None  # with `by_position`: the slot each position's state goes to
        if by_position and T > 1:
            dst = jnp.broadcast_to(ids[:, None], batch.tokens.shape)
            if batch.save_slots is not None:  # (padding saves, into slot 0, are dropped)
                rows = jnp.where(batch.save_slots > 0, batch.save_rows, dst.shape[0])
                dst = dst.at[rows, batch.save_offsets - 1].set(batch.save_slots, mode="drop")

        def linear(layer, j, carry):
            x, st, pending = carry
            h = layer.input_layernorm(x)
            conv_in = jnp.where(warm[:, None, None], from_pool(read_slots(st.conv, src, j), x.dtype), 0)
            slots = ids
            if T == 1:  # decode: the states advance in their pool
                rule = partial(advance_in_pool, st.ssm, src, ids, warm, batch.lengths, layer=j, forms=forms)
                h, conv_out, ssm = layer.linear_attn(h, conv_in, None, batch.lengths, rule=rule, forms=forms)
            elif dst is not None:  # position by position in the pool; the conv states saved as the scan's are
                rule = partial(advance_positions_in_pool, st.ssm, src, ids, warm, batch.lengths, dst, layer=j,
                               forms=forms)
                saves = None if batch.save_slots is None else (batch.save_rows, batch.save_offsets)
                h, conv_out, ssm, *saved = layer.linear_attn(h, conv_in, None, batch.lengths, rule=rule, saves=saves,
                                                             forms=forms)
                if saved:
                    slots = jnp.concatenate([ids, batch.save_slots])
                    conv_out = jnp.concatenate([conv_out, saved[0][0]])
            else:
                ssm_in = jnp.where(warm[:, None, None, None], read_slots(st.ssm, src, j), 0.0)
                if batch.save_slots is None:
                    h, conv_out, ssm_out = layer.linear_attn(h, conv_in, ssm_in, batch.lengths, chunk_size,
                                                             schedule=gdn_schedule, forms=forms)
                else:  # also the checkpoints at the listed boundaries, written with the live slots at once
                    h, conv_out, ssm_out, (conv_sv, ssm_sv) = layer.linear_attn(
                        h, conv_in, ssm_in, batch.lengths, chunk_size, saves=(batch.save_rows, batch.save_offsets),
                        schedule=gdn_schedule, forms=forms)
                    slots = jnp.concatenate([ids, batch.save_slots])
                    conv_out, ssm_out = jnp.concatenate([conv_out, conv_sv]), jnp.concatenate([ssm_out, ssm_sv])
                ssm = write_rows(st.ssm, (layer_ids(j, slots), slots), ssm_out)
            conv = write_rows(st.conv, (layer_ids(j, slots), slots), conv_out)
            x, pending = tail(LINEAR, j, lambda: layer.residual(x, h, forms, valid),
                              lambda: (at_last(x), at_last(h)), x, pending)
            return x, dataclasses.replace(st, conv=conv, ssm=ssm), pending

        def full(layer, j, carry):
            x, st, pending = carry
            q, gate, k, v = layer.self_attn.project_write(layer.input_layernorm(x), st.k, st.v, batch, j, forms)
            x, pending = tail(FULL, j, lambda: layer.residual(x, layer.self_attn.attend(
                q, gate, k, v, j, batch.positions, batch.block_tables, batch.start_pos + batch.lengths, forms,
                by_position), forms, valid),
                              lambda: (at_last(x), at_last(q), at_last(gate)), x, pending)
            return x, dataclasses.replace(st, k=k, v=v), pending

        x, state, pending = self.scan_layers((x, state, pending), linear, full, unroll=forms.unrolled(T))
        if defer:
            x = self.last_layer_tail(pending, state, batch, last, last_j, forms)
        elif hidden:
            normed = self.norm(x)
            return self.head(normed if all_logits else at_last(normed), forms), state, normed
        elif not all_logits:  # hidden state of each row's last real token
            x = at_last(x)
        return self.logits(x, forms), state

    def last_layer_tail(self, pending, state: DeviceState, batch: Batch, last, j: int, forms: Forms):
        """The last layer's output [B, D] at each row's last token `last` [B], from what its loop turn left
        (`pending`: the layer's input there, and the GDN mixer's output or the attention's query and gate there): the
        attention of those queries, the output projection and the MLP, one row each. `j`: the layer's index among
        its kind's layers (its pools')."""
        layer, kind = self.layers[-1], self.cfg.layer_types[-1]
        if kind == LINEAR:
            x, h = pending
        else:
            x, q, gate = pending
            position = batch.start_pos + last
            h = layer.self_attn.attend(q[:, None], gate[:, None], state.k, state.v, j, position[:, None],
                                       batch.block_tables, position + 1, forms)[:, 0]
        return layer.residual(x, h, forms, batch.lengths > 0)

    def logits(self, x, forms: Forms = GENERIC):
        """Final norm and LM head (tied or not): hidden [..., D] -> float32 logits [..., V]."""
        return self.head(self.norm(x), forms)

    def head(self, x, forms: Forms = GENERIC):
        """The LM head alone (tied or not): normed hidden [..., D] -> float32 logits [..., V] (the MTP block's too)."""
        head = self.embed_tokens if self.cfg.tie_word_embeddings else self.lm_head.kernel
        return dense(x, head[...], forms)


def forward(graphdef, params, batch: Batch, state: DeviceState, all_logits: bool = False,
            chunk_size: int | None = None, gdn_schedule: str = "auto", forms: Forms = GENERIC,
            by_position: bool = False):
    """Pure forward: (graphdef, params, batch, state) -> (logits [B, V] or [B, T, V] float32, new state), in the
    forms `forms` says (the default: XLA's generic ones; the engine's: `backends.cpu.tuning.resolve_forms`)."""
    model = nnx.merge(graphdef, params)
    return model(batch, state, all_logits=all_logits, chunk_size=chunk_size, gdn_schedule=gdn_schedule, forms=forms,
                 by_position=by_position)


def init_model(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32):
    """Deterministic random model; returns (graphdef, params). Norm weights are perturbed so that a
    `(1 + w)` vs `w` mistake shows."""
    model = Qwen35Model(cfg, dtype=dtype, rngs=nnx.Rngs(seed), std=0.05)
    key = jax.random.PRNGKey(seed + 1)
    # the main model's norms first: its weights are the same with and without the MTP block
    nodes = sorted(nnx.iter_graph(model), key=lambda node: bool(node[0]) and node[0][0] == "mtp")
    for path, p in nodes:
        if isinstance(p, (RMSNorm, GatedRMSNorm)):
            key, sub = jax.random.split(key)
            base = 1.0 if isinstance(p, GatedRMSNorm) else 0.0
            p.weight[...] = (base + 0.2 * jax.random.normal(sub, p.weight.shape)).astype(dtype)
    return nnx.split(model)
