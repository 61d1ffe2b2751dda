"""`gdn-jax serve` stopped with streams in flight: the real command in a subprocess on a free loopback port."""

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.server


class Serve:
    """`gdn-jax serve` of tiny-random in a subprocess, its log in a file."""

    def __init__(self, log_path, *flags: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gdn_jax.entrypoints.cli", "serve", "--model", "tiny-random", "--port",
             str(self.port), "--max-model-len", "1024", "--max-num-seqs", "4", "--no-warm-up", *flags],
            stdout=self.log, stderr=subprocess.STDOUT)

    def __enter__(self):
        for _ in range(600):  # bounded: 5 minutes
            assert self.proc.poll() is None, self.log_path.read_text()
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("gdn-jax serve did not start within 5 minutes")

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _stream(url: str, body: dict, events: list, started: threading.Event) -> None:
    """Reads a streamed completion into `events` (each `data:` payload), setting `started` at the first."""
    with httpx.stream("POST", url + "/v1/completions", json={"stream": True, **body}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_ends_every_stream_with_done_and_no_traceback(tmp_path, sig):
    """Stopped with two streams in flight, the server accepts no new connection; the short stream ends normally
    within --shutdown-timeout, the long one at its end with an error event; both then with `data: [DONE]`. SIGTERM
    then ends the process by that signal (as uvicorn does), SIGINT with status 0; nothing logs a traceback."""
    with Serve(tmp_path / "serve.log", "--shutdown-timeout", "2") as srv:
        warm = httpx.post(srv.url + "/v1/completions", json={"prompt": ["a", "b", "c", "d"], "max_tokens": 8},
                          timeout=300)
        assert warm.status_code == 200  # the step shapes of four decoding sequences are compiled
        # the short stream runs first; the long one, 64 samples of 1000 tokens, 4 at a time, outlasts the deadline
        bodies = {"short": {"prompt": "a short one", "max_tokens": 100, "ignore_eos": True},
                  "long": {"prompt": "a long one", "n": 64, "max_tokens": 1000, "ignore_eos": True}}
        events = {name: [] for name in bodies}
        threads = []
        for name, body in bodies.items():
            started = threading.Event()
            threads.append(threading.Thread(target=_stream, args=(srv.url, body, events[name], started)))
            threads[-1].start()
            assert started.wait(120)
        srv.proc.send_signal(sig)
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):
            httpx.get(srv.url + "/health", timeout=5)
        for t in threads:
            t.join(60)
        assert srv.proc.wait(60) == (-sig if sig == signal.SIGTERM else 0)
    for name, got in events.items():
        assert got[-1] == "[DONE]", (name, got[-3:])
    assert json.loads(events["short"][-2])["choices"][0]["finish_reason"] == "length"
    error = json.loads(events["long"][-2])["error"]
    assert error["code"] == 503 and "shut down" in error["message"], error
    log = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in log and "CancelledError" not in log, log
