"""Two processes joined by jax.distributed on 127.0.0.1, one CPU device each, run one engine split over both
(tensor_parallel_size=2): each gives the tokens and logprobs of a one-process, one-device engine."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from gdn_jax import LLM, SamplingParams, distributed
from gdn_jax.entrypoints import cli
from tests.gdn_jax.helpers import random_ids

pytestmark = pytest.mark.mesh

KW = dict(block_size=16, chunk_stride=32, max_num_seqs=4, max_model_len=192, verbose=False)
PARAMS = dict(temperature=0.0, max_tokens=8, logprobs=1, ignore_eos=True)

# one process of the two: the same engine and requests on each (the scheduler runs on every process)
PROCESS = """
import json, sys
from gdn_jax import LLM, SamplingParams, distributed
assert distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))
import jax
llm = LLM("tiny-random", tensor_parallel_size=2, **json.loads(sys.argv[3]))
outs = llm.generate(json.loads(sys.argv[4]), SamplingParams(**json.loads(sys.argv[5])), use_tqdm=False)
print("RESULT", json.dumps({"processes": jax.process_count(), "devices": len(jax.devices()),
      "local": len(jax.local_devices()), "cached": [o.num_cached_tokens for o in outs],
      "outputs": [[o.outputs[0].token_ids, [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                   o.outputs[0].logprobs)]] for o in outs]}))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_on_loopback_give_the_one_process_outputs():
    rng = np.random.default_rng(2)
    system = random_ids(rng, 70)
    prompts = [system + random_ids(rng, 5), random_ids(rng, 30), system + random_ids(rng, 20)]
    address = f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
    args = [json.dumps(KW), json.dumps(prompts), json.dumps(PARAMS)]
    procs = [subprocess.Popen([sys.executable, "-c", PROCESS, address, str(i), *args], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(next(line[7:] for line in out.splitlines() if line.startswith("RESULT "))))
    want = LLM("tiny-random", **KW).generate(prompts, SamplingParams(**PARAMS), use_tqdm=False)
    for got in results:
        assert (got["processes"], got["devices"], got["local"]) == (2, 2, 1)
        assert got["cached"] == [w.num_cached_tokens for w in want]
        for (tokens, logprobs), w in zip(got["outputs"], want, strict=True):
            assert tokens == w.outputs[0].token_ids
            np.testing.assert_allclose(logprobs, [lp[t].logprob for t, lp in zip(w.outputs[0].token_ids,
                                                                                 w.outputs[0].logprobs)], atol=1e-4)


def test_several_host_settings_are_checked(monkeypatch):
    assert distributed.settings() is None
    assert distributed.settings("10.0.0.1:1234", 4, 3) == ("10.0.0.1:1234", 4, 3)
    monkeypatch.setenv("GDN_JAX_COORDINATOR_ADDRESS", "127.0.0.1:9")
    monkeypatch.setenv("GDN_JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("GDN_JAX_PROCESS_ID", "1")
    assert distributed.settings() == ("127.0.0.1:9", 2, 1)
    with pytest.raises(ValueError, match=r"process_id must be in \[0, num_processes\)"):
        distributed.settings(process_id=2)
    with pytest.raises(ValueError, match="host:port"):
        distributed.settings("127.0.0.1")
    monkeypatch.setenv("GDN_JAX_PROCESS_ID", "one")
    with pytest.raises(ValueError, match="GDN_JAX_PROCESS_ID"):
        distributed.settings()
    monkeypatch.delenv("GDN_JAX_COORDINATOR_ADDRESS")
    monkeypatch.delenv("GDN_JAX_PROCESS_ID")
    with pytest.raises(ValueError, match="need a coordinator address"):
        distributed.settings()


def test_the_server_refuses_several_processes(monkeypatch, capsys):
    """Its requests would reach one process, whose steps the others could not follow."""
    monkeypatch.setenv("GDN_JAX_COORDINATOR_ADDRESS", "127.0.0.1:9")
    monkeypatch.setenv("GDN_JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("GDN_JAX_PROCESS_ID", "0")
    with pytest.raises(SystemExit):
        cli.main(["serve", "--model", "tiny-random"])
    assert "gdn-jax serve runs on one process" in capsys.readouterr().err
