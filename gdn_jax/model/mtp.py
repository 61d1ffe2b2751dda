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
