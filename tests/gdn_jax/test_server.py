"""The OpenAI-compatible server, driven by real clients (the `openai` package and httpx) over a loopback port.

`make test` runs this file in a pytest process of its own: after the rest of the suite had run in the same process,
a step compilation on the server's engine thread twice aborted inside XLA (a fatal error, not an exception); alone it
never did."""

import asyncio
import json
import re
import threading

import httpx
import numpy as np
import openai
import pytest

from gdn_jax import LLM, LLMEngine, SamplingParams
from gdn_jax.entrypoints.openai.api_server import ServerThread, create_app
from gdn_jax.entrypoints.openai.engine_loop import EngineLoop
from gdn_jax.entrypoints.openai.protocol import CompletionRequest
from gdn_jax.entrypoints.openai.serving_engine import ServerConfig

pytestmark = pytest.mark.server

KEY = "test-key-123"
ENGINE_KW = dict(block_size=16, chunk_stride=32, max_num_seqs=32, max_model_len=256)
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def server():
    """One engine loop behind two apps: the main one (API key, no chat template) and one with a chat template."""
    engine = LLMEngine("tiny-random", verbose=False, **ENGINE_KW)
    loop = EngineLoop(engine).start()
    main = ServerThread(create_app(loop, ServerConfig(model_name="tiny", api_key=KEY, max_tokens_limit=200,
                                                      max_request_bytes=64 << 10)))
    chat = ServerThread(create_app(loop, ServerConfig(model_name="tiny", chat_template=TEMPLATE)))
    with main, chat:
        main.loop, main.chat_url = loop, chat.url
        yield main
    loop.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _metrics(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(gdn_jax_\w+(?:\{[^}]*\})?) (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def _assert_no_leak(server) -> dict:
    m = {}
    for _ in range(100):  # bounded: the engine thread may still be finishing an abort
        m = _metrics(server)
        if m['gdn_jax_requests{state="active"}'] == 0 and m['gdn_jax_requests{state="running"}'] == 0:
            break
        threading.Event().wait(0.1)
    assert m['gdn_jax_requests{state="active"}'] == 0
    assert m['gdn_jax_requests{state="running"}'] == 0 and m['gdn_jax_requests{state="waiting"}'] == 0
    assert m['gdn_jax_linear_slots{state="live"}'] == 0
    assert m['gdn_jax_kv_blocks{state="in_use"}'] == 0
    engine = server.loop.engine
    assert m['gdn_jax_kv_blocks{state="free"}'] == engine.memory.num_kv_blocks - 1
    assert (m['gdn_jax_linear_slots{state="free"}'] + m['gdn_jax_linear_slots{state="checkpoint"}']
            == engine.memory.num_linear_slots - 1)
    return m


def _text(n: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    words = ["cache", "state", "delta", "gate", "prefix", "chunk", "slot", "block", "restore", "token"]
    return " ".join(rng.choice(words, n))


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/health").text == "ok"
    m = _metrics(server)
    for stat in ("hits", "queries", "reused_tokens", "live_slots", "checkpoint_slots", "checkpoints_restored",
                 "checkpoints_evicted", "preemptions", "compilations", "hit_rate"):
        assert f'gdn_jax_cache{{stat="{stat}"}}' in m
    assert "gdn_jax_time_to_first_token_seconds_count" in m and "gdn_jax_e2e_request_latency_seconds_count" in m


def test_official_client_completes_and_streams_the_same_text(client):
    prompt = "The gated delta rule keeps a state"
    kw = dict(model="tiny", prompt=prompt, max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert full.choices[0].text == streamed and len(full.choices[0].text) > 0
    assert full.choices[0].finish_reason == "length" == [c for c in chunks if c.choices][-1].choices[0].finish_reason
    assert full.usage.completion_tokens == 12 and full.usage.prompt_tokens == len(prompt.encode())
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    # stop strings cut the text the same way, streamed or not (random weights: many ids decode to no text)
    stop = next(ch for ch in full.choices[0].text[1:] if ch.isascii() and ch.isprintable())
    cut = client.completions.create(stop=[stop], **kw)
    cut_stream = "".join(c.choices[0].text for c in client.completions.create(stream=True, stop=stop, **kw))
    assert cut.choices[0].text == full.choices[0].text[:full.choices[0].text.find(stop)] == cut_stream
    assert cut.choices[0].finish_reason == "stop"


def test_cached_tokens_on_a_repeated_prefix(client):
    system = _text(20, 1)  # ~130 tokens
    first = client.completions.create(model="tiny", prompt=system + " first?", max_tokens=2, temperature=0.0)
    second = client.completions.create(model="tiny", prompt=system + " second?", max_tokens=2, temperature=0.0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 32 == 0 and cached <= len(system.encode())


@pytest.fixture(scope="module")
def offline():
    return LLM("tiny-random", enable_prefix_caching=False, verbose=False, **ENGINE_KW)


def test_echo_logprobs_equal_offline_prompt_logprobs_cached_or_not(client, offline):
    prompt = _text(16, 2)
    ids = list(prompt.encode())
    ref = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    want = [None] + [ref.prompt_logprobs[p][ref.prompt_token_ids[p]].logprob for p in range(1, len(ids))]

    def echo():
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0.0, echo=True,
                                      logprobs=1)
        return r, r.choices[0].logprobs

    cold, lp = echo()                                   # nothing of this prompt is cached yet
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0.0)
    assert plain.usage.prompt_tokens_details.cached_tokens > 0   # now the prefix is in the cache
    warm, lp_warm = echo()
    for r, got in ((cold, lp), (warm, lp_warm)):
        assert r.choices[0].text == prompt + plain.choices[0].text
        assert len(got.tokens) == len(ids) + 1 and got.token_logprobs[0] is None and got.top_logprobs[0] is None
        assert "".join(got.tokens[:len(ids)]) == prompt
        np.testing.assert_allclose(got.token_logprobs[1:len(ids)], want[1:], atol=1e-5, rtol=0)
        assert r.usage.prompt_tokens_details.cached_tokens == 0   # echo + logprobs computes the whole prompt
    # streamed, the prompt's logprobs come with the first chunk
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0.0, echo=True,
                                            logprobs=1, stream=True))
    lps = [x for c in chunks for x in c.choices[0].logprobs.token_logprobs]
    np.testing.assert_allclose(lps[1:len(ids)], want[1:], atol=1e-5, rtol=0)


def test_penalties_and_vllm_extras_reach_the_engine(client, offline):
    """Each of presence/frequency penalty (OpenAI fields) and repetition_penalty / min_p / min_tokens /
    include_stop_str_in_output (vLLM's extras) changes what the offline engine generates on this prompt, and the server gives the same output."""
    prompt = _text(6, 11)
    greedy = dict(temperature=0.0, max_tokens=32, ignore_eos=True)  # 32 tokens: some repeat, penalties bite
    first, text = (lambda o: (o.token_ids, o.text))(
        offline.generate(prompt, SamplingParams(**greedy), use_tqdm=False)[0].outputs[0])
    sampled = dict(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    stop = dict(temperature=0.0, max_tokens=12, stop_token_ids=[first[2]])  # stops at 3 tokens unless min_tokens
    cases = [(greedy, dict(presence_penalty=2.0)), (greedy, dict(frequency_penalty=2.0)),
             (greedy, dict(repetition_penalty=1.5)), (sampled, dict(min_p=0.3)), (stop, dict(min_tokens=8)),
             ({**greedy, "stop": [text[3:5]]}, dict(include_stop_str_in_output=True))]
    for base, extra in cases:
        want, without = (offline.generate(prompt, SamplingParams(**base, **e), use_tqdm=False)[0].outputs[0]
                         for e in (extra, {}))
        assert (want.token_ids, want.text) != (without.token_ids, without.text), extra  # the parameter matters here
        kw = {k: v for k, v in {**base, **extra}.items() if k in ("temperature", "max_tokens", "seed",
                                                                 "presence_penalty", "frequency_penalty")}
        body = {k: v for k, v in {**base, **extra}.items() if k not in kw}
        got = client.completions.create(model="tiny", prompt=prompt, extra_body=body, **kw).choices[0]
        assert got.text == want.text, extra


def test_32_concurrent_streaming_clients_match_a_serial_run(server, client):
    rng = np.random.default_rng(7)
    system = _text(12, 3)
    prompts = [system + " " + _text(int(n), 100 + i) for i, n in enumerate(rng.integers(1, 12, 24))]
    prompts += [_text(int(n), 200 + i) for i, n in enumerate(rng.integers(2, 20, 8))]
    kw = dict(model="tiny", max_tokens=8, temperature=0.0, logprobs=0, extra_body={"ignore_eos": True})
    serial = []
    for p in prompts:
        c = client.completions.create(prompt=p, **kw).choices[0]
        serial.append((c.text, c.logprobs.tokens, c.logprobs.token_logprobs))

    async def one(aclient, p):
        text, tokens, lps = "", [], []
        async for chunk in await aclient.completions.create(prompt=p, stream=True, **kw):
            text += chunk.choices[0].text
            tokens += chunk.choices[0].logprobs.tokens
            lps += chunk.choices[0].logprobs.token_logprobs
        return text, tokens, lps

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300) as ac:
            return await asyncio.gather(*(one(ac, p) for p in prompts))

    concurrent = asyncio.run(all_at_once())
    for (t1, k1, l1), (t2, k2, l2) in zip(serial, concurrent):
        assert t1 == t2 and k1 == k2
        np.testing.assert_allclose(l1, l2, atol=1e-4, rtol=0)
    _assert_no_leak(server)


def test_client_disconnect_aborts_the_request(server):
    before = _metrics(server).get('gdn_jax_requests_finished_total{finish_reason="abort"}', 0.0)
    body = {"model": "tiny", "prompt": _text(5, 4), "max_tokens": 200, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", server.url + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status_code == 200
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    break  # leave mid-stream: closing the response drops the connection
    m = _assert_no_leak(server)
    assert m['gdn_jax_requests_finished_total{finish_reason="abort"}'] == before + 1
    # a non-streaming client that gives up is noticed too (steps slowed to 20 ms: the request outlives the client)
    worker = server.loop.engine.worker
    real = worker.execute
    worker.execute = lambda *a, **kw: (threading.Event().wait(0.02), real(*a, **kw))[1]
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json={**body, "stream": False},
                       timeout=httpx.Timeout(60, read=0.5), headers={"Authorization": f"Bearer {KEY}"})
        m = _assert_no_leak(server)
    finally:
        worker.execute = real
    assert m['gdn_jax_requests_finished_total{finish_reason="abort"}'] == before + 2


BAD = [
    (b'{"model": "tiny", "prompt": "hi", ', 400, "malformed JSON"),
    (b'[1, 2]', 400, "JSON object"),
    ({"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "hi", "echo": "yes"}, 400, "echo"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": ["a", 3]}, 400, "prompt"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": ""}, 400, "empty prompt"),
    ({"prompt": []}, 400, "empty prompt"),
    ({"prompt": "x" * 300}, 400, "max_model_len"),
    ({"prompt": "x" * 200, "max_tokens": 100}, 400, "maximum context length"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ({"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 5000}, 400, "max_tokens"),
    ({"prompt": "hi", "n": 0}, 400, "n must be"),
    ({"prompt": "hi", "n": 2, "best_of": 3}, 400, "best_of is not supported"),
    ({"prompt": "hi", "seed": -1}, 400, "seed"),
    ({"prompt": "hi", "stop": [""]}, 400, "stop"),
    ({"prompt": "hi", "stop": ""}, 400, "stop"),
    ({"prompt": "hi", "max_tokens": 0, "echo": True}, 400, "0 only with echo and logprobs"),
    ({"prompt": "hi", "logit_bias": {"36": 100}}, 400, "logit_bias is not supported"),
    ({"prompt": "hi", "best_of": 3}, 400, "best_of is not supported"),
    ({"prompt": "hi", "best_of": True}, 400, "invalid field 'best_of'"),  # a boolean, as in every number field
    ({"prompt": "hi", "suffix": "x"}, 400, "suffix is not supported"),
    ({"prompt": "hi", "response_format": {"type": "json_object"}}, 400, "response_format is not supported"),
    ({"prompt": [5, 99999]}, 400, "outside the vocabulary"),
    ({"prompt": [[5, 6], [-1]]}, 400, "outside the vocabulary"),
    ({"prompt": "hi", "stop_token_ids": [100000]}, 400, "stop_token_ids"),
    ({"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty must be in [-2, 2]"),
    ({"prompt": "hi", "frequency_penalty": -3}, 400, "frequency_penalty must be in [-2, 2]"),
    ({"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"prompt": "hi", "min_p": 2}, 400, "min_p"),
    ({"prompt": "hi", "min_tokens": -1}, 400, "min_tokens"),
    ({"prompt": "hi", "bad_words": ["x"]}, 400, "bad_words is not supported"),  # vLLM's extras it does not implement
    ({"prompt": "hi", "guided_choice": ["a", "b"]}, 400, "guided_choice is not supported"),
    ({"prompt": "hi", "skip_special_tokens": False}, 400, "skip_special_tokens is not supported"),
    ({"prompt": "hi", "truncate_prompt_tokens": 8}, 400, "truncate_prompt_tokens is not supported"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options needs stream: true"),
    ({"prompt": "x" * 70000}, 413, "exceeds the limit"),
    (b'{"prompt": "hi", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "nested too deeply"),
    ({"prompt": "hi", "temperature": 1e39}, 400, "temperature must be in [0, 1e+06]"),
    ({"prompt": "hi", "stop": [f"s{i}" for i in range(65)]}, 400, "stop holds 65 strings"),
]


@pytest.mark.parametrize("body, status, message", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_requests_get_a_clear_error_and_the_server_keeps_serving(server, body, status, message):
    kw = {"content": body} if isinstance(body, bytes) else {"json": {"model": "tiny", **body}}
    r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}",
                                                             "Content-Type": "application/json"}, timeout=60, **kw)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]
    ok = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                    json={"model": "tiny", "prompt": "ok", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_a_model_the_server_does_not_serve_is_a_404_and_none_named_is_served(server):
    """vLLM's answer to a `model` other than the served name (an evaluation pointed at the wrong server fails
    loudly, instead of scoring another model); a request naming none is served."""
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server.url + "/v1/completions", headers=auth, timeout=60,
                   json={"model": "qwen3.5-9b", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert "`qwen3.5-9b` does not exist" in r.json()["error"]["message"] and "`tiny`" in r.json()["error"]["message"]
    r = httpx.post(server.chat_url + "/v1/chat/completions", timeout=60,
                   json={"model": "Tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 404 and "`Tiny` does not exist" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", headers=auth, timeout=60,
                   json={"prompt": "hi", "max_tokens": 2, "temperature": 0.0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2 and r.json()["model"] == "tiny"


def test_chat_naming_another_model_is_a_404_before_the_missing_template_is_a_400(server):
    """A wrong `model` is a 404 on /v1/chat/completions too, also where the model has no chat template (that 400
    came first); the served name, or none, still gets the template's 400."""
    auth, msgs = {"Authorization": f"Bearer {KEY}"}, [{"role": "user", "content": "hi"}]
    r = httpx.post(server.url + "/v1/chat/completions", headers=auth, timeout=60,
                   json={"model": "qwen3.5-9b", "messages": msgs, "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
    assert "`qwen3.5-9b` does not exist" in r.json()["error"]["message"]
    for named in ({"model": "tiny"}, {}):
        r = httpx.post(server.url + "/v1/chat/completions", headers=auth, timeout=60,
                       json={**named, "messages": msgs, "max_tokens": 2})
        assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"], r.text

def test_the_models_recommended_sampling_fills_what_a_request_leaves_unset(server, monkeypatch):
    """vLLM's --generation-config auto: generation_config.json's temperature (and top_p, top_k, min_p,
    repetition_penalty) for the fields a request leaves unset, its max_new_tokens as a cap on max_tokens."""
    monkeypatch.setattr(server.loop.engine, "default_sampling", {"temperature": 0.0, "max_tokens": 3})
    body = {"prompt": _text(5, 7), "max_tokens": 10, "ignore_eos": True}
    unset = _post(server, body).json()
    greedy = _post(server, {**body, "temperature": 0.0}).json()
    assert unset["usage"]["completion_tokens"] == 3 == greedy["usage"]["completion_tokens"]
    assert unset["choices"][0]["text"] == greedy["choices"][0]["text"]
    srv = server.server.config.app.state.serving_completion
    params = srv.sampling_params(CompletionRequest(prompt="x", temperature=0.5, top_k=3), 10, None, None, 1)
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0.5, 3, 1.0, 3)


def test_unsupported_fields_at_their_off_values_are_served(server):
    off = {"skip_special_tokens": True, "bad_words": [], "use_beam_search": False, "length_penalty": 1,
           "logit_bias": {}, "response_format": {"type": "text"}}
    r = _post(server, {"prompt": "hi", "max_tokens": 2, **off})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-key"}, {"Authorization": KEY}])
def test_a_bad_api_key_gets_401(server, headers):
    r = httpx.post(server.url + "/v1/completions", headers=headers, json={"model": "tiny", "prompt": "hi"})
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).completions.create(
            model="tiny", prompt="hi")


def test_chat_completions_with_and_without_a_template(server, client):
    with pytest.raises(openai.BadRequestError, match="chat template"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    chat = openai.OpenAI(base_url=server.chat_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a slot?"}]
    full = chat.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0.0)
    streamed = "".join(c.choices[0].delta.content or "" for c in chat.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=6, temperature=0.0, stream=True))
    assert full.choices[0].message.role == "assistant" and full.choices[0].message.content == streamed
    rendered = "<|system|>Be brief.\n<|user|>What is a slot?\n<|assistant|>"
    assert full.usage.prompt_tokens == len(rendered.encode())


@pytest.mark.parametrize("where", ["device step", "host work after planning", "one request's postprocess"])
def test_a_failing_step_errors_its_requests_and_the_loop_keeps_serving(server, client, monkeypatch, where):
    """A step that raises in the worker, or in the engine's host work between the step's planning and its
    postprocess (the engine now fails that step itself), errors its requests alone; the server goes on serving. The
    host's work for one request after its step (its text, say) raising errors that request alone too, and since the
    step ran, it is no step failure: the health check stays "ok" (it said 503 until a next step succeeded)."""
    poison = [7, 7, 7, 7, 7]
    if where == "device step":
        obj, name, poisoned = server.loop.engine.worker, "execute", lambda plan, *a, **kw: plan.seqs
    elif where == "host work after planning":
        obj, name, poisoned = server.loop.engine.output_processor, "prompt_targets", lambda req, row: [row]
    else:
        obj, name, poisoned = server.loop.engine.output_processor, "update_text", lambda req, index, now: req.seqs
    step_failed = where != "one request's postprocess"
    real = getattr(obj, name)

    def failing(*args, **kw):
        if any(s.token_ids[:5] == poison for s in poisoned(*args, **kw)):
            raise RuntimeError("injected device failure")
        return real(*args, **kw)

    failures = _metrics(server).get("gdn_jax_step_failures_total", 0)
    monkeypatch.setattr(obj, name, failing)
    try:
        with pytest.raises(openai.InternalServerError, match="injected device failure"):
            client.completions.create(model="tiny", prompt=poison + [9, 10], max_tokens=3)
        assert httpx.get(server.url + "/health").status_code == (503 if step_failed else 200)
        events = [json.loads(line[6:]) for line in httpx.post(
            server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
            json={"model": "tiny", "prompt": poison + [11], "max_tokens": 3, "stream": True}).text.splitlines()
            if line.startswith("data: {")]
        assert "injected device failure" in events[-1]["error"]["message"]
    finally:
        monkeypatch.undo()
    ok = client.completions.create(model="tiny", prompt=poison + [9, 10], max_tokens=3, temperature=0.0)
    assert ok.usage.completion_tokens >= 1
    assert httpx.get(server.url + "/health").text == "ok"
    m = _assert_no_leak(server)
    assert m["gdn_jax_step_failures_total"] == failures + (2 if step_failed else 0)


@pytest.mark.slow
def test_load_200_requests_from_16_clients_no_error_no_leak(server):
    before = _metrics(server)
    rng = np.random.default_rng(11)
    systems = [_text(10, 300 + i) for i in range(3)]
    jobs = []
    for i in range(200):
        prompt = systems[i % 3] + " " + _text(int(rng.integers(1, 10)), 400 + i)
        jobs.append({"model": "tiny", "prompt": prompt, "max_tokens": int(rng.integers(1, 8)),
                     "temperature": float(rng.choice([0.0, 0.8])), "seed": i, "stream": bool(i % 2),
                     **({"echo": True, "logprobs": 1} if i % 7 == 0 else {})})
    errors, done = [], []

    async def worker(queue, ac):
        while not queue.empty():
            job = queue.get_nowait()
            try:
                r = await ac.post("/v1/completions", json=job)
                if r.status_code != 200 or (job["stream"] and not r.text.rstrip().endswith("data: [DONE]")):
                    errors.append((r.status_code, r.text[:200]))
                elif job["stream"] and '"error"' in r.text:
                    errors.append((200, r.text[:200]))
                done.append(1)
            except httpx.HTTPError as e:
                errors.append(("exception", repr(e)))

    async def main():
        queue = asyncio.Queue()
        for job in jobs:
            queue.put_nowait(job)
        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"},
                                     timeout=300) as ac:
            await asyncio.gather(*(worker(queue, ac) for _ in range(16)))

    asyncio.run(main())
    assert errors == [] and len(done) == 200
    m = _assert_no_leak(server)
    finished = sum(v for k, v in m.items() if k.startswith("gdn_jax_requests_finished_total"))
    assert finished - sum(v for k, v in before.items() if k.startswith("gdn_jax_requests_finished_total")) == 200


def _post(server, body: dict, path: str = "/v1/completions", url: str | None = None) -> httpx.Response:
    return httpx.post((url or server.url) + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                      json={"model": "tiny", **body})


def _streamed(server, body: dict, path: str = "/v1/completions", url: str | None = None) -> list[dict]:
    """The choices of a streamed response, in order."""
    with httpx.stream("POST", (url or server.url) + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                      json={"model": "tiny", "stream": True, **body}) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    return [c for line in lines for c in json.loads(line)["choices"]]


def _joined(choices: list[dict], key: str) -> list:
    return [x for c in choices if c["logprobs"] for x in c["logprobs"][key]]


def test_off_values_of_unimplemented_fields_and_fields_without_effect_are_accepted(server):
    for extra in ({"logit_bias": {}}, {"best_of": 1}, {"suffix": ""}, {"user": "someone"}):
        r = _post(server, {"prompt": "hi", "max_tokens": 2, **extra})
        assert r.status_code == 200, (extra, r.text)
    for extra, field in (({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
                         ({"response_format": {"type": "json_object"}}, "response_format"),
                         ({"logit_bias": {"36": 5}}, "logit_bias")):
        r = _post(server, {"messages": [{"role": "user", "content": "hi"}], **extra}, "/v1/chat/completions",
                  server.chat_url)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    r = httpx.get(server.url + "/v1/nope")  # an unknown path: the API's error shape too
    assert r.status_code == 404 and "/v1/nope" in r.json()["error"]["message"]


def test_max_tokens_0_with_echo_and_logprobs_scores_the_prompt_alone(server):
    """The legacy scoring call: the prompt's logprobs, nothing generated; also for a prompt that fills the context
    (which max_tokens 1 cannot extend)."""
    prompt = _text(20, 21)
    n = len(prompt.encode())
    one = _post(server, {"prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 2}).json()["choices"][0]
    r = _post(server, {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2}).json()
    got = r["choices"][0]
    assert got["text"] == prompt and got["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 0
    assert r["usage"]["prompt_tokens"] == n and len(got["logprobs"]["tokens"]) == n
    for key in ("tokens", "text_offset", "top_logprobs"):
        assert got["logprobs"][key] == one["logprobs"][key][:n], key
    assert got["logprobs"]["token_logprobs"][0] is None
    np.testing.assert_allclose(got["logprobs"]["token_logprobs"][1:], one["logprobs"]["token_logprobs"][1:n],
                               atol=1e-5, rtol=0)
    chunks = _streamed(server, {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2})
    assert "".join(c["text"] for c in chunks) == prompt and _joined(chunks, "tokens") == got["logprobs"]["tokens"]
    assert chunks[-1]["finish_reason"] == "length"
    full = [5 + i % 200 for i in range(ENGINE_KW["max_model_len"])]
    assert _post(server, {"prompt": full, "max_tokens": 0, "echo": True, "logprobs": 1}).status_code == 200
    assert _post(server, {"prompt": full, "max_tokens": 1, "echo": True, "logprobs": 1}).status_code == 400


def test_text_offsets_count_characters_of_the_choice_text(server):
    """Multi-byte characters: each byte is a token of this model; a byte inside a character starts at it."""
    prompt = "café ü 日本 x"  # é and ü: 2 bytes, 日 and 本: 3
    body = {"prompt": prompt, "max_tokens": 8, "echo": True, "logprobs": 1, "temperature": 0.0, "ignore_eos": True}
    choice = _post(server, body).json()["choices"][0]
    chunks = _streamed(server, body)
    n = len(prompt.encode())
    for text, tokens, offsets in ((choice["text"], choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]),
                                  ("".join(c["text"] for c in chunks), _joined(chunks, "tokens"),
                                   _joined(chunks, "text_offset"))):
        assert text.startswith(prompt) and len(tokens) == len(offsets) == n + 8
        assert offsets[:n] == [0, 1, 2, 3, 3, 4, 5, 5, 6, 7, 7, 7, 8, 8, 8, 9, 10]
        assert offsets[n] == len(prompt) and offsets == sorted(offsets) and offsets[-1] <= len(text)
        assert all(text[o:o + len(t)] == t for t, o in zip(tokens, offsets) if "\ufffd" not in t)
    assert choice["text"] == "".join(c["text"] for c in chunks)


def test_logprobs_cover_the_text_shown_not_a_stop_string_or_a_stop_token(server, offline):
    prompt = "The cat"
    greedy = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    out = offline.generate(prompt, SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    ids, text = out.token_ids, out.text
    body = {"prompt": prompt, "logprobs": 1, **greedy}
    # a stop string: the first two characters after an ASCII start that do not occur earlier
    k = next(k for k in range(1, 20) if text[:k + 2].isascii() and text.find(text[k:k + 2]) == k)
    for got in (_post(server, {**body, "stop": text[k:k + 2]}).json()["choices"][0],
                _streamed(server, {**body, "stop": text[k:k + 2]})):
        shown = got["text"] if isinstance(got, dict) else "".join(c["text"] for c in got)
        tokens = got["logprobs"]["tokens"] if isinstance(got, dict) else _joined(got, "tokens")
        assert shown == text[:k] and "".join(tokens) == shown and len(tokens) == k  # one byte per ASCII character
    # a stop token: its text is not in the output (as in vLLM), it is the stop_reason, and has no logprobs entry
    j = next(j for j in range(2, 24) if ids[j] not in ids[:j] and 4 <= ids[j - 1] < 260)
    r = _post(server, {**body, "stop_token_ids": [ids[j]]}).json()
    got = r["choices"][0]
    assert got["text"] == server.loop.engine.tokenizer.decode(ids[:j]) and r["usage"]["completion_tokens"] == j + 1
    assert (got["finish_reason"], got["stop_reason"], len(got["logprobs"]["tokens"])) == ("stop", ids[j], j)
    chunks = _streamed(server, {**body, "stop_token_ids": [ids[j]]})
    assert "".join(c["text"] for c in chunks) == got["text"] and _joined(chunks, "tokens") == got["logprobs"]["tokens"]
    assert chunks[-1]["stop_reason"] == ids[j]


def test_chat_messages_are_checked_and_logprobs_returned(server):
    url = server.chat_url
    for messages, message in (([{"role": "user"}], "content must be a string"),
                              ([{"role": "user", "content": None}], "content must be a string"),
                              ([{"role": "wizard", "content": "hi"}], "role must be one of"),
                              ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                               "only text parts"),
                              ([{"role": "user", "content": "hi"},  # a former turn's call: not silently dropped
                                {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}],
                               "messages[1].tool_calls: tool calls are not supported")):
        r = _post(server, {"messages": messages}, "/v1/chat/completions", url)
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    r = _post(server, {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "/v1/chat/completions", url)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    # errors name the chat API's own fields, not the completions API's
    hi = [{"role": "user", "content": "hi"}]
    for extra, field, message in (({"logprobs": True, "top_logprobs": 30}, "top_logprobs", "top_logprobs must be in"),
                                  ({"max_completion_tokens": 0}, "max_completion_tokens",
                                   "max_completion_tokens must be in [1, "),
                                  ({"max_tokens": 0}, "max_tokens", "max_tokens must be in [1, ")):
        r = _post(server, {"messages": hi, **extra}, "/v1/chat/completions", url)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == field and message in error["message"], r.text
        assert "echo" not in error["message"]
    # text parts are joined by newlines, as the template then reads them
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "a slot?"}]
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 2}
    r = _post(server, body, "/v1/chat/completions", url).json()
    assert r["usage"]["prompt_tokens"] == len("<|user|>What is\na slot?\n<|assistant|>".encode())
    content, entries = r["choices"][0]["message"]["content"], r["choices"][0]["logprobs"]["content"]
    assert len(entries) == r["usage"]["completion_tokens"] == 8
    assert bytes(b for e in entries for b in e["bytes"]).decode("utf-8", errors="replace") == content
    for e in entries:  # greedy: the chosen token is the likeliest of the two listed
        assert len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][1]["logprob"]
        assert e["logprob"] == pytest.approx(e["top_logprobs"][0]["logprob"], abs=1e-6)
    chunks = _streamed(server, body, "/v1/chat/completions", url)
    streamed = [e for c in chunks if c["logprobs"] for e in c["logprobs"]["content"]]
    assert [(e["token"], e["bytes"]) for e in streamed] == [(e["token"], e["bytes"]) for e in entries]
    np.testing.assert_allclose([e["logprob"] for e in streamed], [e["logprob"] for e in entries], atol=1e-5, rtol=0)
    assert "".join(c["delta"].get("content", "") for c in chunks) == content
    # without max_tokens a chat completion may fill the context (the API's default), up to the server's limit
    r = _post(server, {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}, "/v1/chat/completions",
              url).json()
    assert r["usage"]["total_tokens"] == ENGINE_KW["max_model_len"] and r["choices"][0]["finish_reason"] == "length"


def test_a_chat_message_without_a_role_names_its_place(server):
    """A message without `role` is named to its index (`messages[1].role`), not as the whole `messages` field."""
    msgs = [{"role": "user", "content": "hi"}, {"content": "no role"}]
    r = _post(server, {"messages": msgs}, "/v1/chat/completions", server.chat_url)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "messages[1].role", r.text
    assert error["message"].startswith("invalid field 'messages[1].role': Field required")


def test_chat_checks_its_messages_before_its_other_fields(server):
    """A bad message is the error of a request that has other bad fields too (top_logprobs without logprobs): the
    messages are checked first, before anything else of the request."""
    r = _post(server, {"messages": [{"role": "tool", "content": "x"}], "top_logprobs": 2}, "/v1/chat/completions",
              server.chat_url)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "messages" and "role must be one of" in error["message"], r.text


def test_n_samples_per_prompt_are_the_choices_in_order(server, offline):
    """n > 1: choice i * n + j is sample j of prompt i, the engine's own samples (seeded: the offline engine's),
    streamed or not; chat returns its n replies as choices 0 .. n - 1."""
    prompts = [_text(6, 41), _text(9, 42)]
    sampled = dict(n=3, max_tokens=6, temperature=1.0, seed=5, ignore_eos=True)
    want = [o.text for p in prompts for o in offline.generate(p, SamplingParams(**sampled), use_tqdm=False)[0].outputs]
    assert len(set(want[:3])) > 1  # the samples differ, so the order is checked
    body = {"prompt": prompts, "logprobs": 1, "best_of": 3, **sampled}  # best_of equal to n: the same request
    r = _post(server, body).json()
    assert [c["index"] for c in r["choices"]] == list(range(6)) and [c["text"] for c in r["choices"]] == want
    assert r["usage"]["completion_tokens"] == 6 * 6 and all(len(c["logprobs"]["tokens"]) == 6 for c in r["choices"])
    texts: dict[int, str] = {}
    for c in _streamed(server, body):
        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert [texts[i] for i in range(6)] == want
    chat = {"messages": [{"role": "user", "content": "hi"}], **sampled}
    r = _post(server, chat, "/v1/chat/completions", server.chat_url).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2] and r["usage"]["completion_tokens"] == 18
    replies: dict[int, str] = {}
    for c in _streamed(server, chat, "/v1/chat/completions", server.chat_url):
        replies[c["index"]] = replies.get(c["index"], "") + c["delta"].get("content", "")
    assert [replies[j] for j in range(3)] == [c["message"]["content"] for c in r["choices"]]


def test_chat_templates_render_as_transformers_apply_chat_template_does():
    """transformers compiles a chat template with jinja's loop controls and its `{% generation %}` tag, gives it
    `raise_exception` and `strftime_now`, and a `tojson` that neither escapes HTML nor sorts keys: templates that use
    them (Qwen3.5's raises on a late system message) parse and render the same here."""
    from jinja2 import TemplateError

    from gdn_jax.chat import compile_chat_template
    tpl = compile_chat_template(
        "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
        "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
        "{% if m.role == 'user' %}{% generation %}[{{ m.content | tojson }}]{% endgeneration %}{% break %}{% endif %}"
        "{% endfor %}{{ strftime_now('%Y') | length }}")
    user = {"role": "user", "content": "a<b & é", "meta": {"z": 1, "a": 2}}
    assert tpl.render(messages=[user]) == '["a<b & é"]4'
    assert compile_chat_template("{{ m | tojson }}").render(m={"z": 1, "a": [1]}) == '{"z": 1, "a": [1]}'
    assert compile_chat_template("{{ m | tojson(indent=2) }}").render(m={"a": 1}) == '{\n  "a": 1\n}'
    with pytest.raises(TemplateError, match="System message must be at the beginning"):
        tpl.render(messages=[{"role": "assistant", "content": "hi"}, {"role": "system", "content": "late"}])


def test_a_template_that_raises_names_its_message_in_the_400(server):
    template = ("{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
                "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
                "<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>")
    with ServerThread(create_app(server.loop, ServerConfig(model_name="tiny", chat_template=template))) as chat:
        msgs = [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]
        r = _post(server, {"messages": msgs, "max_tokens": 2}, "/v1/chat/completions", chat.url)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert "System message must be at the beginning." in r.json()["error"]["message"]
        assert _post(server, {"messages": msgs[:1], "max_tokens": 2}, "/v1/chat/completions", chat.url).status_code == 200


def test_serve_renders_the_template_with_the_tokenizer_special_tokens(server, tmp_path, monkeypatch):
    """transformers renders a chat template with the tokenizer's special tokens (tokenizer_config.json's bos_token,
    eos_token, ..., a string or an added-token object; one set to null stays undefined): a template that opens with
    the BOS text or closes assistant turns with the EOS text gets them, from the model folder, also under
    --chat-template."""
    import shutil

    from gdn_jax.entrypoints import cli
    from tests.gdn_jax.helpers import FIXTURE
    folder = tmp_path / "m"
    shutil.copytree(FIXTURE, folder)
    template = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
                "{% if m.role == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}<|assistant|>"
                "{{ pad_token is defined }}")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": {"content": "</s>", "special": True, "__type": "AddedToken"},
        "pad_token": None, "chat_template": template}))
    (tmp_path / "t.jinja").write_text(template.replace("<|assistant|>", "<|bot|>"))
    monkeypatch.setenv("GDN_JAX_CACHE_DIR", "off")
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "more"}]
    for extra, reply in (([], "<|assistant|>"), (["--chat-template", str(tmp_path / "t.jinja")], "<|bot|>")):
        configs = []
        monkeypatch.setattr("gdn_jax.entrypoints.openai.api_server.serve", lambda engine, config, **kw: configs.append(config))
        cli.main(["serve", "--model", str(folder), "--no-warm-up", "--max-model-len", "64", "--max-num-seqs", "2",
                  *extra])
        with ServerThread(create_app(server.loop, configs[0])) as chat:
            # serve's served name is --model as given (a request naming another model is a 404)
            r = _post(server, {"model": str(folder), "messages": msgs, "max_tokens": 1}, "/v1/chat/completions",
                      chat.url)
        rendered = f"<s><|user|>hi<|assistant|>ok</s><|user|>more{reply}False"  # trim_blocks takes each newline
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(rendered.encode()), r.text


def test_chat_template_kwargs_reach_the_template(server):
    """vLLM's `chat_template_kwargs` (Qwen3.5's `enable_thinking`: false opens the reply with an empty think block)
    are template variables; they were dropped as an unknown field, so thinking stayed on."""
    template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"
                "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}")
    hi = [{"role": "user", "content": "hi"}]
    with ServerThread(create_app(server.loop, ServerConfig(model_name="tiny", chat_template=template))) as chat:
        for kwargs, rendered in (({"enable_thinking": False}, "<|user|>hi<|assistant|><think></think>"),
                                 ({"enable_thinking": True}, "<|user|>hi<|assistant|>"),
                                 (None, "<|user|>hi<|assistant|>")):
            r = _post(server, {"messages": hi, "max_tokens": 1, "chat_template_kwargs": kwargs},
                      "/v1/chat/completions", chat.url)
            assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(rendered.encode()), r.text
        r = _post(server, {"messages": hi, "chat_template_kwargs": ["x"]}, "/v1/chat/completions", chat.url)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text


def test_chat_takes_vllms_add_generation_prompt_and_continue_final_message(server):
    """vLLM's request fields: without the generation prompt the rendered prompt ends after the messages; with
    continue_final_message the reply continues the last message (its end-of-turn left out). Both true is a 400;
    given in chat_template_kwargs they win. They were dropped as unknown fields."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]
    for extra, rendered in (({}, "<|user|>hi\n<|assistant|>Sure\n<|assistant|>"),
                            ({"add_generation_prompt": False}, "<|user|>hi\n<|assistant|>Sure\n"),
                            ({"add_generation_prompt": False, "continue_final_message": True},
                             "<|user|>hi\n<|assistant|>Sure"),
                            ({"chat_template_kwargs": {"add_generation_prompt": False, "continue_final_message": True}},
                             "<|user|>hi\n<|assistant|>Sure")):
        r = _post(server, {"messages": msgs, "max_tokens": 1, **extra}, "/v1/chat/completions", server.chat_url)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(rendered.encode()), (extra, r.text)
    r = _post(server, {"messages": msgs, "continue_final_message": True}, "/v1/chat/completions", server.chat_url)
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text
    assert "add_generation_prompt" in r.json()["error"]["message"]
    # a mode given as a string in chat_template_kwargs ("false" would read as true) is refused, naming the field
    r = _post(server, {"messages": msgs, "chat_template_kwargs": {"add_generation_prompt": "false"}},
              "/v1/chat/completions", server.chat_url)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
    assert "add_generation_prompt must be a bool, got 'false'" in r.json()["error"]["message"]


def test_a_conversation_too_long_for_the_context_names_messages(server):
    """The chat API has no `prompt`: a rendered conversation the engine refuses is the `messages` field's error."""
    r = _post(server, {"messages": [{"role": "user", "content": "x" * 300}], "max_tokens": 1},
              "/v1/chat/completions", server.chat_url)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "messages" and "max_model_len" in error["message"], r.text
    assert error["message"].startswith("messages: ")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_request_only_the_engine_refuses_is_a_400_before_the_stream_starts(server, monkeypatch, path):
    """The engine judges what the server's own checks cannot (here, 32 stop ids and the model's further
    end-of-sequence id, one too many): a 400 naming the field, streamed or not; it was an in-band server error
    (code 500) after a 200 when streamed."""
    monkeypatch.setattr(server.loop.engine, "extra_eos_ids", [7])
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if path.endswith("chat/completions") else {
        "prompt": "hi"}
    url = server.chat_url if path.endswith("chat/completions") else None
    for stream in (False, True):
        body = {**prompt, "max_tokens": 2, "stop_token_ids": list(range(10, 42)), "stream": stream}
        r = _post(server, body, path, url)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids", r.text
        assert "end-of-sequence" in r.json()["error"]["message"]
    assert _post(server, {**prompt, "max_tokens": 2, "stop_token_ids": list(range(10, 41))}, path,
                 url).status_code == 200


REPLIES = [  # (the prompt opened a think block, the reply's text, its reasoning, its content)
    (True, "step 1, step 2\n</think>\n\nThe answer is 4.", "step 1, step 2\n", "\n\nThe answer is 4."),
    (True, "still thinking when max_tokens ran out <", "still thinking when max_tokens ran out <", None),
    (True, "a < b and </thin k> is no tag</think>", "a < b and </thin k> is no tag", None),
    (True, "</think>only content", "", "only content"),
    (True, "<think>opened by the prompt, and again</think>ok", "opened by the prompt, and again", "ok"),
    (True, "<thi", "<thi", None),
    (False, "<think>an older template: the reply opens it</think>done", "an older template: the reply opens it",
     "done"),
    (False, "no think block: all content, even </think>", None, "no think block: all content, even </think>"),
    (False, "<thin", None, "<thin"),
    (False, "", None, ""),
]


@pytest.mark.parametrize("opened, text, reasoning, content", REPLIES)
def test_a_reply_splits_into_reasoning_and_content_alike_whole_or_streamed(opened, text, reasoning, content):
    """vLLM's qwen3 reasoning parser's split: the reasoning runs to the first </think>, from the reply's start when the
    prompt opened the block (Qwen3.5), or after a <think> the reply starts with. Streamed in pieces of any size, the
    deltas join to the same parts and never carry a tag's characters (a possible tag start is held back)."""
    from gdn_jax.entrypoints.openai.reasoning import ReasoningStream, split_reasoning
    assert split_reasoning(text, opened, finished=True) == (reasoning, content)
    for size in (1, 2, 3, 5, 64):
        stream, sent = ReasoningStream(opened), {"reasoning": "", "content": ""}
        cuts = list(range(0, len(text), size)) + [len(text)]
        for end in cuts:
            for name, new in stream.advance(text[:end], finished=end == cuts[-1] and end == len(text)).items():
                sent[name] += new
                assert "<think>" not in new and "</think>" not in (sent["reasoning"] if name == "reasoning" else "")
        assert (sent["reasoning"], sent["content"]) == (reasoning or "", content or ""), size


def test_prompts_that_leave_a_think_block_open():
    from gdn_jax.entrypoints.openai.reasoning import prompt_opens_reasoning
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking false
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
    assert prompt_opens_reasoning("<think>an earlier turn</think>answer<|im_start|>assistant\n<think>\n")


def test_the_reasoning_parser_sends_a_think_block_to_reasoning(server):
    """With `reasoning_parser="qwen3"`, a chat reply to a prompt that opens a think block is reasoning up to
    </think> (here the whole of it: a random model writes no tag), the same streamed or not; a prompt that closes the
    block (enable_thinking false) gets a reply of content only. Without the parser, the text is the content."""
    template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"
                "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
                "{% else %}<think>\n{% endif %}")
    body = {"messages": [{"role": "user", "content": "why?"}], "max_tokens": 12, "temperature": 0}
    with ServerThread(create_app(server.loop, ServerConfig(model_name="tiny", chat_template=template))) as plain, \
            ServerThread(create_app(server.loop, ServerConfig(model_name="tiny", chat_template=template,
                                                              reasoning_parser="qwen3"))) as parsed:
        for kwargs, opened in (({}, True), ({"chat_template_kwargs": {"enable_thinking": False}}, False)):
            r = _post(server, {**body, **kwargs}, "/v1/chat/completions", plain.url)
            text = r.json()["choices"][0]["message"]["content"]
            assert text and "reasoning" not in r.json()["choices"][0]["message"]
            r = _post(server, {**body, **kwargs}, "/v1/chat/completions", parsed.url)
            message = r.json()["choices"][0]["message"]
            reasoning, content = (text, None) if opened else (None, text)
            assert (message["reasoning"], message["content"]) == (reasoning, content)
            choices = _streamed(server, {**body, **kwargs}, "/v1/chat/completions", parsed.url)
            streamed = ["".join(c["delta"].get(name, "") for c in choices) for name in ("reasoning", "content")]
            assert streamed == [reasoning or "", content or ""]
            # vLLM's include_reasoning: false leaves the reasoning out, streamed or not
            left_out = {**body, **kwargs, "include_reasoning": False}
            r = _post(server, left_out, "/v1/chat/completions", parsed.url)
            assert (r.json()["choices"][0]["message"]["reasoning"], r.json()["choices"][0]["message"]["content"]) \
                == (None, content)
            choices = _streamed(server, left_out, "/v1/chat/completions", parsed.url)
            assert not any("reasoning" in c["delta"] for c in choices)
            assert "".join(c["delta"].get("content", "") for c in choices) == (content or "")
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        ServerConfig(reasoning_parser="deepseek")


def test_a_reply_of_reasoning_only_can_be_sent_back_in_the_next_turn(server):
    """With the reasoning parser a reply cut before </think> has `content` null. A client that appends the message it
    got to the conversation (as the openai package's users do) sends that null back: an assistant message without
    content is accepted as empty text (vLLM's way), not refused; a user message still needs its content."""
    template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|><think>"
    turn = [{"role": "user", "content": "why?"}]
    body = {"max_tokens": 4, "temperature": 0}
    with ServerThread(create_app(server.loop, ServerConfig(model_name="tiny", chat_template=template,
                                                           reasoning_parser="qwen3"))) as parsed:
        r = _post(server, {**body, "messages": turn}, "/v1/chat/completions", parsed.url)
        message = r.json()["choices"][0]["message"]
        assert message["content"] is None and message["reasoning"]
        r = _post(server, {**body, "messages": turn + [message, {"role": "user", "content": "and?"}]},
                  "/v1/chat/completions", parsed.url)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len("<|user|>why?<|assistant|><|user|>and?<|assistant|><think>")
        r = _post(server, {**body, "messages": [{"role": "user", "content": None}]}, "/v1/chat/completions", parsed.url)
        assert r.status_code == 400 and "content must be a string" in r.json()["error"]["message"]


def test_a_hinted_position_is_kept_and_hit_and_a_bad_one_is_a_400(server, client):
    """`checkpoint_positions` (extra body): a prompt of token ids hinted at 57 keeps the state at 48, off the
    32-token grid; a later prompt sharing 50 tokens then reuses 48 tokens (32 without the hint). A position past
    the prompt is a 400 naming the field."""
    rng = np.random.default_rng(41)
    shared = rng.integers(4, 500, 50).tolist()
    first = client.completions.create(model="tiny", prompt=shared + [3, 3, 3, 3, 3, 3, 3], max_tokens=1,
                                      temperature=0.0, extra_body={"checkpoint_positions": [57]})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model="tiny", prompt=shared + [5, 5], max_tokens=1, temperature=0.0)
    assert second.usage.prompt_tokens_details.cached_tokens == 48
    r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"model": "tiny", "prompt": shared, "max_tokens": 1, "checkpoint_positions": [51]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "checkpoint_positions"
    assert "51 is outside [16, 50]" in r.json()["error"]["message"]


def test_speculative_decoding_serves_the_greedy_text_usage_and_spec_metrics():
    """The trained `tiny` model (it has an MTP block) served with speculative_config {"method": "mtp",
    "num_speculative_tokens": 2}: greedy completions, whole and streamed, are the text and usage of a plain offline
    engine; usage counts output tokens only (accepted drafts are output tokens, rejected ones nothing), as does
    gdn_jax_generation_tokens; /metrics counts the drafts verified and accepted."""
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    kw = dict(block_size=16, chunk_stride=32, max_num_seqs=4, max_model_len=256, verbose=False)
    prompts = ["The gated delta rule keeps a state", "Once upon a time"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = LLM("tiny", **kw).generate(prompts, params, use_tqdm=False)
    loop = EngineLoop(LLMEngine("tiny", speculative_config=spec, **kw)).start()
    try:
        with ServerThread(create_app(loop, ServerConfig(model_name="tiny"))) as srv:
            m = _metrics(srv)
            assert m["gdn_jax_spec_draft_tokens_total"] == 0 == m["gdn_jax_spec_accepted_tokens_total"]
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
            body = dict(model="tiny", max_tokens=24, temperature=0.0, extra_body={"ignore_eos": True})
            both = c.completions.create(prompt=prompts, **body)
            assert [ch.text for ch in sorted(both.choices, key=lambda ch: ch.index)] == [o.outputs[0].text
                                                                                         for o in want]
            outputs = sum(len(o.outputs[0].token_ids) for o in want)
            assert outputs == 48 and both.usage.completion_tokens == outputs
            assert both.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in want)
            assert both.usage.total_tokens == both.usage.prompt_tokens + outputs
            chunks = list(c.completions.create(prompt=prompts[0], stream=True,
                                               stream_options={"include_usage": True}, **body))
            assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want[0].outputs[0].text
            assert chunks[-1].usage.completion_tokens == 24
            for _ in range(100):  # bounded: the engine thread snapshots its stats when it goes idle
                m = _metrics(srv)
                if m["gdn_jax_generation_tokens_total"] == 72:
                    break
                threading.Event().wait(0.1)
            drafts, accepted = m["gdn_jax_spec_draft_tokens_total"], m["gdn_jax_spec_accepted_tokens_total"]
            assert m["gdn_jax_generation_tokens_total"] == 72  # the outputs' tokens, no rejected draft
            assert 0 < accepted <= drafts
            assert m['gdn_jax_cache{stat="spec_draft_tokens"}'] == drafts  # the same engine counters
    finally:
        loop.shutdown()
