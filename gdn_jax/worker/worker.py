"""The worker: device state pools and one jitted step (restore -> forward -> sample) over a bucketed batch.

The step plan arrives as plain Python data from the scheduler; the worker pads it to bucketed shapes (batch rows,
tokens per row; the block tables always have the largest width, which costs nothing: attention loops over the keys
the rows hold; one rule, `Worker.step_shape`) so a steady workload never recompiles, validates the linear-state ops on
the host (fail closed), and runs `_step` on the step's `Batch` (a pytree of host arrays, the restores folded in) with
the state donated, then `sample_function()`. A mixed plan (prefill and decode rows) runs as its two sub-batches, one
executable each (see docs/design.md, "Mixed prefill + decode steps").

The model's graph definition is closed over once per graphdef (`step_function`), not passed as a static argument:
a static argument is hashed on every call, and hashing an NNX graphdef costs tens of milliseconds. The parameters
travel as a flat list of arrays (flattened by the C++ dispatch path, not by NNX's Python pytree hooks).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from gdn_jax import jax_compat
from gdn_jax.diagnostics import map_on_threads, user_stacklevel
from gdn_jax.worker import executable_store as executables
from gdn_jax.backends.cpu import tuning
from gdn_jax.config import EngineConfig, ModelConfig
from gdn_jax.model.forms import DETERMINISTIC, Forms
from gdn_jax.model.gated_delta import default_chunk_size
from gdn_jax.model import sharding
from gdn_jax.model.state import Batch, DeviceState, init_state
from gdn_jax.model.state import RestoreOps, validate_cache_ops
from gdn_jax.sampling import SamplingMetadata
from gdn_jax.worker.memory import MemoryPlan
from gdn_jax.worker.compilation import compile_threads_default, compiler_options, executable_kind, gc_paused
from gdn_jax.worker.step import (Launched, PromptLogprobs, StepResult, fed_tokens, host_batch, prompt_step_function,
                                  sample_function, step_function, token_column, unpack_sampled)
from scheduler.plan import PENDING_TOKEN
from scheduler.sampling_params import MAX_LOGPROBS


_POOLS = tuple(f.name for f in dataclasses.fields(DeviceState))


def _bucket(n: int, lo: int, hi: int) -> int:
    """Smallest power of two >= n, clamped to [lo, hi]."""
    return min(max(lo, 1 << max(0, math.ceil(math.log2(max(n, 1))))), hi)



class Worker:
    def __init__(self, cfg: ModelConfig, graphdef, params, memory: MemoryPlan, config: EngineConfig,
                 eos_token_ids: tuple[int, ...] | None = None, forms: Forms | None = None, mesh=None):
        """Runs the step plans of the model `cfg` in the pools of `memory`, as `config` sets them up (its cache,
        scheduling and compile settings, dtype and seed; `config.model` is not read). `eos_token_ids`: the ids
        `min_tokens` bans besides a request's stop_token_ids (default: the model's EOS).

        `checkpoint_mode` "scan" (the scheduler's; see SchedulerConfig): a prefill row holds up to the token budget
        (`config.token_budget`), and a step shape with room for a row to cross a boundary writes up to
        `num_saves(B, T)` checkpoints; "promote": a row holds at most `chunk_stride` tokens and no step writes a
        checkpoint. The chunked GDN rule runs with chunk size gcd(`gated_delta.default_chunk_size`, chunk_stride),
        so that every boundary is a chunk boundary of a row that starts on one.

        `forms`: the forms every step is traced in (`Forms`); None resolves this machine's, once, here
        (`tuning.resolve_forms`: the environment's settings, the kernels, the measured choices).

        `params` may be abstract (`jax.ShapeDtypeStruct` leaves, `weights.abstract_model`): the pools are then
        abstract too, nothing is allocated, and the worker can only lower and compile (`lowered_step`), as
        scripts/bench/bench_compile.py does for models too large for the machine.

        `gdn_schedule`: the chunked GDN rule's schedule, "auto" (fused with the CPU forms, else parallel), "fused"
        or "parallel" (`gated_delta.chunk_gated_delta_rule`'s impl; same maths, so a CPU test can run the
        accelerators' schedule through the engine).

        `mesh`: the "tp" mesh the params lie on (`weights.shard_model`; `cfg` is then the config it returned); the
        pools are split by heads over it (`sharding.state_specs`), every step keeps them so (its output shardings),
        and the logits are gathered for sampling. The steps then take XLA's forms without the compiled CPU kernels
        or the GPU's paged kernel (custom calls the partitioner cannot split), and the executable store is off (its
        keys hold no mesh)."""
        cache, max_model_len = config.cache, config.scheduling.max_model_len
        block_size, chunk_stride = cache.block_size, cache.chunk_stride
        dtype, gdn_schedule = getattr(jnp, config.dtype), config.compile.gdn_schedule  # jnp.float32, jnp.bfloat16
        self.config, self.cfg, self.graphdef, self.params = config, cfg, graphdef, params
        self.memory, self.block_size = memory, block_size
        self.max_rows = _bucket(config.scheduling.max_num_seqs, 1, 1 << 30)
        self.max_blocks = math.ceil(max_model_len / block_size)
        self.forms = DETERMINISTIC if config.deterministic else tuning.resolve_forms(dtype) if forms is None else forms
        self.mesh = mesh
        self.shardings = None if mesh is None else (*sharding.state_shardings(mesh), sharding.replicated(mesh))
        if mesh is not None:
            self.forms = dataclasses.replace(self.forms, kernels=False, rows_kernel_rows=0, f32_rows_kernel_rows=0,
                                             paged_decode="off")
        self.stride, self.chunk_size = chunk_stride, math.gcd(default_chunk_size(self.forms.cpu), chunk_stride)
        self.budget = config.token_budget
        self.scan = cache.checkpoint_mode == "scan"
        self.saves = self.scan and cache.enable_prefix_caching and bool(cfg.linear_layer_ids)
        self.checkpoint_policy = cache.checkpoint_policy
        self.max_chunk = min(self.budget, max_model_len) if self.scan else chunk_stride
        # penalty history width: every step's (prompt + output) fits, whatever its blocks bucket, so sampling has no
        # blocks dimension of its own
        self.history_width = self.max_blocks * block_size
        self.seed, self.dtype = config.seed, dtype
        # the ids `min_tokens` bans besides a request's stop_token_ids, even with ignore_eos (vLLM's rule): the
        # model's EOS and the further end-of-sequence ids its folder lists
        self.eos_token_ids = (tuple(eos_token_ids) if eos_token_ids is not None
                              else () if cfg.eos_token_id is None else (cfg.eos_token_id,))
        self._param_leaves, params_def = jax.tree.flatten(params)
        self.abstract = any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in self._param_leaves)
        self.state = self._new_state()
        fns = {kind: step_function(graphdef, params_def, self.chunk_size, kind, gdn_schedule, self.forms,
                                   self._out_shardings())
               for kind in ("prefill", "decode", "decode_wide")}
        self._fn, self._decode_fn, self._decode_wide_fn = fns["prefill"], fns["decode"], fns["decode_wide"]
        # compiled lazily, per prefill shape, the first time a step has a prompt-logprobs row (or by warm_up)
        self._prompt_fn = prompt_step_function(graphdef, params_def, self.chunk_size, gdn_schedule, self.forms,
                                               self._out_shardings())
        self.gdn_schedule = gdn_schedule
        self._sample = sample_function(self.forms.deterministic)
        # warm_up's executables, called directly: ("step", rows, tokens) and ("sample", rows)
        self._executables: dict[tuple, object] = {}
        self._stored: dict[tuple, str] = {}  # those loaded from the executable store: name -> its key there
        self._called: list[tuple] = []  # the store's executables the current step called
        self.executable_dir = executables.default_folder() if mesh is None else None  # the store (None: off)
        self.warm_up_stats = {"loaded": 0, "compiled": 0}
        self.state_resets = 0  # reset_state calls
        self.num_compilations = 0  # step compilations this worker triggered (cached executables are shared)

    def rows_bucket(self, n: int) -> int:
        """Rows of the step shape that holds n scheduled rows: the one rule `execute` pads by and `shape_buckets`
        enumerates."""
        return _bucket(n, 1, self.max_rows)

    def tokens_bucket(self, longest: int, prefill: bool = True) -> int:
        """Tokens per row of the step shape whose longest row has `longest` tokens (a decode step has 1)."""
        return _bucket(longest, min(16, self.max_chunk), self.max_chunk) if prefill else 1

    def shape_buckets(self) -> list[tuple[int, int, int]]:
        """Every (rows, tokens per row, blocks per row) shape `execute` can produce from the scheduler's plans; T = 1
        is decode. The block tables are always `max_blocks` wide: attention loops over the keys the rows hold, not
        over the table (`model.Attention`), so a narrower table would save nothing but cost a compilation per width.

        "scan": the scheduler keeps rows x longest row within the token budget (`Scheduler._row_budget`), so a
        bucket is listed only when the fewest rows and the shortest longest row that land in it fit the budget
        together: with 16 sequences and a budget of 2048, 16 rows x 512 tokens would need 9 rows of at least 257
        tokens, which the scheduler never plans. (A step with forked children can exceed it: their rows are taken
        before that rule applies. Such a shape, like any shape outside this list, compiles on first use.)"""
        def fewest(bucket, hi: int) -> dict[int, int]:  # bucket -> the smallest count that pads to it
            return {bucket(n): n for n in range(hi, 0, -1)}

        rows = sorted(fewest(self.rows_bucket, self.max_rows).items())
        tokens = sorted(fewest(self.tokens_bucket, self.max_chunk).items())
        fits = (lambda n, m: n == 1 or n * m <= self.budget) if self.scan else (lambda n, m: True)
        return [(b, t, self.max_blocks) for b, n in rows
                for t in [1] + [t for t, m in tokens if fits(n, m)]]

    def step_shape(self, rows: int, longest: int, prefill: bool) -> tuple[int, int, int]:
        """The bucket (rows, tokens per row, blocks per row) a step of `rows` rows whose longest row has `longest`
        tokens runs in (`rows_bucket`, `tokens_bucket`; the block tables always have their largest width)."""
        return self.rows_bucket(rows), self.tokens_bucket(longest, prefill), self.max_blocks

    def num_saves(self, B: int, T: int) -> int:
        """Checkpoint writes a (B, T) step shape has room for: each row starts on a boundary, so a row of L tokens
        crosses L // chunk_stride of them ("all") or saves at most one ("last"); all rows together hold at most
        the token budget."""
        if not self.saves or T < self.stride:
            return 0
        per_row = T // self.stride if self.checkpoint_policy == "all" else 1
        return min(B * per_row, self.budget // self.stride)

    def _save_arrays(self, saves, B: int, T: int, start, lengths, ops: RestoreOps):
        """Plan saves -> (rows, offsets, slots) [S] int32, padded with writes to slot 0; None for a shape without
        saves. Checked before dispatch: a save lands on a chunk boundary inside its row, at the position of the
        checkpoint boundary it is indexed under (else the checkpoint would hold another position's state, restored
        as exact), in a slot that no row of the step reads or advances."""
        S = self.num_saves(B, T)
        if len(saves) > S:
            raise ValueError(f"{len(saves)} checkpoint saves for a ({B} x {T}) step with room for {S}")
        if not S:
            return None
        rows, offsets, slots = np.zeros(S, np.int32), np.full(S, self.chunk_size, np.int32), np.zeros(S, np.int32)
        busy = set(ops.linear_state_ids.tolist()) | set(ops.restore_src_slot_ids.tolist())
        for i, sv in enumerate(saves):
            if not 0 <= sv.row < B:  # (a negative row would index the batch from its end)
                raise ValueError(f"save {i}: row {sv.row} is not a row of this {B}-row step")
            if not (0 < sv.offset <= lengths[sv.row] and sv.offset % self.chunk_size == 0):
                raise ValueError(f"save {i}: offset {sv.offset} is not a chunk boundary inside row {sv.row}")
            if start[sv.row] + sv.offset != sv.boundary or sv.boundary % self.stride:
                raise ValueError(f"save {i}: row {sv.row} reaches position {start[sv.row] + sv.offset} at offset "
                                 f"{sv.offset}, not the checkpoint boundary {sv.boundary} (a multiple of chunk_stride "
                                 f"{self.stride}) the save is indexed under")
            if not 1 <= sv.slot < self.memory.num_linear_slots or sv.slot in busy:
                raise ValueError(f"save {i}: slot {sv.slot} is out of range or read or advanced by this step")
            rows[i], offsets[i], slots[i] = sv.row, sv.offset, sv.slot
        if len(set(slots[:len(saves)].tolist())) != len(saves):
            raise ValueError("two checkpoint saves write the same slot")
        return rows, offsets, slots

    def _padding_args(self, B: int, T: int, NB: int) -> tuple:
        """Step arguments (after params and state) of an all-padding batch: writes land in block 0 / slot 0 only."""
        z = np.zeros((B, T), np.int32)
        ops = RestoreOps.from_ops([], B)
        batch = host_batch(z, np.zeros(B, np.int32), np.zeros(B, np.int32), np.zeros((B, NB), np.int32), z, ops,
                           self._save_arrays([], B, T, None, None, ops))
        return batch, SamplingMetadata.padding(B, self.history_width)

    def warm_up(self, prompt_logprobs: bool = False, compile_threads: int | None = None) -> int:
        """Compiles the step for every shape bucket (and sampling for every rows bucket), then runs each step shape
        once on an all-padding batch. Afterwards no workload compiles again. Returns the number of step shapes.
        `prompt_logprobs` also compiles the prompt-logprobs variant (top-k, not whole rows) of every prefill shape,
        which is otherwise compiled lazily. An abstract worker only compiles.

        Each step and sampling executable is first looked up in the executable store (`gdn_jax.worker.executable_store`, keyed
        without tracing; `executable_dir`, None: off): a second process start loads them without lowering. The
        others: the main thread lowers (traces, in Python) each executable while `compile_threads` background
        threads (default `compile_threads_default()`) compile the ones before (with the store on, afresh: not loaded
        from JAX's persistent cache, `executables.fresh_compilation`): XLA compiles one executable on one core and
        releases the GIL, so on a machine of n cores n compilations run at once. They are then stored. The worker
        calls these executables (`_executables`) directly; shapes outside the grid, and the prompt-logprobs variant,
        go through the jitted functions.
        `warm_up_stats`: how many were loaded, compiled."""
        threads = compile_threads_default() if compile_threads is None else compile_threads
        if threads < 1:
            raise ValueError(f"compile_threads must be at least 1, got {compile_threads}")
        shapes = self.shape_buckets()
        extra = [(B, T, NB) for B, T, NB in shapes if T > 1] if prompt_logprobs else []
        jobs = ([(("step", B, T), self._key_args(B, T), compiler_options(executable_kind(B, T), self.forms),
                  functools.partial(self.lowered_step, (B, T, NB))) for B, T, NB in shapes]
                + [(("sample", B), self._sample_key_args(B), compiler_options("sample"),
                    functools.partial(self.lowered_sample, B))
                   for B in self.sample_buckets()])
        prompt = [functools.partial(self.lowered_prompt_step, shape) for shape in extra]
        loaded, compiled = self._load_or_compile(jobs, (repr(self.cfg), self.chunk_size, self.gdn_schedule), threads,
                                                 prompt)
        self.warm_up_stats = {"loaded": loaded, "compiled": compiled}
        if not self.abstract:
            for shape in shapes:
                self._warm_run(functools.partial(self._run, *self._padding_args(*shape)))
            for B, T, NB in extra:
                self._run(*self._padding_args(B, T, NB), np.zeros((B, T), np.int32), False, fn=self._prompt_fn)
            if self.config.scheduling.async_scheduling:
                self._warm_up_feeds()
            jax.block_until_ready(self.state)
        return len(shapes) + len(extra)

    def _warm_run(self, run) -> None:
        """run() once in warm-up; when it fails in an executable the store gave (`_drop_stale`), that one is dropped
        and run() again on fresh pools (the caller's scheduler must drop its view of them: `state_resets`)."""
        self._called = []
        try:
            jax.block_until_ready((run(), self.state))
        except Exception as exc:
            if not self._drop_stale(exc):
                raise
            self.reset_state()
            run()

    def _load_or_compile(self, jobs: list, static, threads: int, unstored: list = ()) -> tuple[int, int]:
        """Each job's executable (name, its key's arguments, compiler options, a function that lowers it) from the
        executable store, else compiled and stored (`warm_up`); `static`: what the traced function closes over, for
        the key. `unstored`: more lowering functions, compiled alongside and not stored. Returns (loaded, compiled)."""
        folder = self.executable_dir
        keys = [executables.executable_key(name[0], static, args, options, self.forms) if folder else None
                for name, args, options, _ in jobs]
        # two threads (deserializing releases the GIL); what a load warns points at the user's line
        found = map_on_threads(functools.partial(executables.load, folder), keys, threads=2)
        loaded, pending = 0, []
        fresh = executables.fresh_compilation() if folder else contextlib.nullcontext()  # what the store saves
        with fresh, concurrent.futures.ThreadPoolExecutor(threads) as pool:
            for (name, _, _, lower), key, compiled in zip(jobs, keys, found):
                if compiled is not None:
                    self._executables[name], self._stored[name], loaded = compiled, key, loaded + 1
                else:
                    pending.append((name, key, pool.submit(lower().compile)))
            others = [pool.submit(lower().compile) for lower in unstored]
            for name, key, future in pending:
                self._executables[name] = future.result()
                executables.save(folder, key, self._executables[name])
            for future in others:
                future.result()
        return loaded, len(pending) + len(others)

    def _key_args(self, B: int, T: int) -> tuple:
        """The step's arguments for one shape, as the executable store keys them."""
        batch = self._padding_args(B, T, self.max_blocks)[0]
        return (self._param_leaves, self.state, batch)

    def _sample_key_args(self, rows: int) -> tuple:
        logits_sharding = None if self.shardings is None else self.shardings[-1]  # where the step leaves them
        return (jax.ShapeDtypeStruct((rows, self.cfg.vocab_size), jnp.float32, sharding=logits_sharding),
                SamplingMetadata.padding(rows, self.history_width))

    def state_lost(self) -> bool:
        """True when the pools were consumed (donated to a call that then failed) and must be rebuilt."""
        return any(x.is_deleted() for x in jax.tree_util.tree_leaves(self.state))

    def _out_shardings(self):
        """The steps' output shardings, (the pools, the logits, what else they return), as a hashable tuple; None
        without a mesh."""
        if self.shardings is None:
            return None
        state = jax.eval_shape(self._make_state)
        pools = tuple(None if getattr(state, f) is None else s for f, s in zip(_POOLS, self.shardings))
        return pools, self.shardings[-1]

    def _make_state(self):
        return init_state(self.cfg, self.memory.num_kv_blocks, self.block_size, self.memory.num_linear_slots,
                          self.dtype)

    def _new_state(self):
        if self.abstract:
            return jax.eval_shape(self._make_state)
        if self.mesh is None:
            return self._make_state()
        # each device allocates its own slice of the pools
        return jax.jit(self._make_state, out_shardings=DeviceState(*self._out_shardings()[0]))()

    def reset_state(self) -> None:
        """Fresh zeroed pools of the same shapes (the scheduler must forget everything they held)."""
        self.state = self._new_state()
        self.state_resets += 1

    def lowered_step(self, shape: tuple[int, int, int]):
        """The step's forward lowered for one (rows, tokens, blocks) bucket (`.compile()` compiles it); the worker's
        state is not touched."""
        with gc_paused():
            return self.traced_step(shape).lower()

    def traced_step(self, shape: tuple[int, int, int]):
        """The step's forward traced for one bucket: `.lower(lowering_platforms=("cuda",))` lowers it for a platform
        this process has no device of (scripts/tools/step_audit.py)."""
        batch = self._padding_args(*shape)[0]
        with gc_paused():
            return self._fn_for(batch.tokens).trace(self._param_leaves, self.state, batch)

    def lowered_prompt_step(self, shape: tuple[int, int, int]):
        """The prompt-logprobs forward (top-k, not whole rows) lowered for one prefill bucket."""
        batch = self._padding_args(*shape)[0]
        with gc_paused():
            return self._prompt_fn.lower(self._param_leaves, self.state, batch, np.zeros(shape[:2], np.int32),
                                         False)

    def sample_buckets(self) -> list[int]:
        """The row counts sampling is compiled for: one executable per rows bucket, shared by its step shapes."""
        return sorted({B for B, _, _ in self.shape_buckets()})

    def lowered_sample(self, rows: int):
        """Sampling lowered for one rows bucket."""
        with gc_paused():
            return self._sample.lower(*self._sample_key_args(rows))

    def compiled_step(self, shape: tuple[int, int, int]):
        """The step's XLA executable for one (rows, tokens, blocks) bucket, compiled ahead of time (for inspection:
        `.as_text()`, `.memory_analysis()`); the worker's state is not touched."""
        return self.lowered_step(shape).compile()

    def _fn_for(self, tokens):
        kind = executable_kind(*tokens.shape)  # per step: no mapping built per call
        return self._fn if kind == "prefill" else self._decode_fn if kind == "decode" else self._decode_wide_fn


    def _run(self, batch: Batch, sampling: SamplingMetadata, *extra, fn=None):
        """The step's forward (`fn`, with `extra` arguments), then sampling: (the packed samples (`unpack_sampled`)[,
        prompt logprobs]), on the device."""
        jitted = (self._fn, self._decode_fn, self._decode_wide_fn, self._prompt_fn, self._sample)
        before = jax_compat.compilations(jitted)
        args = (self._param_leaves, self.state, batch, *extra)
        if fn is not None:
            self.state, logits, *prompt = fn(*args)
        else:
            self.state, logits, *prompt = self._call(("step", *batch.tokens.shape), self._fn_for(batch.tokens), args)
        sampled = self._call(("sample", logits.shape[0]), self._sample, (logits, sampling))
        self.num_compilations += jax_compat.compilations(jitted) - before
        return (sampled, *prompt)

    def _call(self, name: tuple, jitted, args: tuple):
        """Calls warm-up's executable `name`, else `jitted`; notes the store's executables it calls (`_drop_stale`)."""
        compiled = self._executables.get(name)
        if compiled is None:
            return jitted(*args)
        if name in self._stored:
            self._called.append(name)
        return compiled(*args)

    def _drop_stale(self, exc: BaseException) -> bool:
        """After a failed step: when `exc` is a missing function (`executables.missing_function`; it surfaces when a
        result is read, so which call failed is not known) and the step called executables the store gave, those are
        deleted from the store and dropped here (the jitted functions compile their shapes from then on). Returns
        whether it dropped any: the caller then recomputes the step."""
        called, self._called = list(dict.fromkeys(self._called)), []
        if not called or not executables.missing_function(exc):
            return False
        for name in called:
            del self._executables[name]
            executables.discard(self.executable_dir, self._stored.pop(name))
        warnings.warn(f"a step failed in a stored executable ({exc}): deleted from the executable store, compiled "
                      f"again: {', '.join(f'{n[0]} {n[1:]}' for n in called)}", RuntimeWarning,
                      stacklevel=user_stacklevel())
        return True

    def execute(self, plan, prompt_targets: list[list[int] | None] | None = None, full_rows: bool = False
                ) -> StepResult:
        """Runs one step plan (all-prefill, all-decode or mixed) and returns the sampled tokens per row.

        `prompt_targets[i]` (prefill rows only): the prompt tokens at positions start+1, start+2, ... of row i to
        score from this chunk's logits; when any row has some, the step also returns `StepResult.prompt`."""
        return self.collect(self.launch(plan, prompt_targets, full_rows))

    def launch(self, plan, prompt_targets: list[list[int] | None] | None = None, full_rows: bool = False,
               feed: Launched | None = None) -> Launched:
        """Dispatches one step plan and returns while the device runs it (`collect` reads its results). Every check
        of every sub-batch passes before anything is dispatched (fail closed). `feed`: the step launched before this
        one, whose samples are this plan's pending tokens (`PENDING_TOKEN`, async scheduling): they are taken from
        its results on the device."""
        self._called = []
        try:
            if getattr(plan, "is_mixed", False):
                self._check_mixed(plan)
                n = plan.num_prefill_rows
                parts = [(type(plan)(True, plan.prefill_seqs, plan.saves), prompt_targets[:n] if prompt_targets
                          else None, full_rows), (type(plan)(False, plan.decode_seqs), None, False)]
            else:
                parts = [(plan, prompt_targets, full_rows)]
            prepared = [self._prepare(part, targets) for part, targets, _ in parts]
            # a mixed plan's decode sub-batch is dispatched while the device runs its prefill one
            launched = [(n, self._launch(self._fed(part, batch, feed), *rest, full), full)
                        for (part, _, full), (n, batch, *rest) in zip(parts, prepared)]
        except Exception as exc:
            if self._drop_stale(exc):
                raise executables.StaleExecutable(str(exc)) from exc
            raise
        return Launched(launched, [part for part, _, _ in parts])

    def collect(self, launched: Launched) -> StepResult:
        """Waits for a launched step and returns its samples per row, in the plan's order (a mixed plan's
        sub-batches joined)."""
        try:
            results = [self._collect(n, out, full) for n, out, full in launched.parts]
        except Exception as exc:
            if self._drop_stale(exc):
                raise executables.StaleExecutable(str(exc)) from exc
            raise
        if len(results) == 1:
            return results[0]
        first = results[0]
        fields = [f.name for f in dataclasses.fields(StepResult) if f.name not in ("prompt", "positions")]
        return StepResult(**{f: None if getattr(first, f) is None else np.concatenate([getattr(r, f) for r in results])
                             for f in fields}, prompt=first.prompt, positions=first.positions)

    def _fed(self, plan, batch: Batch, feed: Launched | None) -> Batch:
        """`batch` with its rows' pending tokens taken from the results of the step `feed` (on the device)."""
        pending = [(i, s.seq_id) for i, s in enumerate(plan.seqs) if s.token_ids and s.token_ids[-1] == PENDING_TOKEN]
        if not pending:
            return batch
        if batch.tokens.shape[1] != 1 or feed is None or any(seq_id not in feed.sources for _, seq_id in pending):
            raise ValueError(f"rows {[i for i, _ in pending]}: a pending token (async scheduling) in a step of "
                             f"{batch.tokens.shape[1]} tokens per row, or one the step launched before does not sample")
        part, row = np.full(len(batch.tokens), -1, np.int32), np.zeros(len(batch.tokens), np.int32)
        for i, seq_id in pending:
            part[i], row[i] = feed.sources[seq_id]
        columns = tuple(token_column(out[0], self.max_rows) for _, out, _ in feed.parts)  # (still on the device)
        return dataclasses.replace(batch, tokens=fed_tokens(batch.tokens, part, row, columns))

    def _warm_up_feeds(self) -> None:
        """Compiles what async scheduling's feeds call (`_fed`): each rows bucket's token column, and the gather for
        each rows bucket of the step it feeds, from one sub-batch or two (a mixed step's)."""
        width = 3 + 2 * min(MAX_LOGPROBS, self.cfg.vocab_size)  # (`sample_packed`)
        # placed as a step's samples are (replicated over a mesh): a jitted function compiles per placement too
        put = (lambda x: x) if self.mesh is None else functools.partial(jax.device_put, device=self.shardings[-1])
        column = put(jnp.zeros(self.max_rows, jnp.int32))
        for B in self.sample_buckets():
            token_column(put(jnp.zeros((B, width), jnp.int32)), self.max_rows)
            for parts in (1, 2):
                fed_tokens(np.zeros((B, 1), np.int32), np.zeros(B, np.int32), np.zeros(B, np.int32), (column,) * parts)

    def _prepare(self, plan, prompt_targets) -> tuple:
        """The host side of one sub-batch of `launch`: every check (fail closed) and its arrays, nothing dispatched.
        Returns (rows, batch, sampling, prompt targets [B, T] or None)."""
        seqs = plan.seqs
        n = len(seqs)
        longest = max(len(s.token_ids) for s in seqs)
        if n > self.max_rows or longest > (self.max_chunk if plan.is_prefill else 1):
            raise ValueError(f"step plan of {n} rows x {longest} tokens exceeds the worker's shapes "
                             f"({self.max_rows} rows, {self.max_chunk if plan.is_prefill else 1} tokens per row)")
        B, T, NB = self.step_shape(n, longest, plan.is_prefill)
        tokens, slot_mapping, start, lengths, tables, restore = self._row_arrays(seqs, B, T, NB)
        saves = self._save_arrays(getattr(plan, "saves", ()), B, T, start, lengths, restore)
        batch = host_batch(tokens, start, lengths, tables, slot_mapping, restore, saves)
        sampling = SamplingMetadata.from_rows(seqs, B, self.history_width, self.cfg.vocab_size,
                                              self.eos_token_ids, self.seed)
        targets = None
        if plan.is_prefill and prompt_targets and any(prompt_targets):
            targets = np.zeros((B, T), np.int32)
            for i, t in enumerate(prompt_targets):
                targets[i, :len(t or ())] = t or ()
        return n, batch, sampling, targets

    def _row_arrays(self, seqs, B: int, T: int, NB: int, in_place: bool = False) -> tuple:
        """The rows as host arrays padded to B rows of T tokens (tokens, slot mapping, start positions, lengths,
        block tables; padding tokens write into block 0) and their `RestoreOps`, the linear-state ops checked first
        (fail closed; a one-token step, or one `in_place`, advances its states in their pool)."""
        tokens, slot_mapping = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
        start, lengths = np.zeros(B, np.int32), np.zeros(B, np.int32)
        tables = np.zeros((B, NB), np.int32)
        for i, s in enumerate(seqs):
            m = len(s.token_ids)
            tokens[i, :m], slot_mapping[i, :m] = s.token_ids, s.slot_mapping
            start[i], lengths[i] = s.start_pos, m
            tables[i, :len(s.block_table)] = s.block_table
        ops = [s.linear_op for s in seqs if s.linear_op is not None]
        if self.cfg.linear_layer_ids:
            if len(ops) != len(seqs):
                raise ValueError("every scheduled row of a model with GDN layers needs a LinearStateCacheOp")
            validate_cache_ops(ops, self.memory.num_linear_slots, in_place=in_place or T == 1)
        return tokens, slot_mapping, start, lengths, tables, RestoreOps.from_ops(ops, B)

    def _launch(self, batch: Batch, sampling: SamplingMetadata, targets, full_rows: bool) -> tuple:
        """Dispatches a `_prepare`d step and its sampling; returns their device results at once, while the device
        runs them (JAX dispatches asynchronously): (the packed samples[, prompt logprobs])."""
        if targets is not None:
            return self._run(batch, sampling, targets, full_rows, fn=self._prompt_fn)
        return self._run(batch, sampling)

    @staticmethod
    def _fetch(launched: tuple) -> tuple:
        """Waits for a launched step and returns its results as host arrays. `np.asarray` gives the same read-only
        view of the result buffer as `jax.device_get`, at a fraction of its cost."""
        return jax.tree.map(np.asarray, launched)

    def _collect(self, n: int, launched: tuple, full_rows: bool) -> StepResult:
        """A launched step's first n rows, on the host."""
        packed, *prompt = self._fetch(launched)
        sampled = (a[:n] for a in unpack_sampled(packed))
        if not prompt:
            return StepResult(*sampled)
        rows = prompt[0][4][:n] if full_rows else None
        return StepResult(*sampled, PromptLogprobs(*(a[:n] for a in prompt[0][:4]), rows))

    def _check_mixed(self, plan) -> None:
        """The whole-step checks of a mixed plan. It runs as its prefill sub-batch, then its decode sub-batch
        (`launch`): the two executables of the all-prefill and all-decode shapes, back to back on the same pools (so
        a mixed step compiles nothing new, and each row's result is bit for bit that of the same row scheduled in a
        step of its own kind). No decode row pads to the prefill length.

        The rows of the two sub-batches touch disjoint slots, which is checked here for the whole step before
        anything runs (fail closed): the linear-state ops of all rows together, no restore source that a decode row
        advances (it would be read after its write) or that a row of the one-token sub-batch reads from a live slot,
        and no checkpoint save into a slot a decode row reads or advances."""
        n = plan.num_prefill_rows
        ops = [s.linear_op for s in plan.seqs if s.linear_op is not None]
        if self.cfg.linear_layer_ids and len(ops) == len(plan.seqs):
            validate_cache_ops(ops, self.memory.num_linear_slots)
            linear_state_ids = {op.linear_state_id for op in ops}
            decode_linear_state_ids = {s.linear_op.linear_state_id for s in plan.decode_seqs}
            decode_restore_src_slot_ids = {s.linear_op.restore_src_slot_id for s in plan.decode_seqs
                                           if s.linear_op.is_warm_restore}
            for i, s in enumerate(plan.seqs):
                op = s.linear_op
                if op.is_warm_restore and op.restore_src_slot_id in (
                        linear_state_ids if i >= n else decode_linear_state_ids):
                    raise ValueError(f"row {i}: restore_src_slot_id {op.restore_src_slot_id} is a live slot that a "
                                     "decode row of this mixed step advances")
            decode_slot_ids = decode_linear_state_ids | decode_restore_src_slot_ids  # once, not once per save
            for sv in plan.saves:
                if sv.slot in decode_slot_ids:
                    raise ValueError(f"save into slot {sv.slot}: a decode row of this mixed step reads or advances it")

    # the step's functions by kind (`step_functions`, `replace_functions`): the attribute holding each
    _STEP_FUNCTION_ATTRS = {"prefill": "_fn", "decode": "_decode_fn", "decode_wide": "_decode_wide_fn",
                            "prompt": "_prompt_fn", "sample": "_sample", "fetch": "_fetch"}

    def step_functions(self) -> dict:
        """The functions a step calls, by kind: prefill, decode, decode_wide, prompt, sample (jitted) and fetch."""
        return {kind: getattr(self, attr) for kind, attr in self._STEP_FUNCTION_ATTRS.items()}

    def replace_functions(self, **functions) -> dict:
        """Puts `functions` (kind -> callable, the kinds of `step_functions`) in place of the step's own and returns
        those replaced, for profiling or stubbing. Warm-up's executables are dropped, so that every step calls them;
        a stand-in for a jitted function must pass on what the worker reads of it (its cache size)."""
        if unknown := sorted(set(functions) - set(self._STEP_FUNCTION_ATTRS)):
            raise ValueError(f"unknown step functions {unknown}: the kinds are {list(self._STEP_FUNCTION_ATTRS)}")
        replaced = {kind: getattr(self, self._STEP_FUNCTION_ATTRS[kind]) for kind in functions}
        for kind, fn in functions.items():
            setattr(self, self._STEP_FUNCTION_ATTRS[kind], fn)
        self._executables.clear()
        self._stored.clear()
        return replaced

    def padding_saves(self, rows: int, tokens: int):
        """The checkpoint-save arrays of a (rows, tokens) step that saves nothing; None for a shape without saves."""
        return self._save_arrays([], rows, tokens, None, None, RestoreOps.from_ops([], rows))
