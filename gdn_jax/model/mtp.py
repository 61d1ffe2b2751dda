"""Multi-token prediction (Qwen3.5's and Qwen3-Next's MTP block): drafts the token after next from the model's last
hidden state at a position and the embedding of the token that follows it.

At position p, the block's input is fc([pre_fc_norm_embedding(embed(token p + 1)), pre_fc_norm_hidden(h_p)]), h_p
the main model's output there after its final norm; then its decoder layers (full attention, over the block's own keys
and values of the positions before, and an MLP or MoE block as the model's), its own final norm, and the main model's
LM head: the distribution of token p + 2. Its output at p stands in for h_p + 1 when it drafts further. The embedding
and the LM head are the main model's (`Qwen35Model.mtp`)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from gdn_jax.config import FULL, ModelConfig
from gdn_jax.model.forms import GENERIC, Forms
from gdn_jax.model.layers import RMSNorm, _linear


def mtp_layer_config(cfg: ModelConfig) -> ModelConfig:
    """The config a `DecoderLayer` of the MTP block is built from (as layer 0): full attention, and an MoE block
    where the model has experts."""
    return dataclasses.replace(cfg, layer_types=(FULL,), mlp_only_layers=(), decoder_sparse_step=1,
                               mtp_num_hidden_layers=0)


class MultiTokenPredictor(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs, std, layers: list):
        """`layers`: its decoder layers, built by the caller from `mtp_layer_config(cfg)`."""
        D = cfg.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.pre_fc_norm_hidden = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.fc = _linear(rngs, 2 * D, D, dtype, std)  # [embedding | hidden] -> D
        self.layers = nnx.List(layers)
        self.norm = RMSNorm(D, cfg.rms_norm_eps, dtype)

    def inputs(self, embedded, hidden, forms: Forms = GENERIC):
        """The first layer's input [..., D] from the next tokens' embeddings and the hidden states [..., D]."""
        both = jnp.concatenate([self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], axis=-1)
        return self.fc(both, forms)


def _layers(model, n: int, x, batch, state, forms: Forms, by_position: bool):
    """The block's first n decoder layers over every position of x [B, T, D]: (x, state with their keys and values
    written, in the KV pools' layers after the model's own)."""
    valid = jnp.arange(x.shape[1])[None, :] < batch.lengths[:, None]
    first = len(model.cfg.full_layer_ids)
    for m, layer in enumerate(model.mtp.layers[:n]):
        attn = layer.self_attn
        q, gate, k, v = attn.project_write(layer.input_layernorm(x), state.k, state.v, batch, first + m, forms)
        h = attn.attend(q, gate, k, v, first + m, batch.positions, batch.block_tables, batch.start_pos + batch.lengths,
                        forms, by_position)
        x = layer.residual(x, h, forms, valid)
        state = dataclasses.replace(state, k=k, v=v)
    return x, state


def mtp_forward(model, hidden, next_tokens, batch, state, forms: Forms = GENERIC, logits: bool = True,
                by_position: bool = False):
    """The MTP block over a step's rows, on the paged KV pools: `hidden` [B, T, D] the model's normed outputs at the
    batch's positions (`Qwen35Model.__call__(..., hidden=True)`), `next_tokens` [B, T] the token after each. Its
    keys and values are written at those positions, in the KV pools' layers after the model's own, and its queries
    attend to those of the positions before, as the main model's attention does. Returns (logits [B, T, V] of the
    tokens after those (None unless `logits`), its normed outputs [B, T, D], which stand in for the hidden states when
    it drafts on, state). `by_position`: the attention per position (`Attention.attend_heads`).
    """
    x = model.mtp.inputs(model.embed_tokens[...][next_tokens], hidden, forms)
    x, state = _layers(model, len(model.mtp.layers), x, batch, state, forms, by_position)
    out = model.mtp.norm(x)
    return model.head(out, forms) if logits else None, out, state


def mtp_draft(model, hidden, token, batch, state, k: int, forms: Forms = GENERIC):
    """k greedy drafts per row: from the model's normed output `hidden` [B, D] at each row's last position
    (batch.start_pos, one token per row: `token` [B], the token sampled after it), the block drafts the token after
    that, then from its own output and that draft the next, k times (its keys and values written at the positions
    start .. start + k - 1, which the row's block table must hold). Returns (drafts [B, k] int32, state)."""
    bs = state.k.shape[3]
    drafts = []
    for i in range(k):
        pos = batch.start_pos + i
        step = dataclasses.replace(
            batch, tokens=token[:, None], start_pos=pos,
            slot_mapping=(jnp.take_along_axis(batch.block_tables, (pos // bs)[:, None], axis=1) * bs
                          + (pos % bs)[:, None]))
        logits, out, state = mtp_forward(model, hidden[:, None], token[:, None], step, state, forms)
        token = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
        hidden = out[:, 0]
        drafts.append(token)
    return jnp.stack(drafts, axis=1), state


def mtp_at_last(model, hidden, next_tokens, last, batch, state, forms: Forms = GENERIC, by_position: bool = False):
    """`mtp_forward`'s normed output at position `last` [B] of each row only, [B, D], and the state: its keys and
    values are written at every position, but its last layer's attention and MLP run at `last` alone (as the main
    model's `last_layer_tail` does), the position the drafts start from."""
    m = len(model.mtp.layers) - 1  # the layers before the last (a block of one layer, as released, has none)
    x = model.mtp.inputs(model.embed_tokens[...][next_tokens], hidden, forms)
    x, state = _layers(model, m, x, batch, state, forms, by_position)
    final, first = model.mtp.layers[m], len(model.cfg.full_layer_ids)
    attn = final.self_attn
    q, gate, k, v = attn.project_write(final.input_layernorm(x), state.k, state.v, batch, first + m, forms)

    def at(a):  # [B, T, ...] -> [B, 1, ...] at `last`
        return jnp.take_along_axis(a, last.reshape((-1, 1) + (1,) * (a.ndim - 2)), axis=1)

    position = batch.start_pos[:, None] + last[:, None]
    h = attn.attend(at(q), at(gate), k, v, first + m, position, batch.block_tables, position[:, 0] + 1, forms)
    x = final.residual(at(x), h, forms, (batch.lengths > 0)[:, None])
    return model.mtp.norm(x[:, 0]), dataclasses.replace(state, k=k, v=v)


def mtp_propose(model, hidden, next_tokens, last, batch, state, k: int, forms: Forms = GENERIC,
                by_position: bool = False):
    """A step's drafting: the block over every position of the step's rows (`mtp_at_last`: its keys and values there,
    `next_tokens` [B, T] the token after each), then k greedy drafts per row from position `last` [B] of the row (the
    last one computed and kept): the first from the block's output there, the others chained (`mtp_draft`) at the
    positions after it. Returns (drafts [B, k] int32, state)."""
    at, state = mtp_at_last(model, hidden, next_tokens, last, batch, state, forms, by_position)  # [B, D]
    first = jnp.argmax(model.head(at, forms), axis=-1).astype(jnp.int32)
    if k == 1:
        return first[:, None], state
    # one token per row from the position after `last` (padding rows stay empty: length 0)
    chain = dataclasses.replace(batch, start_pos=batch.start_pos + last + 1, lengths=jnp.minimum(batch.lengths, 1))
    rest, state = mtp_draft(model, at, first, chain, state, k - 1, forms)
    return jnp.concatenate([first[:, None], rest], axis=1), state
