"""`LLMEngine`, the step-level engine (vLLM's): requests added, one step scheduled and run at a time, aborts."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import numbers
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterable

import jax
import jax.numpy as jnp

from gdn_jax.config import EngineConfig, ModelConfig
from gdn_jax.diagnostics import user_stacklevel
from gdn_jax.engine.input_processor import (checkpoint_positions, model_eos_ids, model_sampling_defaults,
                                             prompt_hints, validate_request)
from gdn_jax.engine.output_processor import OutputProcessor, RequestState
from gdn_jax.engine.outputs import EngineFull, EngineStepError, RequestMetrics, RequestOutput
from gdn_jax.model.sharding import bytes_on_device, make_mesh, tp_config
from gdn_jax.model.weights import load_model, model_folder
from gdn_jax.tokenizer import get_tokenizer, text_stream
from gdn_jax.worker.compile_cache import enable_compilation_cache
from gdn_jax.worker.executable_store import StaleExecutable
from gdn_jax.worker.host_tier import CompressedStore, HostStore
from gdn_jax.worker.speculation import SpecWorker
from gdn_jax.worker.step import StepResult
from gdn_jax.worker.memory import default_memory_budget, plan_memory
from gdn_jax.worker.worker import Worker
from scheduler import SamplingParams, Scheduler, SchedulerConfig, Sequence
from scheduler.eviction import PrefillCost
from scheduler.sampling_params import SEED_BOUND


@contextlib.contextmanager
def _interrupts_held():
    """Holds back a Ctrl-C (SIGINT) that arrives inside the block, and hands it to its handler when the block ends
    (a KeyboardInterrupt raised there): for the engine's host work that must run to its end or leave its state half
    changed. Only the main thread receives signals, and only a Python handler can be held: elsewhere the block runs
    as it is."""
    if threading.current_thread() is not threading.main_thread() or not callable(handler := signal.getsignal(
            signal.SIGINT)):
        yield
        return
    held = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
        if held:
            handler(*held[0])


def _config_of(config: EngineConfig | str | os.PathLike | ModelConfig | None, **settings) -> EngineConfig:
    """The EngineConfig of `LLMEngine(config, **settings)` and `LLM(model, **settings)`: `config` itself with
    `settings` changed, or the config of the model `config` (a model name, a folder or a ModelConfig) and
    `settings`."""
    if isinstance(config, EngineConfig):
        return config.replace(**settings) if settings else config
    if config is not None:
        if "model" in settings:
            raise ValueError(f"the model is given twice: {config!r} and model={settings['model']!r}")
        settings["model"] = config
    return EngineConfig.create(**settings)


class LLMEngine:
    """Step-level engine: `add_request`, `step`, `abort_request`, `has_unfinished_requests`."""

    def __init__(self, config: EngineConfig | str | os.PathLike | ModelConfig | None = None, **settings):
        """`config`: an EngineConfig (with `settings` changing some of its fields), or the model (the `model` field;
        a preset name, a model folder or a ModelConfig) with the other settings as keywords:
        `LLMEngine("tiny", chunk_stride=64, max_num_seqs=8)`. An unknown setting is a ValueError naming it."""
        self.config = config = _config_of(config, **settings)
        cache, sched = config.cache, config.scheduling
        dtype = getattr(jnp, config.dtype)  # jnp.float32, jnp.bfloat16
        enable_compilation_cache(config.compile.compilation_cache_dir)
        tp, ep = config.tensor_parallel_size, config.expert_parallel_size
        self.mesh = make_mesh(tp, ep) if tp * ep > 1 else None  # (no devices enough: an error before the model loads)
        self.cfg, graphdef, params = load_model(config.model, dtype=dtype, seed=config.seed, mesh=self.mesh,
                                                mtp=config.speculative_config is not None)
        model_cfg = tp_config(self.cfg, tp, ep)  # the config of the model as the worker runs it (its mesh layout)
        if sched.max_model_len > self.cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {sched.max_model_len} exceeds the model's max_position_embeddings "
                             f"{self.cfg.max_position_embeddings}")
        folder = self.model_folder = model_folder(config.model)  # None for presets and configs
        self.tokenizer = get_tokenizer(folder, self.cfg.vocab_size, self.cfg.eos_token_id)
        # the folder's other end-of-sequence ids end a request as stop tokens unless ignore_eos (vLLM's way)
        self.extra_eos_ids = [t for t in model_eos_ids(folder, self.cfg.vocab_size) if t != self.cfg.eos_token_id]
        # SamplingParams keywords of the model's recommended sampling (generation_config="auto")
        self.default_sampling = model_sampling_defaults(folder) if config.generation_config == "auto" else {}
        has_linear = bool(self.cfg.linear_layer_ids)
        budget = cache.memory_budget_bytes
        if budget is None and (cache.num_kv_blocks is None or cache.num_linear_slots is None):  # else unused
            on = {} if self.mesh is None else {"device": self.mesh.devices.flat[0]}  # (one of the mesh's: each alike)
            params_bytes = bytes_on_device(params, on.get("device", jax.devices()[0]))
            budget = default_memory_budget(params_bytes, cache.gpu_memory_utilization, **on)
        self.memory = plan_memory(model_cfg, config, budget, devices=tp)
        self.scheduler_config = SchedulerConfig(
            num_kv_blocks=self.memory.num_kv_blocks, num_linear_slots=self.memory.num_linear_slots,
            block_size=cache.block_size, chunk_stride=cache.chunk_stride, max_num_seqs=sched.max_num_seqs,
            max_model_len=sched.max_model_len, max_num_batched_tokens=config.token_budget,
            enable_prefix_caching=cache.enable_prefix_caching, has_linear_attention_layers=has_linear,
            state_fingerprint=f"{self.cfg.fingerprint()}:{config.dtype}", eos_token_id=self.cfg.eos_token_id,
            unsafe_reuse=cache.unsafe_reuse, checkpoint_mode=cache.checkpoint_mode,
            checkpoint_policy=cache.checkpoint_policy, mixed_steps=sched.mixed_steps,
            new_request_steps=sched.new_request_steps,
            max_running_per_request=sched.max_running_per_request, async_scheduling=sched.async_scheduling,
            checkpoint_eviction=cache.checkpoint_eviction, eviction_alpha=cache.eviction_alpha,
            checkpoint_placement=cache.checkpoint_placement,
            num_host_checkpoints=(cache.host_checkpoint_bytes // self.memory.bytes_per_linear_slot
                                  if self.memory.bytes_per_linear_slot else 0) + self.memory.num_compressed_checkpoints,
            offload_checkpoints=self.memory.num_compressed_checkpoints > 0,
            num_speculative_tokens=config.num_speculative_tokens,
            prefill_cost=PrefillCost(*self.cfg.prefill_flops()))
        if cache.unsafe_reuse is not None:
            warnings.warn(f"unsafe_reuse={cache.unsafe_reuse!r}: reusing KV matches with a {cache.unsafe_reuse} GDN "
                          f"state; outputs drift from the model's (an ablation for accuracy studies only)",
                          stacklevel=user_stacklevel())
        self.scheduler = Scheduler(self.scheduler_config)
        # the tier's entries: on the host (`host_checkpoint_bytes`), or compressed on the device (`checkpoint_dtype`)
        self.host_store = (CompressedStore(cache.checkpoint_dtype) if self.memory.num_compressed_checkpoints else
                           HostStore())
        eos = [] if self.cfg.eos_token_id is None else [self.cfg.eos_token_id]
        self.worker = (SpecWorker if config.speculative_config is not None else Worker)(
            model_cfg, graphdef, params, self.memory, config, eos_token_ids=tuple(eos + self.extra_eos_ids),
            mesh=self.mesh)
        self.output_processor = OutputProcessor(self.tokenizer, self.cfg.eos_token_id,
                                                lambda seq_id: self.scheduler.abort(seq_id))
        if config.verbose:
            print(f"[gdn_jax] {self.cfg.name}: {self.memory.describe()}", file=sys.stderr)
        caches_linear = cache.enable_prefix_caching and has_linear
        if caches_linear and cache.chunk_stride > sched.max_model_len:  # (a step profile needs no cache)
            warnings.warn(f"chunk_stride ({cache.chunk_stride}) exceeds max_model_len ({sched.max_model_len}): no "
                          f"sequence reaches a checkpoint boundary, so the prefix cache will never reuse a token",
                          stacklevel=user_stacklevel())
        room = self.memory.num_checkpoint_slots + self.memory.num_compressed_checkpoints
        if caches_linear and room < sched.max_num_seqs:
            warnings.warn(f"only {room} checkpoint slots for {sched.max_num_seqs} "
                          f"sequences: under full concurrency most boundaries cannot be saved",
                          stacklevel=user_stacklevel())
        self._requests: dict[str, RequestState] = {}
        self._by_seq: dict[int, RequestState] = {}
        self._undelivered: dict[str, RequestOutput] = {}  # outputs of a step an interrupt ended: the next step's
        self._seq_ids = itertools.count(1)
        self.max_model_len = sched.max_model_len
        self.last_step_info: dict = {}
        self._ahead: tuple | None = None  # async scheduling: (the plan launched ahead, its `_launch` handle)
        self._planned_ahead = None  # the plan postprocessed ahead whose samples are not resolved yet

    # ---- requests -------------------------------------------------------------------------------------------
    def validate_request(self, prompt, sampling_params: SamplingParams | None = None):
        """Checks a request without touching the engine; returns (text, token ids, params) or raises ValueError."""
        params = self.default_sampling_params() if sampling_params is None else sampling_params
        checked = validate_request(prompt, params, tokenizer=self.tokenizer, vocab_size=self.cfg.vocab_size,
                                   extra_eos_ids=self.extra_eos_ids, max_model_len=self.max_model_len,
                                   block_size=self.scheduler_config.block_size)
        n = checked[2].n
        for name in ("max_seqs_per_request", "max_waiting_sequences"):  # (past the second it could never be queued)
            bound = getattr(self.config.scheduling, name)
            if bound is not None and n > bound:
                raise ValueError(f"n={n}: a request may add at most {bound} sequences ({name}={bound})")
        return checked

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, *, sampling_params: SamplingParams | None = None,
                    queue_group: str | None = None) -> None:
        """Validates everything before anything runs: a bad request raises ValueError and changes nothing.
        `params` is vLLM's name; `sampling_params=` is taken too. `arrival_time` is on `time.perf_counter()`'s clock
        (default: now), as every time in `RequestMetrics`. Requests of one `queue_group` take one turn together in
        the waiting queue (the server groups the prompts of one HTTP request), so a client's flood of prompts
        waits behind itself, not in front of everyone else."""
        if sampling_params is not None:
            if params is not None:
                raise ValueError("give the sampling parameters once: params or sampling_params, not both")
            params = sampling_params
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a str, got {request_id!r}")
        if arrival_time is not None and (isinstance(arrival_time, bool) or not isinstance(arrival_time, numbers.Real)
                                         or not math.isfinite(arrival_time)):
            raise ValueError(f"arrival_time must be a finite number on time.perf_counter()'s clock, got "
                             f"{arrival_time!r}")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        text, ids, params = self.validate_request(prompt, params)
        limit = self.config.scheduling.max_waiting_sequences
        if limit is not None:  # the waiting queue and the samples waiting to fork
            waiting = len(self.scheduler.seqs) - len(self.scheduler.running)
            if waiting + params.n > limit:
                raise EngineFull(waiting, params.n, limit)
        # sample i of n draws with seed (seed + i) mod 2**32 (vLLM's derivation): sample 0 is the request itself
        params_of = [dataclasses.replace(params, n=1,
                                         seed=None if params.seed is None else (params.seed + i) % SEED_BOUND)
                     for i in range(params.n)]
        seqs = [Sequence(next(self._seq_ids), ids, params_of[0])]
        seqs[0].checkpoint_positions = checkpoint_positions(  # (its samples compute no part of the prompt they hint)
            prompt_hints(prompt).get("checkpoint_positions"), len(ids), self.scheduler_config.block_size)
        seqs += [seqs[0].sample(next(self._seq_ids), p) for p in params_of[1:]]  # the prompt converted once
        arrival = time.perf_counter() if arrival_time is None else float(arrival_time)
        req = RequestState(request_id, text, seqs, RequestMetrics(arrival),
                           [[] if params.logprobs is not None else None for _ in seqs], [0.0] * len(seqs),
                           prompt_logprobs=[None] * len(ids) if params.prompt_logprobs is not None else None,
                           texts=[""] * len(seqs), stop_reasons=[None] * len(seqs), stop_from=[0] * len(seqs),
                           streams=[text_stream(self.tokenizer) for _ in seqs], prompt_token_ids=list(ids))
        # the engine knows the request before the scheduler does: interrupted after the scheduler's `add` (Ctrl-C),
        # it is an ordinary request of the engine, which `abort_request` removes, not a sequence no step can look up
        self._requests[request_id] = req
        self._by_seq.update((seq.seq_id, req) for seq in seqs)
        try:
            with _interrupts_held():  # half-added, a sample would be in no queue the scheduler or an abort reads
                self.scheduler.add(seqs[0], forks=seqs[1:], group=queue_group)
        except BaseException:
            if not any(seq.seq_id in self.scheduler.seqs for seq in seqs):  # refused, or interrupted before it began
                del self._requests[request_id]
                for seq in seqs:
                    self._by_seq.pop(seq.seq_id, None)
            raise

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Aborts one request or several (an id, or an iterable of ids, as vLLM's engines take them); an id not in
        the engine (unknown, or finished already) is ignored. An aborted request gives no further output."""
        if isinstance(request_id, str) or not isinstance(request_id, Iterable):
            request_id = [request_id]
        with _interrupts_held():  # half-aborted, a request would hold its slots with no one to free them
            for rid in list(request_id):
                self._abort(rid)

    def _abort(self, request_id: str) -> None:
        self._undelivered.pop(request_id, None)
        req = self._requests.pop(request_id, None)
        if req is not None:
            for seq in reversed(req.seqs):  # samples waiting for their fork first, then the one they fork from
                self._by_seq.pop(seq.seq_id, None)
                self.scheduler.abort(seq.seq_id)

    def default_sampling_params(self) -> SamplingParams:
        """The parameters of a request given none: the model's recommended sampling (`default_sampling`) over
        SamplingParams' defaults."""
        return SamplingParams(**self.default_sampling)

    def has_unfinished_requests(self) -> bool:
        """(Also while a step planned ahead runs whose requests have all finished: the next step reads it out.)"""
        return self.scheduler.has_unfinished() or bool(self._undelivered) or self._ahead is not None

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def seq_id_of(self, request_id: str) -> int | None:
        """The scheduler's sequence id of an unfinished request (to match it against a step plan)."""
        req = self._requests.get(request_id)
        return None if req is None else req.seq.seq_id

    # ---- stepping -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules and runs one step; returns an output for every request that got a token or finished.

        An interrupt (Ctrl-C) may land anywhere. While the device step is prepared, runs or is read back it stops the
        step, which is then recomputed (`_abandon_step`); the host's work before and after it (planning; advancing
        the sequences and building the outputs) is held to its end and the interrupt raised after it, and the
        outputs of a step so interrupted come with the next step's (`has_unfinished_requests` stays true until
        they did)."""
        try:
            plan, launched = self._take_ahead()
            if plan is None:
                with _interrupts_held():  # planning takes a moment: half-planned, the scheduler would hold no queue
                    plan = self.scheduler.schedule()
                launched = None if plan is None else self._launch(plan)
            ahead = launched is not None and self._plan_ahead(plan, launched)
            ran = None if launched is None else self._collect(plan, launched)
            if ran is not None:
                with _interrupts_held():  # half-postprocessed, some live slots would be a step ahead of their rows
                    outputs, broken = self._postprocess(plan, *ran, ahead=ahead)
                    self._planned_ahead = None
                    for out in outputs:
                        self._undelivered.pop(out.request_id, None)  # this one holds everything the older one did
                        self._undelivered[out.request_id] = out
                    if broken:  # the others' outputs come with the next step (`has_unfinished_requests` stays true)
                        reqs, errors = zip(*broken.values())
                        self._end_with_error(list(reqs), errors[0], step_failed=False)
        except EngineStepError:  # the step raised, or the host's work for some of its requests: those ended
            raise
        except Exception as exc:
            # planning raised (a request's postprocess raising is `_end_with_error`'s)
            if self.scheduler.inflight is None and self._planned_ahead is None:
                raise
            # raised between the planning and the postprocess, outside the worker (recording prompt logprobs, say):
            # the step's requests fail as if the device step had, nothing of the step is indexed (the device may
            # not have run it), and the engine goes on; the plan left in flight made every later step fail
            self._fail_step(self.scheduler.inflight, exc)
        except BaseException:  # e.g. Ctrl-C while the device step ran
            self._abandon_step()
            raise
        outputs, self._undelivered = list(self._undelivered.values()), {}
        return outputs

    def _postprocess(self, plan, result, sampled: list, ahead: bool = False) -> tuple[list[RequestOutput], dict]:
        """The host's part of a step that ran: the scheduler advances its sequences, the requests record their
        tokens, logprobs and text; returns their outputs (finished requests leave the engine) and {request: what
        it raised} for the requests whose own part raised (a defect of the host's code, a tokenizer's error): the
        step went on for the others, and `step` ends those with "error" (`_end_with_error`). `ahead`: the scheduler
        advanced the plan's sequences already (`_plan_ahead`), and only appends their samples now."""
        drafts = (None if result.drafts is None else
                  [None if d[0] < 0 else d.tolist() for d in result.drafts])  # (-1: no drafts)
        kept = None  # the rows whose samples count: all, but a row planned ahead for a sample that ended meanwhile
        if ahead:
            kept = self.scheduler.resolve(plan, sampled)
        else:
            self.scheduler.postprocess(plan, sampled, drafts)  # (a list of samples is cut after a finishing token)
        now = time.perf_counter()
        touched: dict[str, tuple[RequestState, list[int]]] = {}  # one output per request: the samples that stepped
        broken: dict[str, tuple[RequestState, Exception]] = {}
        for i, s in enumerate(plan.seqs):
            req = self._by_seq.get(s.seq_id)
            if req is None or not s.sample or req.request_id in broken or kept is not None and i not in kept:
                continue
            try:
                index = req.index(s.seq_id)
                if result.accepted is None:
                    self.output_processor.record_token(req, index, sampled[i], result, i, now)
                else:  # the samples at a row's positions that the scheduler kept
                    for j, token in enumerate(sampled[i]):
                        self.output_processor.record_token(req, index, token, result, i * result.positions + j, now)
                self.output_processor.update_text(req, index, now)
            except Exception as exc:
                broken[req.request_id] = req, exc
                touched.pop(req.request_id, None)
                continue
            touched.setdefault(req.request_id, (req, []))[1].append(index)
        outputs = []
        for req, changed in touched.values():
            req.metrics.num_preemptions = sum(s.num_preemptions for s in req.seqs)  # once per request, not per row
            req.metrics.spec_draft_tokens = sum(s.num_draft_tokens for s in req.seqs)
            req.metrics.spec_accepted_tokens = sum(s.num_accepted_tokens for s in req.seqs)
            if req.is_finished:
                req.metrics.finished_time = now
            if req.final_only and not req.is_finished:
                continue  # an output copies everything so far: built per step, that grew with the output
            try:
                out = self.output_processor.make_output(req, None if req.final_only else changed)
            except Exception as exc:
                broken[req.request_id] = req, exc
                continue
            outputs.append(out)
            if req.is_finished:
                self._requests.pop(req.request_id, None)
                for seq in req.seqs:
                    self._by_seq.pop(seq.seq_id, None)
        return outputs, broken

    def _launch(self, plan, feed=None) -> tuple | None:
        """Dispatches `plan` on the worker: (its `Worker.launch` handle, or step by step its `StepResult`; the rows'
        prompt-logprob targets or None), or None when the step is to be recomputed (a stale executable). `feed`: the
        handle of the step before, whose samples are this plan's pending tokens (async scheduling). A step that
        raises is failed here (`_fail_step`)."""
        now = time.perf_counter()
        for s in plan.seqs:
            m = self._by_seq[s.seq_id].metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
        targets = ([self.output_processor.prompt_targets(self._by_seq[s.seq_id], s) for s in plan.seqs]
                   if plan.is_prefill else None)
        full = any(t is not None and self._by_seq[s.seq_id].seq.sampling_params.prompt_logprobs == -1
                   for s, t in zip(plan.seqs, targets or ()))
        targets = targets if targets and any(targets) else None
        try:
            if plan.host_ops:  # the host tier's copies, before the step
                self.worker.state = self.host_store.apply(self.worker.state, plan.host_ops)
            if self.config.scheduling.async_scheduling:
                return self.worker.launch(plan, targets, full, feed=feed), targets
            # step by step: the worker runs the plan and waits for its results here (`_collect` takes them)
            return (self.worker.execute(plan, targets, full) if targets else self.worker.execute(plan)), targets
        except StaleExecutable:  # (the worker warned) the step is recomputed with that shape compiled again
            self._redo_step()
        except Exception as exc:
            self._fail_step(self.scheduler.inflight, exc)  # raises EngineStepError
        return None

    def _plan_ahead(self, plan, launched: tuple) -> bool:
        """Async scheduling: while the device runs `plan`, its sequences advance with their samples pending and the
        next step is planned and launched, its pending tokens taken from `plan`'s results on the device (`_ahead`);
        the next `step` takes it. Whether it did: not where the scheduler cannot plan ahead of `plan`
        (`Scheduler.can_look_ahead`) or a row of it scores prompt logprobs."""
        if launched[1] is not None or not self.scheduler.can_look_ahead(plan):
            return False
        with _interrupts_held():
            self._planned_ahead = plan
            self.scheduler.postprocess(plan, None, ahead=True)
            following = self.scheduler.schedule()
        if following is not None and (handle := self._launch(following, feed=launched[0])) is not None:
            self._ahead = following, handle
        return True

    def _take_ahead(self) -> tuple:
        """The plan launched ahead and its handle, or (None, None): none, or its step was failed or redone since."""
        ahead, self._ahead = self._ahead, None
        return ahead if ahead is not None and ahead[0] is self.scheduler.inflight else (None, None)

    def _collect(self, plan, launched: tuple) -> tuple | None:
        """Waits for a launched step: (its result, the token sampled per row, None where a row samples none), or None
        when the step is to be recomputed (a stale executable). A step that raises is failed here (`_fail_step`)."""
        handle, targets = launched
        try:
            result = handle if isinstance(handle, StepResult) else self.worker.collect(handle)
        except StaleExecutable:
            self._redo_step()
            return None
        except Exception as exc:
            self._fail_step(self.scheduler.inflight, exc)
        if result.prompt is not None:
            for i, (s, t) in enumerate(zip(plan.seqs, targets)):
                if t is not None:
                    self.output_processor.record_prompt_logprobs(self._by_seq[s.seq_id], s.start_pos, t,
                                                                result.prompt, i)
        self.last_step_info = {
            "is_prefill": plan.is_prefill, "decode_rows": len(plan.decode_seqs), "rows": len(plan.seqs),
            "tokens": sum(len(s.token_ids) for s in plan.seqs),
            "warm_restores": sum(1 for s in plan.seqs if s.linear_op is not None and s.linear_op.restores_checkpoint),
            "forks": sum(1 for s in plan.seqs if s.linear_op is not None and s.linear_op.fork)}
        if result.accepted is None:
            sampled = [int(result.tokens[i]) if s.sample else None for i, s in enumerate(plan.seqs)]
        else:  # a row's samples up to its first that differs from its draft: one more than the drafts accepted
            P = result.positions
            sampled = [result.tokens[i * P:i * P + int(result.accepted[i]) + 1].tolist() if s.sample else None
                       for i, s in enumerate(plan.seqs)]
        return result, sampled

    def _redo_step(self) -> None:
        """The step in flight is recomputed from fresh pools (`Scheduler.redo_step`), and so is a plan postprocessed
        ahead (`_plan_ahead`) with none after it in flight."""
        inflight, ahead, self._ahead, self._planned_ahead = self.scheduler.inflight, self._planned_ahead, None, None
        if inflight is not None:
            self.scheduler.redo_step(inflight)
        elif ahead is not None:
            self.scheduler.drop_device_state()
        self.worker.reset_state()

    def _abandon_step(self) -> None:
        """A step was interrupted between its planning and its postprocess (a KeyboardInterrupt, or any other
        BaseException, wherever it landed: the device may have advanced its rows' live slots and written its
        checkpoints, or consumed the donated pools, and no result was kept). Nothing of it is kept and no request
        fails: every running request is preempted and computed again, so that the next step computes from a state
        the scheduler describes. The prefix cache stays while the worker holds its pools (those before the step or
        after it: the step wrote nothing the cache indexes, `Scheduler.redo_step`), so the requests match it again;
        if the pools were consumed, they are rebuilt and the cache is emptied. With no step in flight (it was
        postprocessed, failed or redone, or never planned) only pools that a failed step consumed and the interrupt
        kept from being rebuilt are replaced."""
        ahead, self._ahead, self._planned_ahead = self._planned_ahead, None, None
        if self.scheduler.inflight is not None:  # (after a plan postprocessed ahead, from nothing: `_redo_step`)
            self.scheduler.redo_step(self.scheduler.inflight, pools_kept=not self.worker.state_lost() and ahead is None)
        elif self.worker.state_lost() or ahead is not None:  # interrupted in `_fail_step` or a redo, before the
            self.scheduler.drop_device_state()                # pools were rebuilt; or after a plan postprocessed ahead
        if self.worker.state_lost() or ahead is not None:
            self.worker.reset_state()

    def _fail_step(self, plan, exc: Exception) -> None:
        """Finish the step's requests with "error" (every sample of them), release what they held, and re-raise as an
        EngineStepError. If the failure consumed the donated device state, the pools are rebuilt and every other
        running request is recomputed from scratch (the prefix cache is emptied), so the engine keeps serving."""
        ahead, self._ahead, self._planned_ahead = self._planned_ahead, None, None
        failed = self.scheduler.fail_step(plan) if plan is not None else []
        if ahead is not None:  # async scheduling: its samples will not come, and its checkpoints were indexed
            failed += self.scheduler.fail_pending(ahead, step_counted=plan is not None)
        if self.worker.state_lost() or ahead is not None:
            self.scheduler.drop_device_state()
            self.worker.reset_state()
        reqs = {}
        for seq in failed:
            req = self._by_seq.get(seq.seq_id)
            if req is not None:
                reqs[req.request_id] = req
        self._end_with_error(list(reqs.values()), exc)

    def _end_with_error(self, reqs: list[RequestState], exc: Exception, step_failed: bool = True) -> None:
        """Finish `reqs` with "error" (every sample; the unfinished ones leave the scheduler, which frees their slots
        and blocks as for any finish) and raise an EngineStepError with their final outputs."""
        if not step_failed:  # a failed step's samples are counted by `Scheduler.fail_step`
            self.scheduler.counters["failed_requests"] += sum(len(req.seqs) for req in reqs)
        now, text = time.perf_counter(), f"{type(exc).__name__}: {exc}"
        outputs = []
        for req in reqs:
            for seq in req.seqs:  # the request's other samples end with it
                if not seq.is_finished:
                    self.scheduler.abort(seq.seq_id)
                seq.finish_reason = "error"
                self._by_seq.pop(seq.seq_id, None)
            self._requests.pop(req.request_id, None)
            self._undelivered.pop(req.request_id, None)  # an interrupted step's output would come after the error
            req.error, req.metrics.finished_time = text, now
            outputs.append(self.output_processor.make_output(req))
        raise EngineStepError([o.request_id for o in outputs], outputs, exc, step_failed) from exc

    def decode_token(self, token_id: int) -> str:
        """One id's text alone, as vLLM shows a logprob's token: a special token's text kept."""
        return self.output_processor.decode_token(token_id)

    def warm_up(self, prompt_logprobs: bool = False) -> int:
        """Compiles every step shape now, so that no request pays a compilation later. The prompt-logprobs variant
        of the prefill shapes is compiled lazily (on the first step that has such a row) unless `prompt_logprobs`."""
        resets = self.worker.state_resets
        try:
            return self.worker.warm_up(prompt_logprobs)
        finally:
            if self.worker.state_lost():  # interrupted (Ctrl-C) after a step consumed the pools, before they were kept
                self.worker.reset_state()
            if self.worker.state_resets != resets:  # a stored executable failed on the pools (`Worker._drop_stale`)
                self.scheduler.drop_device_state()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached KV block and checkpoint no running request uses (e.g. between A/B rounds). Returns
        True when the prefix cache is then empty, False when running requests still hold part of it (as vLLM's)."""
        return self.scheduler.reset_prefix_cache()

    # ---- statistics -----------------------------------------------------------------------------------------
    def cache_stats(self) -> dict:
        stats = dict(self.scheduler.stats())
        stats["compilations"] = self.worker.num_compilations
        q = stats.get("queries", 0)
        stats["hit_rate"] = stats.get("hits", 0) / q if q else 0.0
        return stats
