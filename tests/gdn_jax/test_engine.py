"""Engine behaviour: pressure (eviction, preemption), transformers' greedy, compile count, bad input."""

import dataclasses
import signal

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from gdn_jax import LLM, EngineStepError, LLMEngine, SamplingParams
from tests.gdn_jax.helpers import FIXTURE, random_ids

pytestmark = pytest.mark.engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, logprobs=1, ignore_eos=True)

# The engines of this file (and of test_fork_engine, test_sampling and test_sampling_engine) share one geometry, so
# that they share compiled step shapes: in this process, and through the persistent cache `make test` turns on.
KW = dict(block_size=16, chunk_stride=32, max_num_seqs=4, max_model_len=128, verbose=False)


def _pressure_workload():
    rng = np.random.default_rng(5)
    system = random_ids(rng, 64)
    return [system + random_ids(rng, int(n)) for n in rng.integers(5, 60, 10)] + [random_ids(rng, 90) for _ in range(3)]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_under_pressure_all_complete_identically_and_nothing_leaks():
    prompts = _pressure_workload()
    roomy = LLM("tiny-random", enable_prefix_caching=False, **KW)
    # 9 usable KV blocks: one 128-token sequence needs 8, so four running sequences must preempt each other;
    # 7 slots: 4 live + 2 checkpoints, so checkpoints are evicted
    tight = LLM("tiny-random", enable_prefix_caching=True, num_kv_blocks=10, num_linear_slots=7, **KW)
    expect = _tokens(roomy.generate(prompts, GREEDY, use_tqdm=False))
    serial = [tight.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts[:4]]
    concurrent = tight.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(serial) == expect[:4]
    assert _tokens(concurrent) == expect
    s = tight.cache_stats()
    assert s["preemptions"] > 0 and s["checkpoints_evicted"] > 0 and s["kv_blocks_evicted"] > 0
    assert s["hits"] > 0
    assert s["live_slots"] == 0 and s["num_running"] == 0
    assert s["free_slots"] + s["checkpoint_slots"] == 7 - 1
    # every block is allocatable again (never-cached or cached-and-unreferenced); some hold cached prefixes
    assert s["kv_blocks_free"] == 10 - 1 and 0 < s["kv_blocks_cached"] <= 10 - 1
    tight.engine.scheduler.check_invariants()


def test_engine_greedy_equals_transformers_generate():
    ref = np.load(FIXTURE / "reference.npz")
    llm = LLM(str(FIXTURE), max_model_len=128, max_num_seqs=2, verbose=False)
    n = int(ref["greedy_prompt_len"])
    out = llm.generate({"prompt_token_ids": ref["prompt_ids"][:n].tolist()},
                       SamplingParams(temperature=0.0, max_tokens=len(ref["greedy_ids"]), ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref["greedy_ids"].tolist()


def test_no_recompilation_after_warm_up():
    """`LLM.warm_up` compiles every step shape: no workload compiles afterwards, so no TTFT includes a compilation."""
    llm = LLM("tiny-random", **KW)
    # rows {1,2,4} x tokens {1,16,32,64,128} ("scan": a prefill row holds up to max_model_len) x blocks {8}
    assert llm.warm_up() == 3 * 5 * 1
    warm = llm.cache_stats()["compilations"]  # shapes another engine in this process compiled are shared
    rng = np.random.default_rng(9)

    def mixed_workload():  # shared prefixes, varied lengths, concurrent and serial, prefill + decode
        system = random_ids(rng, 50)
        batch = [system + random_ids(rng, int(n)) for n in rng.integers(1, 50, 6)] + [random_ids(rng, int(rng.integers(1, 40)))]
        llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=int(rng.integers(3, 12))), use_tqdm=False)
        for p in batch[:3]:
            llm.generate([p + random_ids(rng, 20)], SamplingParams(temperature=0.7, max_tokens=5), use_tqdm=False)

    for _ in range(3):
        mixed_workload()
    assert llm.cache_stats()["compilations"] == warm
    assert llm.cache_stats()["hits"] > 0


@pytest.fixture(scope="module")
def engine():
    return LLMEngine("tiny-random", **KW)


@pytest.fixture(autouse=True)
def shared_engines_left_idle(request):
    """The module's engines (`engine`, `llm`) serve many tests: one that fails half way (or forgets a request) would
    leave requests that later tests see, and they would fail too. After each test its requests are aborted and the
    engine drained, and a test that passed with requests left fails here, naming them."""
    yield
    for name in ("engine", "llm"):
        if name not in request.fixturenames:
            continue
        obj = request.getfixturevalue(name)
        eng = obj.engine if name == "llm" else obj
        left = sorted(eng._requests)
        eng.abort_request(left)
        while eng.has_unfinished_requests():
            eng.step()
        assert not left, f"the test left requests {left} in the shared `{name}`"


@pytest.mark.parametrize("prompt, params, message", [
    ([], None, "empty prompt"),
    ("", None, "empty prompt"),
    ([5, 600, 7], None, "token id 600 outside the vocabulary"),
    ([5, -1], None, "token id -1 outside the vocabulary"),
    ([5, 2.0], None, r"token ids must be ints, got 2.0 \(float\)"),
    ([5, True], None, r"token ids must be ints, got True \(bool\)"),
    (list(range(4, 133)), None, "longer than max_model_len"),
    ({"prompt": 123}, None, "'prompt' must be a str, got int"),
    ({"prompt": None}, None, "'prompt' must be a str, got NoneType"),
    ({"prompt": b"x"}, None, "'prompt' must be a str, got bytes"),
    ({"prompt_token_ids": [5, 6], "prompt": 7}, None, "'prompt' must be a str, got int"),
    ({"prompt_token_ids": 5}, None, "'prompt_token_ids' must be a list of token ids, got int"),
    ({"prompt_token_ids": None}, None, "'prompt_token_ids' must be a list of token ids, got NoneType"),
    ({"prompt": "ab", "multi_modal_data": {"image": None}}, None,
     "'checkpoint_positions' only, got 'multi_modal_data'"),
    ({"prompt": "ab", "prompt_token_id": [5, 6]}, None, "'checkpoint_positions' only, got 'prompt_token_id'"),
    (np.array(5), None, "must be a list of token ids, got a 0-D array"),
    (np.array([[5, 6]]), None, "must be a list of token ids, got a 2-D array"),
    ([5, 6], "max_tokens=0", "max_tokens"),
    ([5, 6], "temperature=-1", "temperature"),
    ([5, 6], "top_p=0", "top_p"),
    ([5, 6], "top_p=1.5", "top_p"),
])
def test_bad_input_is_rejected_and_the_engine_keeps_serving(engine, prompt, params, message):
    rng = np.random.default_rng(1)
    good = random_ids(rng, 40)
    engine.add_request("good", good, SamplingParams(temperature=0.0, max_tokens=4))
    engine.step()  # the good request is in flight when the bad one arrives
    with pytest.raises(ValueError, match=message):
        if params is None:
            engine.add_request("bad", prompt, SamplingParams(max_tokens=4))
        else:
            engine.add_request("bad", prompt, eval(f"SamplingParams({params})"))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert list(finished) == ["good"] and len(finished["good"].outputs[0].token_ids) == 4


@pytest.mark.parametrize("request_id, arrival_time, message", [
    (["id"], None, r"request_id must be a str, got \['id'\]"),
    (5, None, "request_id must be a str, got 5"),
    (None, None, "request_id must be a str, got None"),
    ("late", "now", "arrival_time must be a finite number"),
    ("late", float("nan"), "arrival_time must be a finite number"),
    ("late", True, "arrival_time must be a finite number"),
])
def test_a_bad_request_id_or_arrival_time_is_named_and_changes_nothing(engine, request_id, arrival_time, message):
    """Caught where the request is added, not later where its metrics are read (a str arrival time broke TTFT)."""
    with pytest.raises(ValueError, match=message):
        engine.add_request(request_id, [5, 6], SamplingParams(max_tokens=2), arrival_time=arrival_time)
    assert not engine.has_unfinished_requests() and not engine._requests


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_size=16, chunk_stride=40), "chunk_stride"),
    (dict(max_num_seqs=8, num_linear_slots=8), "num_linear_slots=8 leaves no room for a checkpoint"),
    (dict(max_num_seqs=8, num_linear_slots=9), "num_linear_slots=9 leaves no room for a checkpoint"),
    (dict(max_num_seqs=8, memory_budget_bytes=1 << 16), "linear-state slots"),
    (dict(dtype="float16"), "dtype"),
    (dict(memory_budget_bytes=1.5e6), r"memory_budget_bytes must be an int, got 1500000.0 \(float\)"),
    (dict(num_kv_blocks=300.0), "num_kv_blocks must be an int"),
    (dict(max_num_batched_tokens=64.5), "max_num_batched_tokens must be an int"),
    (dict(block_size=16.0), "block_size must be an int"),
    (dict(max_num_seqs=True), "max_num_seqs must be an int, got True"),
    (dict(gpu_memory_utilization="0.5"), "gpu_memory_utilization must be a number"),
    (dict(seed=None), "seed must be an int"),
    (dict(seed=1 << 32), r"seed must be in \[0, 2\*\*32\), got 4294967296"),  # was the model of seed 0
    (dict(seed=-1), r"seed must be in \[0, 2\*\*32\), got -1"),
    (dict(model=3), r"model must be a model name, a folder or a ModelConfig, got 3 \(int\)"),
    (dict(enable_prefix_caching="no"), "enable_prefix_caching must be a bool, got 'no'"),  # was read as True
    (dict(mixed_steps="false"), "mixed_steps must be a bool, got 'false'"),
])
def test_invalid_cache_configuration_is_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(kwargs.pop("model", "tiny-random"), max_model_len=64, verbose=False, **kwargs)


def test_a_chunk_stride_no_sequence_reaches_is_warned():
    """The prefix cache of such an engine never saves a checkpoint (every "cache on" cell of a study read 0 reused
    tokens); an engine that only profiles a step needs none, so it is a warning."""
    with pytest.warns(UserWarning, match=r"chunk_stride \(128\) exceeds max_model_len \(64\): no sequence reaches a "
                                         r"checkpoint boundary"):
        LLM("tiny-random", max_model_len=64, chunk_stride=128, verbose=False)


def test_numpy_token_ids_are_accepted(engine):
    ids = np.arange(10, 40, dtype=np.int64)
    engine.add_request("np", ids, SamplingParams(temperature=0.0, max_tokens=2))
    engine.add_request("np-dict", {"prompt_token_ids": ids.astype(np.int32)}, SamplingParams(temperature=0.0,
                                                                                          max_tokens=2))
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outs["np"].prompt_token_ids == outs["np-dict"].prompt_token_ids == list(range(10, 40))
    assert outs["np"].outputs[0].token_ids == outs["np-dict"].outputs[0].token_ids


def test_abort_releases_everything(engine):
    engine.add_request("a", list(range(4, 70)), SamplingParams(max_tokens=20))
    engine.step()
    engine.abort_request("a")
    assert not engine.has_unfinished_requests()
    s = engine.cache_stats()
    assert s["live_slots"] == 0 and s["num_running"] == 0


def test_add_and_abort_take_vllms_forms(engine):
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params=sp)             # vLLM's keyword
    engine.add_request("b", [5, 6, 8], sampling_params=sp)    # this engine's former one
    engine.add_request("c", [5, 6, 9], sp)
    with pytest.raises(ValueError, match="params or sampling_params, not both"):
        engine.add_request("d", [5, 6], params=sp, sampling_params=sp)
    assert engine.get_num_unfinished_requests() == 3
    outs = engine.step()
    assert sorted(o.request_id for o in outs) == ["a", "b", "c"]
    assert not any(o.finished or o.outputs[0].finished() for o in outs)
    engine.abort_request(["a", "b", "unknown"])               # several ids at once (vLLM's v1 engine: a list)
    assert list(engine._requests) == ["c"] and engine.get_num_unfinished_requests() == 1
    engine.abort_request(("c", "a"))                          # "a" is gone already: ignored
    engine.abort_request("c")
    assert not engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 0 and engine.step() == []
    s = engine.cache_stats()
    assert s["live_slots"] == 0 and s["num_running"] == 0 and s["kv_blocks_free"] == engine.memory.num_kv_blocks - 1


def _add(engine, work):
    for i, (prompt, params) in enumerate(work):
        engine.add_request(f"r{i}", prompt, params)


def _run_and_add_again(engine, work, cold: bool = True):
    """Runs `work` (requests r0, r1, ...) to its end, then adds it again, over an emptied prefix cache if `cold`;
    returns the first run's samples: what the second must give."""
    _add(engine, work)
    want = _samples(_drain(engine))
    if cold:
        engine.reset_prefix_cache()
    _add(engine, work)
    return want


def _drain(engine, outs=None):
    outs = {} if outs is None else outs
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    return outs


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "separate"])
@pytest.mark.parametrize("lose_state", [False, True], ids=["host-error", "device-state-lost"])
def test_a_failing_step_ends_its_requests_with_error_and_the_engine_keeps_serving(engine, monkeypatch, lose_state,
                                                                                  mixed):
    if not mixed:  # the scheduler reads its config at every step
        monkeypatch.setattr(engine.scheduler, "config", dataclasses.replace(engine.scheduler.config, mixed_steps=False))
    rng = np.random.default_rng(3)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    survivor, victims, late = random_ids(rng, 30), [random_ids(rng, 20) for _ in range(3)], random_ids(rng, 30)
    expect = LLM("tiny-random", enable_prefix_caching=False, **KW).generate([survivor, late], greedy, use_tqdm=False)
    engine.add_request("survivor", survivor, greedy)
    engine_ids = {"survivor": engine.seq_id_of("survivor")}
    assert engine.step()[0].request_id == "survivor"     # prefilled in one step, now decoding
    for i, p in enumerate(victims):
        engine.add_request(f"v{i}", p, greedy)
    real = engine.worker.execute
    calls = []

    def fail_once(plan):
        if not calls:
            calls.append(plan)
            if lose_state:  # as if the device call had consumed its donated pools, then failed
                jax.tree_util.tree_map(lambda x: x.delete(), engine.worker.state)
            raise RuntimeError("injected device failure")
        return real(plan)

    monkeypatch.setattr(engine.worker, "execute", fail_once)
    with pytest.raises(EngineStepError, match="v0.*v1.*v2.*injected device failure") as err:
        engine.step()                                    # the prefill step of the three new requests
    # a mixed step: the survivor's decode row is in the failing step and fails with it; separate steps: it survives
    assert calls[0].is_mixed == mixed and [s.seq_id for s in calls[0].decode_seqs] == [engine_ids["survivor"]] * mixed
    failed = ["survivor"] * mixed + ["v0", "v1", "v2"]
    assert sorted(err.value.request_ids) == failed and len(calls[0].seqs) == len(failed)
    assert all(o.finished and o.outputs[0].finish_reason == "error" and "injected" in o.error
               for o in err.value.outputs)
    engine.scheduler.check_invariants()
    engine.add_request("late", late, greedy)
    outs = _drain(engine)
    assert sorted(outs) == ["late"] + ["survivor"] * (not mixed)  # the failed ones never come back
    if not mixed:
        assert outs["survivor"].outputs[0].token_ids == expect[0].outputs[0].token_ids
    assert outs["late"].outputs[0].token_ids == expect[1].outputs[0].token_ids
    engine.scheduler.check_invariants()
    s = engine.cache_stats()
    assert s["live_slots"] == 0 and s["num_running"] == 0 and s["failed_requests"] >= 3
    assert s["free_slots"] + s["checkpoint_slots"] == engine.memory.num_linear_slots - 1
    assert s["kv_blocks_free"] == engine.memory.num_kv_blocks - 1
    assert engine.worker.state_lost() is False


@pytest.mark.parametrize("where", ["before the device step", "after the device step"])
def test_a_host_error_between_planning_and_postprocess_fails_that_step_alone(engine, monkeypatch, where):
    """An error of the host's work between a step's planning and its postprocess (here injected where the engine
    reads a prefill row's prompt-logprob targets, or where the scheduler would advance the rows) left the plan in
    flight: every later step, and every later `LLM.generate`, failed on the scheduler's assertion (the server's
    loop retired the plan as completed, its checkpoint saves indexed though the device may not have run). Now that
    step's requests end with finish_reason "error" (an EngineStepError naming them), nothing of it is indexed, and
    the same prompts then give the outputs they gave before."""
    rng = np.random.default_rng(5)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, logprobs=1, ignore_eos=True)
    work = _interrupt_workload() + [(random_ids(rng, 30), greedy), (random_ids(rng, 25), greedy)]  # 2 wait (4 rows)
    want = _run_and_add_again(engine, work)
    obj, name = ((engine.output_processor, "prompt_targets") if where == "before the device step"
                 else (engine.scheduler, "postprocess"))

    def broken(*args, **kwargs):
        raise RuntimeError("injected host error")

    monkeypatch.setattr(obj, name, broken)
    planned = []
    real_schedule = engine.scheduler.schedule
    monkeypatch.setattr(engine.scheduler, "schedule", lambda: planned.append(real_schedule()) or planned[-1])
    seq_ids = {rid: engine.seq_id_of(rid) for rid in want}
    with pytest.raises(EngineStepError, match="injected host error") as err:
        engine.step()
    monkeypatch.undo()
    in_step = {rid for rid, sid in seq_ids.items() if sid in {s.seq_id for s in planned[0].seqs}}
    assert in_step and set(err.value.request_ids) == in_step and in_step != set(want)
    assert all(o.finished and o.outputs[0].finish_reason == "error" and "injected" in o.error
               for o in err.value.outputs)
    assert engine.scheduler.inflight is None and engine.cache_stats()["checkpoint_slots"] == 0
    engine.scheduler.check_invariants()
    outs = _drain(engine)  # the requests the step did not hold go on
    assert set(outs) == set(want) - in_step
    _assert_same_samples(_samples(outs), {rid: want[rid] for rid in outs})
    _add(engine, work)
    _assert_same_samples(_samples(_drain(engine)), want)
    engine.scheduler.check_invariants()


@pytest.mark.parametrize("at", [1, 4])
def test_an_error_in_one_requests_postprocess_fails_that_request_alone(engine, monkeypatch, at):
    """The host's work after the scheduler advanced a step's rows (recording a token, decoding text, looking for stop
    strings) raising for one request ended the step half built: that request went on in a half-recorded state and
    the step's outputs of the others were lost (at its 4th token two requests finish in that step: their final
    outputs never came). Now that request alone ends with "error" (an EngineStepError naming it), the others'
    outputs of that step come with the next one, and they, and the same prompts run again, give the outputs they
    gave before. At its first token its second sample still waits to fork from it, and ends with it."""
    rng = np.random.default_rng(8)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, logprobs=1, ignore_eos=True)
    work = _interrupt_workload() + [(random_ids(rng, 12), greedy)]
    want = _run_and_add_again(engine, work)
    real = engine.output_processor.update_text

    def update_text(req, index, now):
        if req.request_id == "r1" and index == 0 and len(req.seqs[0].output_token_ids) == at:
            raise RuntimeError("injected text error")  # r1's first sample (at 4: in the step where r0 and r2 end)
        real(req, index, now)

    monkeypatch.setattr(engine.output_processor, "update_text", update_text)
    before = engine.cache_stats()
    failed_before, steps = before["failed_requests"], before["failed_steps"]
    streamed, failed = {}, None
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except EngineStepError as err:
            assert failed is None
            failed, pending = err, {o.request_id: o.finished for o in engine._undelivered.values()}
            engine.scheduler.check_invariants()
            continue
        streamed.update({o.request_id: o for o in outs if o.finished})
    monkeypatch.undo()
    assert failed is not None and failed.request_ids == ["r1"] and not failed.step_failed
    assert "request(s) 'r1' failed after their step: RuntimeError: injected text error" in str(failed)
    (out,) = failed.outputs
    assert out.finished and [c.finish_reason for c in out.outputs] == ["error", "error"] and "injected" in out.error
    assert len(out.outputs[0].token_ids) == at  # the scheduler had advanced the row
    assert pending and "r1" not in pending and all(pending.values()) == (at == 4)  # (4: they finished in that step)
    assert set(streamed) == {"r0", "r2", "r3"}
    _assert_same_samples(_samples(streamed), {rid: want[rid] for rid in streamed})
    engine.scheduler.check_invariants()
    stats = engine.cache_stats()
    assert stats["live_slots"] == 0 and stats["failed_requests"] - failed_before == 2 and stats["failed_steps"] == steps
    _add(engine, work)
    _assert_same_samples(_samples(_drain(engine)), want)
    engine.scheduler.check_invariants()


@pytest.fixture(autouse=True)
def python_sigint_handler():
    """SIGINT raises KeyboardInterrupt in these tests, as in a notebook or a terminal: a process started with SIGINT
    ignored (a background job of a non-interactive shell, some CI runners) has no Python handler for it, and the
    signals the interrupt tests send would be dropped."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def _interrupt_at(monkeypatch, obj, name, at, when=lambda *args: True):
    """Ctrl-C (SIGINT, as a notebook's interrupt button sends it) right after the `at`-th call of obj.name for which
    `when(*args)` holds (its work done: a plan made, a device step run, a row advanced): Python raises
    KeyboardInterrupt there, wherever that is, unless the engine holds the signal back."""
    real, calls = getattr(obj, name), []

    def interrupted(*args, **kwargs):
        out = real(*args, **kwargs)
        if when(*args):
            calls.append(1)
            if len(calls) == at:
                signal.raise_signal(signal.SIGINT)
        return out

    monkeypatch.setattr(obj, name, interrupted)


def _interrupt_workload():
    """Prompts sharing a prefix past two checkpoint boundaries, one sampled twice (a fork), all decoding."""
    rng = np.random.default_rng(21)
    system = random_ids(rng, 70)
    greedy = SamplingParams(temperature=0.0, max_tokens=5, logprobs=1, ignore_eos=True)
    forked = SamplingParams(temperature=0.9, seed=4, n=2, max_tokens=5, logprobs=1, ignore_eos=True)
    return [(system + random_ids(rng, 9), greedy), (system + random_ids(rng, 20), forked),
            (random_ids(rng, 40), greedy)]


def _samples(outs):
    return {rid: [(c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]) for c in o.outputs]
            for rid, o in outs.items()}


def _assert_same_samples(got, want):
    assert got.keys() == want.keys()
    for rid in want:
        for (tokens, lps), (want_tokens, want_lps) in zip(got[rid], want[rid], strict=True):
            assert tokens == want_tokens
            np.testing.assert_allclose(lps, want_lps, atol=1e-5)


@pytest.mark.parametrize("warm, where, at", [
    (False, "planned", 2), (False, "ran", 2), (False, "ran", 4), (False, "pools-consumed", 3),
    (True, "planned", 1), (True, "ran", 1), (True, "ran", 3), (True, "pools-consumed", 2)])
def test_a_step_interrupted_before_its_postprocess_is_recomputed_and_the_engine_keeps_serving(engine, monkeypatch,
                                                                                             warm, where, at):
    """Ctrl-C after the scheduler planned a step (`schedule` returned), after the device ran it (the live slots
    advanced, the checkpoints written, the result not yet kept), or between the call that consumed the donated pools
    and the worker keeping the new ones: the step was left in flight, so every later `step` failed on the
    scheduler's assertion. Now nothing of it is kept and every request goes on to the outputs it would have had.

    `warm`: the workload again over the prefix cache of its first run. The interrupt emptied the whole cache, so a
    notebook user's next run after Ctrl-C recomputed every prompt (and a study's hit rates changed). A step writes
    nothing the cache indexes, so the cache now stays while the worker keeps its pools (those before or after the
    step), and the preempted requests match it again; only pools the interrupted call consumed empty it."""
    work = _interrupt_workload()
    want = _run_and_add_again(engine, work, cold=not warm)
    if where == "planned":
        _interrupt_at(monkeypatch, engine.scheduler, "schedule", at)
    elif where == "ran":
        _interrupt_at(monkeypatch, engine.worker, "_run", at)
    else:
        _interrupt_at(monkeypatch, engine.worker, "_call", at, when=lambda name, *_: name[0] == "step")
    outs = {}
    with pytest.raises(KeyboardInterrupt):
        _drain(engine, outs)
    monkeypatch.undo()
    engine.scheduler.check_invariants()
    assert engine.scheduler.inflight is None and not engine.worker.state_lost()
    kept = where != "pools-consumed"
    if warm:
        assert (engine.cache_stats()["checkpoint_slots"] > 0) == kept
    readmitted, record = [], engine.scheduler._record_admission

    def recorded(seq, m):
        readmitted.append(m.reuse)
        record(seq, m)

    monkeypatch.setattr(engine.scheduler, "_record_admission", recorded)
    _assert_same_samples(_samples(_drain(engine, outs)), want)
    if warm:  # every preempted request matched its prompt again, unless the cache went with the pools
        assert readmitted and all(readmitted) == kept, readmitted
    s = engine.cache_stats()
    assert s["live_slots"] == 0 and s["num_running"] == 0 and s["kv_blocks_free"] == engine.memory.num_kv_blocks - 1
    assert s["free_slots"] + s["checkpoint_slots"] == engine.memory.num_linear_slots - 1
    engine.scheduler.check_invariants()


@pytest.mark.parametrize("where, at", [("postprocess", 3), ("postprocess", 9), ("text", 3), ("text", 12)])
def test_ctrl_c_in_a_steps_host_work_waits_for_its_end_and_its_outputs_come_next(engine, monkeypatch, where, at):
    """Ctrl-C while the scheduler advanced the step's rows (some done, the others' live slots a step ahead of what
    the scheduler recorded) or while the engine recorded their tokens (logprobs and text of some rows only, finished
    requests never returned): the next steps computed from that state, lost outputs, or failed. Now the host's part
    of the step runs to its end, the interrupt is raised after it, and the next step returns its outputs."""
    work = _interrupt_workload()
    want = _run_and_add_again(engine, work, cold=False)
    if where == "postprocess":
        _interrupt_at(monkeypatch, engine.scheduler.block_manager, "on_computed", at)
    else:
        _interrupt_at(monkeypatch, engine.output_processor, "update_text", at)
    outs = {}
    with pytest.raises(KeyboardInterrupt):
        _drain(engine, outs)
    monkeypatch.undo()
    engine.scheduler.check_invariants()
    assert engine.has_unfinished_requests()  # at least the interrupted step's outputs are owed
    _assert_same_samples(_samples(_drain(engine, outs)), want)
    assert not engine._requests and engine.cache_stats()["live_slots"] == 0 and engine.step() == []


@pytest.mark.parametrize("where, at", [("planned", 3), ("ran", 2)])
def test_generate_interrupted_inside_a_step_gives_the_same_outputs_next_time(llm, monkeypatch, where, at):
    """`generate` aborts its batch when interrupted; a step left in flight made every later call fail."""
    prompts, params = zip(*_interrupt_workload())
    want = llm.generate(prompts, list(params), use_tqdm=False)
    _interrupt_at(monkeypatch, *((llm.engine.scheduler, "schedule") if where == "planned"
                                 else (llm.engine.worker, "_run")), at)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, list(params), use_tqdm=False)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished_requests() and llm.cache_stats()["live_slots"] == 0
    got = llm.generate(prompts, list(params), use_tqdm=False)
    _assert_same_samples(_samples(dict(enumerate(got))), _samples(dict(enumerate(want))))
    llm.engine.scheduler.check_invariants()


def test_warm_up_interrupted_after_a_step_consumed_the_pools_leaves_fresh_ones(engine, monkeypatch):
    """Ctrl-C in warm-up between a padding step's call (its donated pools consumed) and the worker keeping the pools
    it returned: the engine kept the deleted pools, and the next step failed every request of it with an error."""
    prompt, greedy = list(range(20, 60)), SamplingParams(temperature=0.0, max_tokens=4, logprobs=1, ignore_eos=True)
    engine.add_request("w", prompt, greedy)
    want = _samples(_drain(engine))
    monkeypatch.setattr(engine.worker, "shape_buckets", lambda: [(1, 16, engine.worker.max_blocks)])  # one compile
    _interrupt_at(monkeypatch, engine.worker, "_call", 1, when=lambda name, *_: name[0] == "step")
    with pytest.raises(KeyboardInterrupt):
        engine.warm_up()
    monkeypatch.undo()
    assert not engine.worker.state_lost()
    engine.add_request("w", prompt, greedy)
    _assert_same_samples(_samples(_drain(engine)), want)  # (a failed step raises EngineStepError)
    engine.scheduler.check_invariants()


def test_ctrl_c_while_a_failed_step_is_released_still_rebuilds_the_pools_it_consumed(engine, monkeypatch):
    """A step failed after consuming the donated pools, and Ctrl-C landed while its requests were released, before
    the pools were rebuilt: the engine kept the deleted pools, and the next step failed every request in it too."""
    greedy = SamplingParams(temperature=0.0, max_tokens=4, logprobs=1, ignore_eos=True)
    engine.add_request("later", list(range(20, 60)), greedy)
    want = _samples(_drain(engine))
    real = engine.worker.execute

    def consume_and_fail(plan, *args):
        jax.tree_util.tree_map(lambda x: x.delete(), engine.worker.state)
        raise RuntimeError("injected device failure")

    monkeypatch.setattr(engine.worker, "execute", consume_and_fail)
    _interrupt_at(monkeypatch, engine.scheduler, "fail_step", 1)
    engine.add_request("victim", [5, 6, 7], greedy)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    monkeypatch.setattr(engine.worker, "execute", real)
    monkeypatch.undo()
    assert not engine.worker.state_lost()
    engine.abort_request("victim")
    engine.add_request("later", list(range(20, 60)), greedy)
    _assert_same_samples(_samples(_drain(engine)), want)  # (a failed step raises EngineStepError)
    engine.scheduler.check_invariants()


def test_unsafe_reuse_warns_and_drifts_while_the_exact_cache_does_not():
    rng = np.random.default_rng(11)
    shared = random_ids(rng, 60)   # checkpoints every 32: a later prompt shares 60 tokens, KV matches 48, reach 32
    prompts = [shared + random_ids(rng, 10), shared + random_ids(rng, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5, ignore_eos=True)

    def top(o):  # the first generated position's top-5 as {token: logprob}
        return {t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()}

    ref = top(LLM("tiny-random", enable_prefix_caching=False, **KW).generate(prompts[1], params, use_tqdm=False)[0])
    for mode, reuse in ((None, 32), ("cold", 48), ("stale", 48)):
        if mode is None:
            llm = LLM("tiny-random", **KW)
        else:
            with pytest.warns(UserWarning, match=f"unsafe_reuse='{mode}'") as caught:
                llm = LLM("tiny-random", unsafe_reuse=mode, **KW)
            # the warning names this line, not the package's frames between (LLM builds an LLMEngine)
            assert [w.filename for w in caught if "unsafe_reuse" in str(w.message)] == [__file__]
        second = [llm.generate(p, params, use_tqdm=False)[0] for p in prompts][1]
        assert second.num_cached_tokens == reuse and second.metrics.restored == (mode != "cold")
        got = top(second)
        drift = max(abs(got.get(t, -np.inf) - lp) for t, lp in ref.items())
        if mode is None:
            assert drift < 1e-4
        else:
            assert drift > 1e-3, f"{mode}: no measurable drift"


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-random", **KW)


def test_generate_interrupted_while_adding_leaves_nothing_of_its_batch(llm, monkeypatch):
    real, calls = llm.engine.add_request, []

    def add(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # e.g. Ctrl-C while a long batch is tokenized
            raise KeyboardInterrupt
        real(*args, **kwargs)

    monkeypatch.setattr(llm.engine, "add_request", add)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[5, 6], [7, 8], [9, 10]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and not llm.engine._requests


@pytest.mark.parametrize("at", [1, 2])
def test_generate_interrupted_right_after_the_scheduler_took_a_request_leaves_nothing_of_it(llm, monkeypatch, at):
    """Ctrl-C after the scheduler's `add` returned, before the engine (or `generate`) recorded the request: the
    scheduler kept a sequence no one could abort, which ran in the next call and failed its step on a lookup."""
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
    want = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    _interrupt_at(monkeypatch, llm.engine.scheduler, "add", at)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished_requests() and not llm.engine._requests and not llm.engine._by_seq
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == want
    llm.engine.scheduler.check_invariants()


def test_ctrl_c_while_the_scheduler_adds_a_forked_request_waits_for_the_add(llm, monkeypatch):
    """Ctrl-C inside the scheduler's `add` of an n > 1 request, its samples known but not yet filed as waiting for
    their fork: `generate`'s abort of its batch then failed on them ("not waiting"), and they stayed."""
    prompt, params = list(range(30, 70)), SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=3, ignore_eos=True)
    want = [c.token_ids for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs]

    class Interrupting(dict):
        def update(self, *args):
            signal.raise_signal(signal.SIGINT)  # before the children are filed under their parent
            super().update(*args)

    monkeypatch.setattr(llm.engine.scheduler, "fork_parent", Interrupting(llm.engine.scheduler.fork_parent))
    with pytest.raises(KeyboardInterrupt):
        llm.generate([prompt], params, use_tqdm=False)
    monkeypatch.setattr(llm.engine.scheduler, "fork_parent", dict(llm.engine.scheduler.fork_parent))
    assert not llm.engine.has_unfinished_requests() and not llm.engine._requests
    llm.engine.scheduler.check_invariants()
    assert [c.token_ids for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs] == want


def test_a_second_ctrl_c_while_generate_aborts_its_batch_still_aborts_all_of_it(llm, monkeypatch):
    """Pressed twice: the second interrupt landed in `generate`'s abort of the interrupted batch, and the requests
    not yet aborted stayed in the engine, running in the next call."""
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
    want = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    _interrupt_at(monkeypatch, llm.engine.worker, "_run", 2)
    _interrupt_at(monkeypatch, llm.engine.scheduler, "abort", 1)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished_requests() and not llm.engine._requests
    assert llm.cache_stats()["live_slots"] == 0
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == want
    llm.engine.scheduler.check_invariants()


def test_a_second_ctrl_c_while_generate_closes_its_progress_bar_still_aborts_the_batch(llm, monkeypatch):
    """The bar was closed before the interrupted batch was aborted: a second interrupt there skipped the abort, and
    the batch ran on in the next call."""
    import tqdm.auto

    class Bar:
        def __init__(self, total, **kwargs):
            pass

        def update(self, n=1):
            pass

        def close(self):
            signal.raise_signal(signal.SIGINT)

    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    want = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    _interrupt_at(monkeypatch, llm.engine.worker, "_run", 2)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, GREEDY, use_tqdm=True)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished_requests() and not llm.engine._requests
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == want


def test_the_progress_bar_counts_only_the_batch(llm, monkeypatch):
    import tqdm.auto

    bars = []

    class Bar:
        def __init__(self, total, **kwargs):
            self.total, self.n = total, 0
            bars.append(self)

        def update(self, n=1):
            self.n += n

        def close(self):
            pass

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    llm.engine.add_request("own", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=1))  # the caller's own
    outs = llm.generate([[8, 9, 10]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=True)
    assert [o.prompt_token_ids for o in outs] == [[8, 9, 10]] and len(outs[0].outputs[0].token_ids) == 3
    assert [(b.total, b.n) for b in bars] == [(1, 1)] and outs[0].outputs[0].finished()
    assert not llm.engine.has_unfinished_requests()



def test_generate_builds_each_output_once_but_the_step_api_streams_them(llm, monkeypatch):
    """`generate` returns only final outputs, so it builds only those (vLLM's FINAL_ONLY): an output per step copies
    the whole output so far (token ids, logprobs, text), which made generate's host work quadratic in the output
    length. A request added through the step API still gets an output at every step."""
    built = []
    processor = llm.engine.output_processor
    real = processor.make_output
    monkeypatch.setattr(processor, "make_output", lambda req, *a: built.append(req.request_id) or real(req, *a))
    llm.engine.add_request("own", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2, n=2, seed=3)
    outs = llm.generate([[8, 9, 10], [11, 12]], sp, use_tqdm=False)
    assert [len(c.token_ids) for o in outs for c in o.outputs] == [20] * 4
    assert all(len(c.logprobs) == 20 and c.finished() for o in outs for c in o.outputs)
    mine = [r for r in built if r != "own"]
    assert sorted(mine) == sorted(o.request_id for o in outs)  # one each, the final one
    assert built.count("own") == 20


def test_a_step_output_rebuilds_only_the_samples_that_stepped(engine):
    """Of a request of many samples, a step rebuilds the CompletionOutputs of the samples it advanced and reuses the
    others' objects (a flood of n=256 spent most of its step rebuilding them); every output still equals a full
    rebuild, field for field."""
    sp = SamplingParams(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True, logprobs=1, n=7)
    engine.add_request("many", random_ids(np.random.default_rng(11), 40), sp)  # 7 samples, 4 rows: they run in turns
    req, previous, reused = engine._requests["many"], None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            stepped = {i for i, c in enumerate(out.outputs)
                       if previous is None or c.token_ids != previous.outputs[i].token_ids}
            if previous is not None:
                reused += sum(c is previous.outputs[i] for i, c in enumerate(out.outputs))
                assert all(out.outputs[i] is not previous.outputs[i] for i in stepped)
            full = engine.output_processor.make_output(dataclasses.replace(req, built=[]))  # from nothing
            assert out.outputs == full.outputs
            previous = out
    assert reused > 0 and [len(c.token_ids) for c in previous.outputs] == [6] * 7


def test_a_hinted_position_becomes_a_checkpoint_that_a_later_prompt_restores_exactly(engine):
    """A dict prompt's `checkpoint_positions` (53: kept at the block boundary 48, off the 32-token grid): a later
    prompt sharing 50 tokens restores 48 instead of 32, and gives what it gives with the prefix cache unread."""
    rng = np.random.default_rng(23)
    shared = random_ids(rng, 50)
    greedy = dict(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
    engine.add_request("hinted", {"prompt_token_ids": shared + [7] * 10, "checkpoint_positions": [53]},
                       SamplingParams(**greedy))
    _drain(engine)
    engine.add_request("hit", shared + [9, 9], SamplingParams(**greedy))
    hit = _drain(engine)["hit"]
    engine.add_request("cold", shared + [9, 9], SamplingParams(**greedy, skip_reading_prefix_cache=True))
    cold = _drain(engine)["cold"]
    assert hit.num_cached_tokens == 48 and cold.num_cached_tokens == 0
    assert hit.outputs[0].token_ids == cold.outputs[0].token_ids
    np.testing.assert_allclose([d[t].logprob for d, t in zip(hit.outputs[0].logprobs, hit.outputs[0].token_ids)],
                               [d[t].logprob for d, t in zip(cold.outputs[0].logprobs, cold.outputs[0].token_ids)],
                               atol=1e-4)


def test_a_checkpoint_evicted_to_the_host_tier_is_restored_exactly():
    """host_checkpoint_bytes: with room for one checkpoint beside the live slot, the prompts after A evict A's
    checkpoint (at 32; the one at 64 had no slot) from the device to the host; A's next prompt restores it from there,
    with the same tokens and logprobs as with the prefix cache unread. Refused with tensor parallelism."""
    engine = LLMEngine("tiny-random", host_checkpoint_bytes=1 << 30, num_linear_slots=3,
                       **dict(KW, max_num_seqs=1))
    rng = np.random.default_rng(5)
    shared = random_ids(rng, 100)
    greedy = dict(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
    for i, prompt in enumerate([shared] + [random_ids(rng, 100) for _ in range(2)]):
        engine.add_request(f"p{i}", prompt, SamplingParams(**greedy))
        _drain(engine)
    assert engine.cache_stats()["checkpoints_offloaded"] >= 2 and len(engine.host_store.entries) >= 2
    engine.add_request("hit", shared + [9, 9], SamplingParams(**greedy))
    hit = _drain(engine)["hit"]
    engine.add_request("cold", shared + [9, 9], SamplingParams(**greedy, skip_reading_prefix_cache=True))
    cold = _drain(engine)["cold"]
    assert hit.num_cached_tokens == 32 and engine.cache_stats()["checkpoints_onloaded"] == 1
    assert hit.outputs[0].token_ids == cold.outputs[0].token_ids
    np.testing.assert_allclose([d[t].logprob for d, t in zip(hit.outputs[0].logprobs, hit.outputs[0].token_ids)],
                               [d[t].logprob for d, t in zip(cold.outputs[0].logprobs, cold.outputs[0].token_ids)],
                               atol=1e-4)
    with pytest.raises(ValueError, match="host_checkpoint_bytes runs on one device"):
        LLMEngine("tiny-random", host_checkpoint_bytes=1 << 20, tensor_parallel_size=2, **KW)


def test_compress_keeps_each_head_within_its_dtypes_step_and_expand_undoes_it():
    """int8: within half a step of its head's scale; float8 e4m3: 3 mantissa bits; bfloat16: 8; a compressed
    checkpoint compressed again after a restore is the same (int8, bfloat16) or within a step (float8): a restore and a
    save do not drift further."""
    from gdn_jax.worker.host_tier import compress, expand
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 4, 8, 8)) * jnp.array([1e-3, 1.0, 30.0, 0.0])[None, :, None, None]
    top = jnp.max(jnp.abs(x), axis=(2, 3), keepdims=True)
    for dtype, bound in [("int8", top / 127 / 2), ("float8_e4m3fn", jnp.abs(x) * 2.0**-4 + top / 448 * 2.0**-9),
                         ("bfloat16", jnp.abs(x) * 2.0**-8)]:
        q, scale = compress(x, dtype, (2, 3))
        y = expand(q, scale)
        assert q.dtype == jnp.dtype(dtype) and bool(jnp.all(jnp.abs(y - x) <= bound * 1.0001)), dtype
        assert bool(jnp.any(y != x)), dtype  # (it does round)
        again = expand(*compress(y, dtype, (2, 3)))  # float8: the scale may move by an ulp, a value by a step
        same = again == y if dtype != "float8_e4m3fn" else jnp.abs(again - y) <= bound
        assert bool(jnp.all(same)), dtype


def test_compressed_checkpoints_hold_more_in_the_same_bytes_and_restore_close_to_exact():
    """checkpoint_dtype: the float32 checkpoint slots' bytes hold 4x (int8, float8) or 2x (bfloat16) as many
    compressed checkpoints, less a few float32 slots kept for a step's saves and restores. A hit restores a compressed
    checkpoint: the same greedy tokens as with the cache unread on tiny-random, its logprobs close but not equal (the
    checkpoint was rounded), while float32 checkpoints are exact."""
    rng = np.random.default_rng(5)
    shared = random_ids(rng, 100)
    greedy = dict(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
    drift = {}
    for dtype, ratio in [("float32", 1), ("bfloat16", 2), ("int8", 4), ("float8_e4m3fn", 4)]:
        engine = LLMEngine("tiny-random", checkpoint_dtype=dtype, num_linear_slots=13, **dict(KW, max_num_seqs=2))
        plan = engine.memory
        if ratio > 1:
            staging = plan.num_linear_slots - 3
            assert 0.97 * ratio <= plan.bytes_per_linear_slot / plan.bytes_per_compressed_checkpoint <= ratio
            assert plan.num_compressed_checkpoints == (10 - staging) * plan.bytes_per_linear_slot // (
                plan.bytes_per_compressed_checkpoint) >= (10 - staging) * ratio * 0.95
        for name, kw in [("a", {}), ("hit", {}), ("cold", dict(skip_reading_prefix_cache=True))]:
            engine.add_request(name, shared + [9, 9] * (name != "a"), SamplingParams(**greedy, **kw))
            out = _drain(engine)[name]
            drift[dtype, name] = out
        hit, cold = drift[dtype, "hit"], drift[dtype, "cold"]
        assert hit.num_cached_tokens == 96 and hit.outputs[0].token_ids == cold.outputs[0].token_ids
        assert engine.cache_stats()["checkpoints_onloaded"] == (ratio > 1)
        lp = [np.array([d[t].logprob for d, t in zip(r.outputs[0].logprobs, r.outputs[0].token_ids)])
              for r in (hit, cold)]
        err = np.max(np.abs(lp[0] - lp[1]))
        assert (err < 1e-5) if ratio == 1 else (1e-5 < err < 0.2), (dtype, err)
    with pytest.raises(ValueError, match="set one of them"):
        LLMEngine("tiny-random", checkpoint_dtype="int8", host_checkpoint_bytes=1 << 20, **KW)


def test_generate_passes_a_dict_prompts_hints_on(llm):
    index = llm.engine.scheduler.block_manager.linear.index
    before = {d for d in index.depth_of.values() if d % 32}
    llm.generate([{"prompt_token_ids": list(range(100, 160)), "checkpoint_positions": [50]}],
                 SamplingParams(max_tokens=1), use_tqdm=False)
    assert {d for d in index.depth_of.values() if d % 32} - before == {48}


@pytest.mark.parametrize("positions, message", [
    (64, "must be a list"), ([True], "not a token position"), ([8], r"outside \[16, 50\]"),
    ([51], r"outside \[16, 50\]"), (list(range(16, 50, 2)), "at most 16")])
def test_bad_hints_are_refused_naming_the_field(engine, positions, message):
    prompt = {"prompt_token_ids": list(range(4, 54)), "checkpoint_positions": positions}
    with pytest.raises(ValueError, match="checkpoint_positions.*" + message):
        engine.add_request("bad", prompt, SamplingParams(max_tokens=1))
    assert not engine.has_unfinished_requests()


def test_generate_tokenizes_each_text_prompt_once(llm, monkeypatch):
    """`generate` validates every prompt before it adds any (tokenizing a text prompt), then adds the token ids it
    found: the text is not tokenized a second time. Its output is the same as a token-id prompt's, with the text."""
    texts = ["def f(x):", "The for statement", "def f(x):"]
    encoded = []
    real = llm.engine.tokenizer.encode
    monkeypatch.setattr(llm.engine.tokenizer, "encode", lambda text: encoded.append(text) or real(text))
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outs = llm.generate(texts, greedy, use_tqdm=False)
    assert encoded == texts
    by_ids = llm.generate([real(t) for t in texts], greedy, use_tqdm=False)
    assert [o.prompt for o in outs] == texts and [o.prompt for o in by_ids] == [None] * 3
    assert [o.prompt_token_ids for o in outs] == [real(t) for t in texts] == [o.prompt_token_ids for o in by_ids]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in by_ids]


CHAT = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is false %}<think></think>{% endif %}"
        "{% endif %}")


def test_chat_renders_each_conversation_and_generates_it_as_a_text_prompt(llm):
    """vLLM's `LLM.chat`: a conversation, or a list of them, rendered with the template (text parts joined, the
    generation prompt, `chat_template_kwargs`, `continue_final_message` ending the text at the last message), then
    generated as `generate` generates that text."""
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    second = [{"role": "user", "content": "Go on"}, {"role": "assistant", "content": "Sure,"}]
    outs = llm.chat([first, second[:1]], greedy, use_tqdm=False, chat_template=CHAT,
                    chat_template_kwargs={"enable_thinking": False})
    rendered = ["<|system|>Be brief.\n<|user|>Hi\nthere\n<|assistant|><think></think>",
                "<|user|>Go on\n<|assistant|><think></think>"]
    assert [o.prompt for o in outs] == rendered
    plain = llm.generate(rendered, greedy, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [o.prompt_token_ids for o in plain]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    # one conversation; the assistant's reply continued, its end-of-turn left out
    out, = llm.chat(second, greedy, use_tqdm=False, chat_template=CHAT, add_generation_prompt=False,
                    continue_final_message=True)
    assert out.prompt == "<|user|>Go on\n<|assistant|>Sure,"
    assert llm.chat(second[:1], greedy, use_tqdm=False, chat_template=CHAT)[0].prompt == "<|user|>Go on\n<|assistant|>"


@pytest.mark.parametrize("call, message", [
    (dict(), "this model has no chat template"),
    (dict(messages=[{"role": "tool", "content": "x"}]), r"messages\[0\]\.role must be one of"),
    (dict(messages=[{"role": "user", "content": 3}]), r"messages\[0\]\.content must be a string"),
    (dict(messages=[[{"role": "user", "content": "a"}], [{"role": "user"}]]), r"conversation 1: messages\[0\]"),
    (dict(messages=[]), "non-empty list"),
    (dict(messages=[{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]),
     r"messages\[0\]\.tool_calls: tool calls are not supported"),
    (dict(messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": " "}],
          add_generation_prompt=False, continue_final_message=True), "the final message has no text to continue"),
    (dict(continue_final_message=True), "cannot both be true"),
    (dict(chat_template="{{ raise_exception('no system here') }}"), "no system here"),
    (dict(chat_template="{% for %}"), r"does not parse \(line 1\)"),
    (dict(chat_template=5), "chat_template must be the template's text"),
    (dict(chat_template_kwargs=[1]), r"chat_template_kwargs must be a dict of template variables, got \[1\]"),
    (dict(chat_template_kwargs={1: True}), "the names of template variables must be strings"),
    (dict(add_generation_prompt="no"), "add_generation_prompt must be a bool, got 'no'"),
    (dict(chat_template_kwargs={"continue_final_message": 1}), "continue_final_message must be a bool, got 1"),
])
def test_chat_refuses_what_it_cannot_render_and_runs_nothing(llm, call, message):
    kwargs = {"messages": [{"role": "user", "content": "hi"}], "chat_template": CHAT} | call
    if not call:
        del kwargs["chat_template"]  # the preset has no folder, so no template
    with pytest.raises(ValueError, match=message):
        llm.chat(sampling_params=SamplingParams(max_tokens=1), use_tqdm=False, **kwargs)
    assert not llm.engine.has_unfinished_requests() and not llm.engine._requests


def test_chat_reads_the_model_folders_template_and_special_tokens(llm, tmp_path, monkeypatch):
    """Without `chat_template`, the folder's chat_template.jinja (else tokenizer_config.json's), given the special
    tokens tokenizer_config.json sets, as transformers gives them."""
    (tmp_path / "tokenizer_config.json").write_text(
        '{"bos_token": {"content": "<s>"}, "eos_token": "</s>", "pad_token": null, "chat_template": "unused"}')
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"
                                                  "{{ pad_token is defined }}")
    monkeypatch.setattr(llm.engine, "model_folder", tmp_path)
    monkeypatch.setattr(llm, "_chat_templates", {})
    out, = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1), use_tqdm=False)
    assert out.prompt == "<s>hi</s>False"
    (tmp_path / "chat_template.jinja").unlink()
    monkeypatch.setattr(llm, "_chat_templates", {})
    assert llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1),
                    use_tqdm=False)[0].prompt == "unused"


def test_continue_final_message_ends_after_the_final_message_where_the_template_strips_it():
    """transformers' cut: at the last occurrence of the final message's stripped text, keeping its trailing
    whitespace only where the template kept it. A template that trims the content must not cut at an earlier
    message that happens to hold the final message's whole text ("I think " inside the user's question)."""
    from gdn_jax.chat import ChatTemplate

    trim = ChatTemplate("{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}<|end|>{% endfor %}")
    keep = ChatTemplate("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}")
    convo = [{"role": "user", "content": "What do I think about it?"}, {"role": "assistant", "content": "I think "}]
    assert trim.render(convo, add_generation_prompt=False, continue_final_message=True) == (
        "<|user|>What do I think about it?<|end|><|assistant|>I think")
    assert keep.render(convo, add_generation_prompt=False, continue_final_message=True) == (
        "<|user|>What do I think about it?<|end|><|assistant|>I think ")


def test_chat_template_kwargs_override_the_arguments_of_the_same_name(llm):
    """vLLM updates the arguments with `chat_template_kwargs`: add_generation_prompt and continue_final_message set
    there win over the keywords, in the check that both are not true as in the rendering."""
    greedy = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    convo = [{"role": "user", "content": "Go on"}, {"role": "assistant", "content": "Sure,"}]
    for kwargs in (dict(continue_final_message=True, chat_template_kwargs={"add_generation_prompt": False}),
                   dict(add_generation_prompt=False, chat_template_kwargs={"continue_final_message": True})):
        out, = llm.chat(convo, greedy, use_tqdm=False, chat_template=CHAT, **kwargs)
        assert out.prompt == "<|user|>Go on\n<|assistant|>Sure,", kwargs
    with pytest.raises(ValueError, match="cannot both be true"):
        llm.chat(convo, greedy, use_tqdm=False, chat_template=CHAT, add_generation_prompt=False,
                 continue_final_message=True, chat_template_kwargs={"add_generation_prompt": True})
