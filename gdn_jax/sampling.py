"""On-device sampling: greedy, temperature, top-k, top-p with per-row keys, plus logprobs."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from scheduler.sampling_params import MAX_LOGPROBS


def sample(logits, temperature, top_k, top_p, keys):
    """logits: [B, V] float32; temperature/top_p: [B] float32; top_k: [B] int32 (0 = off); keys: [B, 2] uint32.

    Returns (tokens [B], chosen_logprob [B], top_ids [B, MAX_LOGPROBS], top_logprobs [B, MAX_LOGPROBS]); logprobs
    are those of the model's raw distribution (vLLM's convention)."""
    V = logits.shape[-1]
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1)

    def draw(_):
        scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
        desc = -jnp.sort(-scaled, axis=-1)                                    # [B, V] largest first
        k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
        kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)           # [B, 1]
        desc = jnp.where(desc >= kth, desc, -jnp.inf)
        cum = jnp.cumsum(jax.nn.softmax(desc, axis=-1), axis=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        cut = jnp.minimum(jnp.sum(cum < top_p[:, None], axis=-1), V - 1)
        pth = jnp.take_along_axis(desc, cut[:, None], axis=-1)
        masked = jnp.where((scaled >= kth) & (scaled >= pth), scaled, -jnp.inf)
        return jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)

    # the vocabulary sort only runs when some row samples
    drawn = jax.lax.cond(jnp.any(temperature > 0), draw, lambda _: greedy.astype(jnp.int32), None)
    tokens = jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(logprobs, min(MAX_LOGPROBS, V))
    return tokens, chosen, top_ids.astype(jnp.int32), top_lp
