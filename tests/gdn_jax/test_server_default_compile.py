"""The server as a user starts it, compiled with XLA's default options.

`make test` runs the server's own tests (test_server.py) with LLVM's optimisation off, to save compile time. This
file runs in a group that compiles as a user's engine does: the server's engine thread compiles the step shapes of
its requests (on the stack the server gives that thread) and answers what the offline engine answers, streamed or
not."""

import json
import os

import httpx
import pytest

from gdn_jax import LLM, LLMEngine, SamplingParams
from gdn_jax.entrypoints.openai.api_server import ServerThread, create_app
from gdn_jax.entrypoints.openai.engine_loop import EngineLoop
from gdn_jax.entrypoints.openai.serving_engine import ServerConfig

pytestmark = pytest.mark.compiled

# a geometry of its own: no other test of its group compiles its step shapes into the persistent cache first
ENGINE_KW = dict(block_size=16, chunk_stride=32, max_num_seqs=4, max_model_len=112, verbose=False)


def test_the_engine_thread_compiles_with_default_options_and_answers_as_offline():
    assert "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "")  # not a reduced-compile group
    prompt, body = "The prefix cache restores", {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    loop = EngineLoop(LLMEngine("tiny-random", **ENGINE_KW)).start()
    try:
        with ServerThread(create_app(loop, ServerConfig(model_name="tiny"))) as server:
            r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, **body}, timeout=300)
            with httpx.stream("POST", server.url + "/v1/completions", timeout=300,
                              json={"prompt": prompt, "stream": True, **body}) as s:
                events = [line[6:] for line in s.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
        assert loop.engine.cache_stats()["compilations"] > 0  # the engine thread compiled them
    finally:
        loop.shutdown()
    assert r.status_code == 200, r.text
    offline = LLM("tiny-random", **ENGINE_KW).generate(prompt, SamplingParams(**body), use_tqdm=False)[0]
    text = offline.outputs[0].text
    assert r.json()["choices"][0]["text"] == text
    assert "".join(c["text"] for e in events for c in json.loads(e)["choices"]) == text
