"""The step programs: the forward of one bucketed batch, and sampling, each jitted once per model structure."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from gdn_jax.model.forms import DETERMINISTIC, GENERIC, Forms
from gdn_jax.model.state import Batch, DeviceState
from gdn_jax.model.qwen35 import forward
from gdn_jax.model.state import RestoreOps
from gdn_jax.model.deterministic import rowwise
from gdn_jax.sampling import SamplingMetadata, log_softmax_parts, sample
from scheduler.sampling_params import MAX_LOGPROBS
from gdn_jax.worker.compilation import compiler_options


def host_batch(tokens, start_pos, lengths, block_tables, slot_mapping, ops: RestoreOps, saves) -> Batch:
    """The step's `Batch` as host arrays, its restores folded into the forward's read of the initial state: from
    the source slot, written to the live slot (a copy: the source is never written). `saves`: (rows, offsets, slots)
    of the checkpoints the step writes, or None."""
    initial_state_ids, has_initial_state = ops.sources()
    return Batch(tokens, start_pos, lengths, block_tables, slot_mapping, linear_state_ids=ops.linear_state_ids,
                 has_initial_state=has_initial_state, initial_state_ids=initial_state_ids,
                 **dict(zip(("save_rows", "save_offsets", "save_slots"), saves or (None,) * 3)))


def _step(graphdef, params, rule, state, batch: Batch):
    """The forward of one step: (state, logits [B, V]). Sampling is its own executable (`sample_function`). `rule`:
    the chunked GDN rule's (chunk size, schedule) and the step's `Forms`."""
    logits, state = forward(graphdef, params, batch, state, chunk_size=rule[0], gdn_schedule=rule[1], forms=rule[2])
    return state, logits


def _step_prompt_logprobs(graphdef, params, rule, state, batch: Batch, targets, full_rows):
    """`_step` plus the log-distribution at every position of the chunk (prompt logprobs). A separate executable,
    so that steps without a prompt-logprobs row never pay for [B, T, V] logits. targets[b, t]: the prompt token at
    position start + t + 1, scored by the logits of position start + t. `full_rows` (static) also returns every row."""
    logits, state = forward(graphdef, params, batch, state, all_logits=True, chunk_size=rule[0],
                            gdn_schedule=rule[1], forms=rule[2])  # [B, T, V]
    last = jnp.take_along_axis(logits, jnp.maximum(batch.lengths - 1, 0)[:, None, None], axis=1)[:, 0]
    logprobs = (rowwise(lambda x: jnp.subtract(*log_softmax_parts(x)), logits.shape[:2], logits)
                if rule[2].deterministic else jax.nn.log_softmax(logits, axis=-1))
    target_lp = jnp.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]  # [B, T]
    rank = 1 + jnp.sum(logprobs > target_lp[..., None], axis=-1, dtype=jnp.int32)
    top_lp, top_ids = jax.lax.top_k(logprobs, min(MAX_LOGPROBS, logits.shape[-1]))
    prompt = (target_lp, rank, top_ids.astype(jnp.int32), top_lp) + ((logprobs,) if full_rows else ())
    return state, last, prompt



@functools.cache
def sample_function(deterministic: bool = False):
    """The sampling executable; `deterministic`: log-softmax in tiles of rows, compiled as the deterministic steps
    are (`compiler_options`)."""
    return jax.jit(functools.partial(sample_packed, deterministic=deterministic),
                   compiler_options=compiler_options("sample", DETERMINISTIC if deterministic else None))


def sample_packed(logits, md: SamplingMetadata, deterministic: bool = False):
    """`sample`'s five outputs as one int32 [B, 3 + 2 * MAX_LOGPROBS] array (tokens, the chosen logprob's bits, the
    chosen token's rank, top ids, the top logprobs' bits): the step's result comes back to the host in one transfer,
    not five."""
    tokens, chosen, top_ids, top_lp, rank = sample(logits, md, deterministic)
    bits = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.int32)
    return jnp.concatenate([tokens[:, None], bits(chosen)[:, None], rank[:, None], top_ids, bits(top_lp)], axis=1)


def unpack_sampled(packed: np.ndarray) -> tuple:
    """`sample_packed`'s host array -> (tokens [B], chosen logprobs [B], chosen ranks [B], top ids [B, K], top
    logprobs [B, K])."""
    k = (packed.shape[1] - 3) // 2
    return (packed[:, 0], packed[:, 1].view(np.float32), packed[:, 2], packed[:, 3:3 + k],
            packed[:, 3 + k:].view(np.float32))


@dataclasses.dataclass
class Launched:
    """A step dispatched to the device (`Worker.launch`), its results not read yet: per sub-batch (its rows, its
    device results, full_rows), and the sub-batches' plans."""
    parts: list
    plans: list

    @functools.cached_property
    def sources(self) -> dict:
        """Where each sampling row's token lies, seq_id -> (sub-batch, row), for the next step's pending tokens
        (`fed_tokens`): read only when a step is fed from this one, so a step-by-step engine never builds it."""
        return {s.seq_id: (j, i) for j, plan in enumerate(self.plans) for i, s in enumerate(plan.seqs) if s.sample}


@functools.partial(jax.jit, static_argnums=1)
def token_column(packed, rows: int):
    """The tokens of a sub-batch's packed samples (`sample_packed`'s column 0), padded to `rows`: one shape for
    every rows bucket, so that `fed_tokens` compiles per bucket of the step it feeds only."""
    return jnp.pad(packed[:, 0], (0, rows - packed.shape[0]))


@jax.jit
def fed_tokens(tokens, part, row, columns: tuple):
    """tokens [B, 1] with row i's token taken from columns[part[i]][row[i]] (`token_column`) where part[i] >= 0:
    async scheduling's pending tokens, from the step before's samples on the device, never through the host."""
    out = tokens[:, 0]
    for j, column in enumerate(columns):
        out = jnp.where(part == j, column[row], out)
    return out[:, None]


@dataclasses.dataclass
class PromptLogprobs:
    """Per scheduled row and chunk position t: the logprob and rank of the prompt token at start + t + 1."""
    logprobs: np.ndarray        # [rows, T]
    ranks: np.ndarray           # [rows, T]
    top_ids: np.ndarray         # [rows, T, MAX_LOGPROBS]
    top_logprobs: np.ndarray    # [rows, T, MAX_LOGPROBS]
    rows: np.ndarray | None     # [rows, T, V] the whole log-distribution, when a row asked for it


# The step uses every argument, so the steps are jitted with keep_unused: JAX's search for unused arguments is then
# skipped, a dead-code pass over the whole program, through every branch of the layer switches, at each loop level
# until nothing changes (a sizeable part of a large model's emission; docs/benchmarks.md). What it would still have
# dropped are two batch arrays the layer loops carry unread; XLA drops them as well, and the compiled program is the
# same instruction for instruction (docs/design.md, "Compiling the step").
KEEP_UNUSED = True


def _sharded(out_shardings) -> dict:
    """jit's `out_shardings` of a step from (the pools' shardings in `DeviceState` order, the rest's): the pools
    keep their split from step to step (a donated pool is reused in place, and no step recompiles for a new
    sharding), everything else is replicated (the logits gathered for sampling)."""
    if out_shardings is None:
        return {}
    pools, rest = out_shardings
    return {"out_shardings": (DeviceState(*pools), rest)}


@functools.lru_cache(maxsize=None)
def step_function(graphdef, params_def, chunk_size: int, kind: str = "prefill", gdn_schedule: str = "auto",
                  forms: Forms = GENERIC, out_shardings=None):
    """The jitted step for one model structure: `(param_leaves, state, batch)`, the state donated. Cached per
    (graphdef, params treedef, GDN chunk size and schedule, `executable_kind`, whose compile options differ, the
    step's `Forms`, and on a mesh the outputs' shardings (`_sharded`)), so workers of the same model share compiled
    executables, and the structure is hashed here, once, not per call."""

    def step(param_leaves, state, *args):
        return _step(graphdef, jax.tree.unflatten(params_def, param_leaves), (chunk_size, gdn_schedule, forms), state,
                     *args)

    return jax.jit(step, donate_argnums=(1,), compiler_options=compiler_options(kind, forms), keep_unused=KEEP_UNUSED,
                   **_sharded(out_shardings))


@functools.lru_cache(maxsize=None)
def prompt_step_function(graphdef, params_def, chunk_size: int, gdn_schedule: str = "auto", forms: Forms = GENERIC,
                         out_shardings=None):
    """The prompt-logprobs variant of `step_function` (its last argument, `full_rows`, is static)."""

    def step(param_leaves, state, *args):
        return _step_prompt_logprobs(graphdef, jax.tree.unflatten(params_def, param_leaves),
                                     (chunk_size, gdn_schedule, forms), state, *args)

    return jax.jit(step, donate_argnums=(1,), static_argnums=(4,), compiler_options=compiler_options("prefill"),
                   keep_unused=KEEP_UNUSED, **_sharded(out_shardings))


@dataclasses.dataclass
class StepResult:
    tokens: np.ndarray          # [rows] sampled token per scheduled row
    logprobs: np.ndarray        # [rows] logprob of the sampled token
    ranks: np.ndarray           # [rows] its rank in the whole distribution (1 + the tokens strictly likelier)
    top_ids: np.ndarray         # [rows, MAX_LOGPROBS]
    top_logprobs: np.ndarray    # [rows, MAX_LOGPROBS]
    prompt: PromptLogprobs | None = None
    # speculative decoding (`worker.speculation`): the arrays above hold `positions` samples per row (row i's j-th at
    # i * positions + j), `accepted` [rows] the drafts each row kept, `drafts` [rows, k] its next ones (-1: none)
    positions: int = 1
    accepted: np.ndarray | None = None
    drafts: np.ndarray | None = None
