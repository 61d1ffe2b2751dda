"""On-device sampling: penalties, the min_tokens ban, greedy, temperature, min-p, top-k, top-p with per-request,
per-position keys, plus logprobs of the raw distribution.

`SamplingMetadata` is one registered dataclass pytree holding every per-row sampling input; the worker builds it on
the host from the step plan (`SamplingMetadata.from_rows`) and passes it to its jitted step as a single argument.
Its shapes depend only on the step's shape bucket, so sampling settings never cause a recompilation.
The semantics of each knob are documented on `SamplingParams`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from gdn_jax.model.deterministic import rowwise
from scheduler.sampling_params import GREEDY_BELOW, MAX_LOGPROBS, MAX_STOP_TOKEN_IDS

BAN_WIDTH = MAX_STOP_TOKEN_IDS + 1  # stop_token_ids with the further end-of-sequence ids, + EOS
# top-p compares the mass above a token with top_p * total; float32 cumulative sums are off by a few ulps, so a
# boundary that is exact in real arithmetic is closed (the token is dropped) whichever way the rounding went.
TOP_P_SLACK = 2.0 ** -20
# penalised logits are held within this: divided by a temperature down to GREEDY_BELOW they stay finite
PENALISED_LOGIT_BOUND = 1e30


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling inputs of one step; every field has leading dimension B (the row bucket).

    `history` holds, for rows that use penalties, the row's prompt then output token ids (-1 padding), with
    `prompt_lens` marking where the output starts; its width is the worker's `history_width` (the most blocks a row
    can hold x block size), which bounds every row's length, so it adds no shape of its own and sampling compiles
    once per rows bucket. Rows without penalties leave it at -1.
    `banned` lists the ids the `min_tokens` rule forbids this step (-1 padding).
    """

    temperature: jax.Array         # [B] f32; 0 for greedy rows
    top_k: jax.Array               # [B] i32; 0 = off, otherwise already clamped to the vocabulary
    top_p: jax.Array               # [B] f32; 1 = off
    min_p: jax.Array               # [B] f32; 0 = off
    presence_penalty: jax.Array    # [B] f32
    frequency_penalty: jax.Array   # [B] f32
    repetition_penalty: jax.Array  # [B] f32; 1 = off
    seeds: jax.Array               # [B] u32
    positions: jax.Array           # [B] i32: index of the output token drawn (folded into the key)
    history: jax.Array             # [B, W] i32
    prompt_lens: jax.Array         # [B] i32
    banned: jax.Array              # [B, BAN_WIDTH] i32
    num_logprobs: jax.Array        # [B] i32: the row's `logprobs` (top entries it reports), -1 when it asks for none

    @classmethod
    def padding(cls, rows: int, width: int) -> "SamplingMetadata":
        """Greedy, no filters, no penalties: the values of padded rows (host numpy arrays)."""
        z32, zf = np.zeros(rows, np.int32), np.zeros(rows, np.float32)
        return cls(temperature=zf.copy(), top_k=z32.copy(), top_p=np.ones(rows, np.float32), min_p=zf.copy(),
                   presence_penalty=zf.copy(), frequency_penalty=zf.copy(),
                   repetition_penalty=np.ones(rows, np.float32), seeds=np.zeros(rows, np.uint32),
                   positions=z32.copy(), history=np.full((rows, width), -1, np.int32), prompt_lens=z32.copy(),
                   banned=np.full((rows, BAN_WIDTH), -1, np.int32), num_logprobs=np.full(rows, -1, np.int32))

    @classmethod
    def from_rows(cls, rows, num_rows: int, width: int, vocab_size: int, eos_token_ids: tuple[int, ...],
                  default_seed: int) -> "SamplingMetadata":
        """Host-side build from `ScheduledSequence`s. A request without a seed draws from
        `(default_seed * 1_000_003 + seq_id) mod 2**32`. `eos_token_ids`: the model's end-of-sequence ids, which
        `min_tokens` bans with the row's stop_token_ids, also under `ignore_eos` (vLLM bans every id of its
        `all_stop_token_ids` whatever ignore_eos says).

        Built once per step, so it is kept cheap: each [B] field is one array from a Python list, and the [B, W]
        history and the [B, BAN_WIDTH] bans are, when no row of the step needs them (no penalty, no `min_tokens` ban),
        shared all -1 device arrays (`_unused_rows`) rather than fresh host arrays copied to the device every step."""
        pad = num_rows - len(rows)
        temperature, top_k, top_p, min_p, presence, frequency, repetition, seeds, positions, num_logprobs = (
            [] for _ in range(10))
        history = banned = prompt_lens = None
        for i, r in enumerate(rows):
            sp = r.sampling_params
            temperature.append(0.0 if sp.is_greedy else sp.temperature)
            top_k.append(min(sp.top_k, vocab_size) if sp.top_k > 0 else 0)
            top_p.append(sp.top_p)
            min_p.append(sp.min_p)
            presence.append(sp.presence_penalty)
            frequency.append(sp.frequency_penalty)
            repetition.append(sp.repetition_penalty)
            seeds.append(sp.seed if sp.seed is not None else (default_seed * 1_000_003 + r.seq_id) & 0xFFFFFFFF)
            positions.append(r.num_generated)
            num_logprobs.append(-1 if sp.logprobs is None else sp.logprobs)
            if not r.sample:
                continue
            if r.history is not None:
                if len(r.history) > width:
                    raise ValueError(f"row {i}: {len(r.history)} history tokens exceed the step's width {width}")
                if history is None:
                    history, prompt_lens = np.full((num_rows, width), -1, np.int32), np.zeros(num_rows, np.int32)
                history[i, :len(r.history)] = r.history
                prompt_lens[i] = r.num_prompt_tokens
            if r.num_generated < sp.min_tokens:
                ban = list(dict.fromkeys([*(sp.stop_token_ids or ()), *eos_token_ids]))
                if ban:
                    if banned is None:
                        banned = np.full((num_rows, BAN_WIDTH), -1, np.int32)
                    banned[i, :len(ban)] = ban

        def col(values, fill, dtype):
            return np.array(values + [fill] * pad, dtype)

        unused = _unused_rows(num_rows, width)
        return cls(temperature=col(temperature, 0.0, np.float32), top_k=col(top_k, 0, np.int32),
                   top_p=col(top_p, 1.0, np.float32), min_p=col(min_p, 0.0, np.float32),
                   presence_penalty=col(presence, 0.0, np.float32), frequency_penalty=col(frequency, 0.0, np.float32),
                   repetition_penalty=col(repetition, 1.0, np.float32), seeds=col(seeds, 0, np.uint32),
                   positions=col(positions, 0, np.int32), num_logprobs=col(num_logprobs, -1, np.int32),
                   history=unused[0] if history is None else history,
                   prompt_lens=unused[1] if prompt_lens is None else prompt_lens,
                   banned=unused[2] if banned is None else banned)


@functools.lru_cache(maxsize=64)
def _unused_rows(rows: int, width: int) -> tuple:
    """(history [rows, width] of -1, prompt_lens [rows] of 0, banned [rows, BAN_WIDTH] of -1) as device arrays: the
    values of a step in which no row uses penalties or a ban, made once per rows bucket and passed as they are."""
    return (jnp.full((rows, width), -1, jnp.int32), jnp.zeros(rows, jnp.int32),
            jnp.full((rows, BAN_WIDTH), -1, jnp.int32))


def _keys(seeds, positions):
    # per-request, per-position keys: reproducible whatever the batch composition, and fresh at every position
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.PRNGKey(s), p))(seeds, positions)


def _apply_penalties(logits, md: SamplingMetadata):
    B, V = logits.shape
    valid = md.history >= 0
    ids = jnp.where(valid, md.history, 0)
    is_output = valid & (jnp.arange(md.history.shape[1])[None, :] >= md.prompt_lens[:, None])
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], ids.shape)
    counts = jnp.zeros((B, V), jnp.float32).at[rows, ids].add(is_output.astype(jnp.float32))
    seen = jnp.zeros((B, V), jnp.int32).at[rows, ids].add(valid.astype(jnp.int32)) > 0
    rep = md.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = (logits - md.frequency_penalty[:, None] * counts
              - md.presence_penalty[:, None] * (counts > 0).astype(jnp.float32))
    # an extreme repetition penalty (1e-38 divides a logit of 10 past float32's range) would make inf logits, and
    # inf - inf is NaN in the draw's filters: those tokens tie at the bound instead
    return jnp.clip(logits, -PENALISED_LOGIT_BOUND, PENALISED_LOGIT_BOUND)


def _penalise_and_ban(logits, md: SamplingMetadata):
    B, V = logits.shape
    logits = _apply_penalties(logits, md)
    banned = jnp.where(md.banned >= 0, md.banned, V)  # out of range: dropped by the scatter
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], banned.shape)
    return logits.at[rows, banned].set(-jnp.inf, mode="drop")


def process_logits(logits, md: SamplingMetadata):
    """Penalties, then the min_tokens ban: the logits greedy and sampling both start from. [B, V] float32."""
    logits = logits.astype(jnp.float32)
    active = (jnp.any((md.presence_penalty != 0) | (md.frequency_penalty != 0) | (md.repetition_penalty != 1))
              | jnp.any(md.banned >= 0))
    # the [B, V] counts and the scatters only run when some row of the step uses a penalty or a ban
    return jax.lax.cond(active, _penalise_and_ban, lambda x, _: x, logits, md)


def _sorted_cut(scaled, cut, md: SamplingMetadata):
    """Raises the per-row bar `cut` [B, 1] by top-k and top-p; both need the vocabulary sorted."""
    V = scaled.shape[-1]
    desc = -jnp.sort(-scaled, axis=-1)                                        # [B, V] largest first
    # top-k by value: the k-th largest value is the bar, so every token tied with it stays
    k = jnp.where(md.top_k > 0, jnp.minimum(md.top_k, V), V)
    cut = jnp.maximum(cut, jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1))
    desc = jnp.where(desc >= cut, desc, -jnp.inf)
    # top-p over what survived, renormalised: keep a token while the mass strictly above it is below top_p
    e = jnp.exp(desc - desc[:, :1])
    cum = jnp.cumsum(e, axis=-1)
    above = cum - e
    keep = (above < (md.top_p * (1.0 - TOP_P_SLACK))[:, None] * cum[:, -1:]) | (md.top_p >= 1.0)[:, None]
    # keep is a prefix; the most likely token always stays (a top_p so small that top_p * total underflows to 0
    # keeps nothing above, and the index -1 would take the least likely value as the bar: every token kept)
    last = jnp.maximum(jnp.sum(keep, axis=-1) - 1, 0)
    return jnp.maximum(cut, jnp.take_along_axis(desc, last[:, None], axis=-1))


def _draw(logits, md: SamplingMetadata):
    V = logits.shape[-1]
    temperature = jnp.where(md.temperature >= GREEDY_BELOW, md.temperature, 1.0)
    scaled = logits / temperature[:, None]
    # min-p: p_i >= min_p * p_max  <=>  scaled_i >= scaled_max + log(min_p)  (log 0 = -inf: off)
    cut = jnp.max(scaled, axis=-1, keepdims=True) + jnp.log(md.min_p)[:, None]
    # the vocabulary sort only runs when some row of the step uses top-k or top-p
    sorts = jnp.any((md.top_k > 0) & (md.top_k < V)) | jnp.any(md.top_p < 1.0)
    cut = jax.lax.cond(sorts, _sorted_cut, lambda _, c, __: c, scaled, cut, md)
    masked = jnp.where(scaled >= cut, scaled, -jnp.inf)
    # jax.random.categorical's Gumbel-max draw (same noise, so the same token), with its argmax in the vectorised form
    noise = jax.vmap(lambda key, row: jax.random.gumbel(key, row.shape, row.dtype))(_keys(md.seeds, md.positions),
                                                                                      masked)
    return first_argmax(noise + masked)


def first_argmax(x):
    """argmax over the last axis (the first index of the largest value; a NaN counts as the largest, as in
    `jnp.argmax`) -> int32. Written as two plain reductions (the max, then the least index holding it): XLA's CPU
    backend vectorises those, while `jnp.argmax`'s variadic (value, index) reduction runs one element at a time
    (figures in docs/benchmarks.md)."""
    V = x.shape[-1]
    nan = jnp.isnan(x)
    hit = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, x == jnp.max(x, axis=-1, keepdims=True))
    return jnp.min(jnp.where(hit, jnp.arange(V, dtype=jnp.int32), V), axis=-1)


def _ranked(shifted, lse, chosen):
    """(top ids [B, K] int32, their logprobs [B, K], the chosen tokens' ranks [B]) from the shifted logits and their
    log-sum-exp (`log_softmax_parts`)."""
    logprobs = shifted - lse
    top_lp, top_ids = jax.lax.top_k(logprobs, min(MAX_LOGPROBS, logprobs.shape[-1]))
    rank = 1 + jnp.sum(logprobs > chosen[:, None], axis=-1, dtype=jnp.int32)
    return top_ids.astype(jnp.int32), top_lp, rank


def _unranked(shifted, lse, chosen):
    B, K = shifted.shape[0], min(MAX_LOGPROBS, shifted.shape[-1])
    return jnp.zeros((B, K), jnp.int32), jnp.zeros((B, K), shifted.dtype), jnp.zeros(B, jnp.int32)


def log_softmax_parts(logits):
    """[B, V] -> (shifted [B, V], lse [B, 1]): `jax.nn.log_softmax(logits, -1)` is shifted - lse, computed the same
    way (max, shift, log of the sum of exponentials), so that a logprob taken as shifted[t] - lse is the one
    `log_softmax` gives for token t, without the [B, V] logprobs written out."""
    x = logits.astype(jnp.float32)
    shifted = x - jnp.max(x, axis=-1, initial=-np.inf, keepdims=True)
    return shifted, jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True))


def sample(logits, md: SamplingMetadata, deterministic: bool = False):
    """logits: [B, V]. Returns (tokens [B], chosen_logprob [B], top_ids [B, MAX_LOGPROBS], top_logprobs
    [B, MAX_LOGPROBS], chosen_rank [B]); logprobs are those of the model's raw distribution (vLLM's convention), and a
    token's rank is 1 + the number of tokens strictly likelier (ties share a rank), over the whole vocabulary.
    The top entries and ranks are computed only when some row of the step asks for logprobs (`num_logprobs`), and
    are zeros otherwise: at a large vocabulary the top-k is most of a step's sampling. Only then are the
    [B, V] logprobs written out too; the chosen token's logprob is its shifted logit less the log-sum-exp.
    `deterministic`: the log-softmax in tiles of rows (`model.deterministic.rowwise`), a row's the same in any batch."""
    shifted, lse = (rowwise(log_softmax_parts, logits.shape[:1], logits) if deterministic
                    else log_softmax_parts(logits))
    processed = process_logits(logits, md)
    greedy = first_argmax(processed)
    samples = md.temperature >= GREEDY_BELOW
    drawn = jax.lax.cond(jnp.any(samples), _draw, lambda x, _: greedy, processed, md)
    tokens = jnp.where(samples, drawn, greedy)
    chosen = jnp.take_along_axis(shifted, tokens[:, None], axis=-1)[:, 0] - lse[:, 0]
    top_ids, top_lp, rank = jax.lax.cond(jnp.any(md.num_logprobs >= 0), _ranked, _unranked, shifted, lse, chosen)
    return tokens, chosen, top_ids, top_lp, rank
