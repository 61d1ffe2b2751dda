"""The worker of speculative decoding: steps that sample, verify and draft in one program.

With speculation on, every step is one executable per sub-batch that runs the model, samples, and runs the MTP block
to draft the next k tokens of each row, on the device, so that a step's drafts never travel to the host and back
before the next step's verify (they do travel once, to be planned: the scheduler decides how many of them a row
verifies).
- A prefill sub-batch: the model over the rows' chunks (their hidden states kept), sampling at each row's last
  position, then the MTP block over every position (its keys and values) with the token after each: the next prompt
  token, or the one just sampled; the drafts come from the last position.
- A verify sub-batch (the decode rows): rows of the last sampled token and its drafts, k + 1 tokens, run on the
  one-token step's forms position by position (`Qwen35Model.__call__(by_position=True)`): the GDN state after each
  draft is written into the row's draft slot, in the pool, and the attention runs per position, while the products
  take every position at once; sampling at every position, each with the request's key at that output index (as plain
  decoding draws it); the drafts a row keeps are the leading ones equal to the token sampled before them; then the MTP
  block over the row with the sampled tokens, and the next drafts from the last position kept.

Accepting a draft when it equals the token sampled at its position is rejection sampling for a draft that is a
point mass (the MTP block drafts greedily): it is kept with probability p(draft), and otherwise the token is drawn
from the target distribution without it. So the tokens are drawn from the model's distribution, with the keys of
plain decoding: a seeded request gives the same tokens with speculation as without.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdn_jax import jax_compat
from gdn_jax.model.forms import Forms
from gdn_jax.model.mtp import mtp_propose
from gdn_jax.model.state import RestoreOps
from gdn_jax.sampling import SamplingMetadata
from gdn_jax.worker.compilation import compile_threads_default, compiler_options, gc_paused
from gdn_jax.worker.step import KEEP_UNUSED, StepResult, host_batch, sample_packed, unpack_sampled
from gdn_jax.worker.worker import Worker


def _spec_step(model, kind: str, k: int, rule, state, batch, md: SamplingMetadata, next_tokens=None):
    """One sub-batch: (state, the packed samples [B] (prefill) or [B * T] (verify), drafts kept [B], next drafts
    [B, k])."""
    chunk_size, schedule, forms = rule
    if kind == "prefill":
        logits, state, hidden = model(batch, state, chunk_size=chunk_size, gdn_schedule=schedule, forms=forms,
                                      hidden=True)
        packed = sample_packed(logits, md)
        after = jnp.where(next_tokens < 0, packed[:, :1], next_tokens)  # -1: the token sampled there
        last, accepted = jnp.maximum(batch.lengths - 1, 0), jnp.zeros_like(batch.lengths)
    else:
        logits, state, hidden = model(batch, state, all_logits=True, forms=forms, hidden=True, by_position=True)
        B, T, V = logits.shape
        packed = sample_packed(logits.reshape(B * T, V), md)
        after = packed[:, 0].reshape(B, T)  # the token sampled at each position
        keep = (after[:, :-1] == batch.tokens[:, 1:]) & (jnp.arange(1, T)[None, :] < batch.lengths[:, None])
        last = accepted = jnp.sum(jnp.cumprod(keep.astype(jnp.int32), axis=1), axis=1)
    drafts, state = mtp_propose(model, hidden, after, last, batch, state, k, forms, by_position=kind == "verify")
    return state, packed, accepted, drafts


@functools.lru_cache(maxsize=None)
def spec_step_function(graphdef, params_def, chunk_size: int, gdn_schedule: str, forms: Forms, k: int, kind: str):
    """The jitted step of one sub-batch kind ("prefill" or "verify"): `(param_leaves, state, batch, sampling[,
    next_tokens])`, the state donated."""

    def step(param_leaves, state, batch, md, *next_tokens):
        model = nnx.merge(graphdef, jax.tree.unflatten(params_def, param_leaves))
        return _spec_step(model, kind, k, (chunk_size, gdn_schedule, forms), state, batch, md, *next_tokens)

    # a verify step is short (k + 1 tokens per row): XLA's default options run it faster than the prefill steps'
    # (`compilation.compiler_options`), at some compile time
    kind_options = "prefill" if kind == "prefill" else "decode_wide"
    return jax.jit(step, donate_argnums=(1,), compiler_options=compiler_options(kind_options, forms),
                   keep_unused=KEEP_UNUSED)


class SpecWorker(Worker):
    """A `Worker` whose steps draft (`EngineConfig.speculative_config`): a plan's decode rows are verify rows
    (`scheduler.speculation`), and every result carries each row's samples at k + 1 positions (`StepResult.
    positions`), the drafts it kept (`accepted`) and its next drafts (`drafts`). A step with a prompt-logprobs row
    runs the plain prefill step instead, and its rows get no drafts (their next decode verifies none, and drafts
    again)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.k = self.config.num_speculative_tokens
        if not self.cfg.mtp_num_hidden_layers:
            raise ValueError("speculative decoding drafts with the model's MTP block: load the model with mtp=True")
        params_def = jax.tree.structure(self.params)
        self._spec_fns = {kind: spec_step_function(self.graphdef, params_def, self.chunk_size, self.gdn_schedule,
                                                   self.forms, self.k, kind) for kind in ("prefill", "verify")}

    # -- shapes ----------------------------------------------------------------------------------------------
    def spec_shapes(self) -> list[tuple[str, int, int]]:
        """(kind, rows, tokens) of every spec executable: the prefill shapes, and a verify shape per rows bucket."""
        return ([("prefill", B, T) for B, T, _ in self.shape_buckets() if T > 1]
                + [("verify", B, self.k + 1) for B in self.sample_buckets()])

    def _spec_padding(self, kind: str, B: int, T: int) -> tuple:
        """The arguments after params and state of an all-padding sub-batch."""
        if kind == "prefill":
            batch, md = self._padding_args(B, T, self.max_blocks)
            return batch, md, np.zeros((B, T), np.int32)
        z = np.zeros((B, T), np.int32)
        ops = RestoreOps.from_ops([], B)
        batch = host_batch(z, np.zeros(B, np.int32), np.zeros(B, np.int32), np.zeros((B, self.max_blocks), np.int32),
                           z, ops, self._draft_saves([], B))
        return batch, SamplingMetadata.padding(B * T, self.history_width)

    def _draft_saves(self, seqs, B: int, busy: set[int] = frozenset()):
        """A verify sub-batch's state writes: row i's state after its draft j (offset j + 1) to its draft slot j,
        padded to B x k writes into slot 0; None without GDN layers. Checked before dispatch: a draft slot in range,
        written once, and neither advanced nor read by a row of the step."""
        if not self.cfg.linear_layer_ids:
            return None
        S = B * self.k
        rows, offsets, slots = np.zeros(S, np.int32), np.ones(S, np.int32), np.zeros(S, np.int32)
        n = 0
        for i, s in enumerate(seqs):
            for j, slot in enumerate(s.draft_slots):
                if not 1 <= slot < self.memory.num_linear_slots or slot in busy:
                    raise ValueError(f"row {i}: draft slot {slot} is out of range or read or advanced by this step")
                rows[n], offsets[n], slots[n] = i, j + 1, slot
                n += 1
        if len(set(slots[:n].tolist())) != n:
            raise ValueError("two draft slots of a verify step are the same")
        return rows, offsets, slots

    # -- a step ----------------------------------------------------------------------------------------------
    def _prepare(self, plan, prompt_targets) -> tuple:
        """(rows, batch, sampling, prompt targets, (kind, next tokens)) of a sub-batch."""
        if plan.is_prefill:
            n, batch, sampling, targets = super()._prepare(plan, prompt_targets)
            B, T = batch.tokens.shape
            after = np.zeros((B, T), np.int32)
            for i, s in enumerate(plan.seqs):
                after[i, :len(s.token_ids) - 1] = s.token_ids[1:]
                after[i, len(s.token_ids) - 1] = s.next_token_id
            return n, batch, sampling, targets, ("prefill", after)
        seqs, T = plan.seqs, self.k + 1
        n = len(seqs)
        if n > self.max_rows or max(len(s.token_ids) for s in seqs) > T:
            raise ValueError(f"verify plan of {n} rows x {max(len(s.token_ids) for s in seqs)} tokens exceeds the "
                             f"worker's shapes ({self.max_rows} rows, {T} tokens per row)")
        B = self.rows_bucket(n)
        tokens, slot_mapping, start, lengths, tables, restore = self._row_arrays(seqs, B, T, self.max_blocks,
                                                                                in_place=True)
        busy = set(restore.linear_state_ids.tolist()) | set(restore.restore_src_slot_ids.tolist())
        batch = host_batch(tokens, start, lengths, tables, slot_mapping, restore, self._draft_saves(seqs, B, busy))
        # each position samples with the key of its output index, as plain decoding would
        positions = [dataclasses.replace(s, num_generated=s.num_generated + j) for s in seqs for j in range(T)]
        sampling = SamplingMetadata.from_rows(positions, B * T, self.history_width, self.cfg.vocab_size,
                                              self.eos_token_ids, self.seed)
        return n, batch, sampling, None, ("verify", None)

    def _check_mixed(self, plan) -> None:
        """`Worker._check_mixed`, and no draft slot being a slot the step's prefill rows read, advance or save into."""
        busy = {sv.slot for sv in plan.saves}
        for s in plan.prefill_seqs:
            if s.linear_op is not None:
                busy |= {s.linear_op.linear_state_id, s.linear_op.restore_src_slot_id}
        for s in plan.decode_seqs:
            if busy & set(s.draft_slots):
                raise ValueError(f"seq {s.seq_id}: draft slots {sorted(busy & set(s.draft_slots))} are read, advanced "
                                 f"or saved into by a prefill row of this mixed step")
        super()._check_mixed(plan)

    def _launch(self, batch, sampling, targets, spec, full_rows: bool) -> tuple:
        if targets is not None:  # prompt logprobs: the plain prefill step
            return ("plain", super()._launch(batch, sampling, targets, full_rows))
        kind, after = spec
        fn = self._spec_fns[kind]
        before = jax_compat.compilations(self._spec_fns.values())
        args = (self._param_leaves, self.state, batch, sampling) + ((after,) if kind == "prefill" else ())
        self.state, *out = self._call((kind, *batch.tokens.shape), fn, args)
        self.num_compilations += jax_compat.compilations(self._spec_fns.values()) - before
        return (kind, *out)

    def _collect(self, n: int, launched: tuple, full_rows: bool) -> StepResult:
        """The first n rows' samples at k + 1 positions each (a prefill row's first only, repeated), the drafts
        each kept, and its next drafts (-1: none)."""
        P = self.k + 1
        if launched[0] == "plain":
            res = super()._collect(n, launched[1], full_rows)
            fields = ("tokens", "logprobs", "ranks", "top_ids", "top_logprobs")
            return StepResult(*(np.repeat(getattr(res, f), P, axis=0) for f in fields), prompt=res.prompt,
                              positions=P, accepted=np.zeros(n, np.int32), drafts=np.full((n, self.k), -1, np.int32))
        kind, (packed, accepted, drafts) = launched[0], self._fetch(launched[1:])
        sampled = unpack_sampled(packed[:n * P] if kind == "verify" else np.repeat(packed[:n], P, axis=0))
        return StepResult(*sampled, positions=P, accepted=accepted[:n], drafts=drafts[:n])

    def _run_spec(self, kind: str, B: int, T: int, padding: tuple):
        """Runs the spec executable (kind, B, T) on `padding` (`_spec_padding`); returns the state."""
        args = (self._param_leaves, self.state, *padding)
        self.state = self._call((kind, B, T), self._spec_fns[kind], args)[0]
        return self.state

    def _lower_spec(self, kind: str, padding: tuple):
        return self._spec_fns[kind].lower(self._param_leaves, self.state, *padding)

    def warm_up(self, prompt_logprobs: bool = False, compile_threads: int | None = None) -> int:
        """Every spec executable (`spec_shapes`) from the executable store, else compiled and stored (keyed by the
        number of drafts too), as `Worker.warm_up` does; then runs each once on an all-padding sub-batch; the
        prompt-logprobs prefill too with `prompt_logprobs`."""
        threads = compile_threads_default() if compile_threads is None else compile_threads
        shapes = self.spec_shapes()
        padding = {shape: self._spec_padding(*shape) for shape in shapes}  # for the key, the lowering and the run
        jobs = [(shape, (self._param_leaves, self.state, *padding[shape]), None,
                 functools.partial(self._lower_spec, shape[0], padding[shape])) for shape in shapes]
        with gc_paused():
            loaded, compiled = self._load_or_compile(
                jobs, (repr(self.cfg), self.chunk_size, self.gdn_schedule, self.k), max(1, threads))
        self.warm_up_stats = {"loaded": loaded, "compiled": compiled}
        if not self.abstract:
            for shape in shapes:
                self._warm_run(functools.partial(self._run_spec, *shape, padding[shape]))
            if prompt_logprobs:
                for B, T, NB in self.shape_buckets():
                    if T > 1:
                        self._run(*self._padding_args(B, T, NB), np.zeros((B, T), np.int32), False, fn=self._prompt_fn)
            jax.block_until_ready(self.state)
        return len(shapes)
