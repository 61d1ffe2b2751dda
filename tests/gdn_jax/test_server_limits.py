"""The server against clients that stall or flood it: connection timeouts, a stream whose client never reads, the
queue's limits. A real engine behind `ServerThread`s on loopback ports; raw sockets where a client must misbehave."""

import json
import select
import socket
import threading
import time
import tracemalloc

import httpx
import numpy as np
import pytest

from gdn_jax import LLMEngine
from gdn_jax.entrypoints.openai.api_server import ServerThread, create_app
from gdn_jax.entrypoints.openai.engine_loop import EngineLoop
from gdn_jax.entrypoints.openai.server_config import ServerConfig

pytestmark = pytest.mark.server

ENGINE_KW = dict(block_size=16, chunk_stride=32, max_num_seqs=16, max_model_len=1024)


@pytest.fixture(scope="module")
def loop():
    engine = LLMEngine("tiny-random", verbose=False, **ENGINE_KW)
    loop = EngineLoop(engine).start()
    yield loop
    loop.shutdown()


def _serve(loop, **settings) -> ServerThread:
    return ServerThread(create_app(loop, ServerConfig(model_name="tiny", **settings)))


def _post_head(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()


# The least time a 1 s server timeout may take to act, as measured here: the server's event loop times it from the
# clock it read at the start of its iteration, which can be a few ms old (0.9999 s was seen on a busy machine).
EARLY = 0.98


def _until_closed(sock: socket.socket, limit: float, t0: float | None = None) -> tuple[float, bytes]:
    """(seconds from `t0` (default: now) until the server closed `sock`, what it sent before); a TimeoutError past
    `limit`. A caller that sends first passes the time before sending: the server's timer may start before this
    thread runs again."""
    t0, received = time.monotonic() if t0 is None else t0, b""
    sock.settimeout(limit)
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return time.monotonic() - t0, received


def _is_closed(sock: socket.socket) -> bool:
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


def test_a_half_sent_body_gets_a_408_and_its_connection_closes(loop):
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    with _serve(loop, body_timeout=1.0) as srv, socket.create_connection((srv.host, srv.port)) as sock:
        t0 = time.monotonic()
        sock.sendall(_post_head("/v1/completions", body) + body[:len(body) // 2])
        elapsed, reply = _until_closed(sock, 10, t0)
    assert reply.startswith(b"HTTP/1.1 408 "), reply
    assert b"the request body did not arrive within 1 s" in reply and EARLY <= elapsed < 3, elapsed


def test_headers_that_trickle_in_are_cut_at_the_header_timeout(loop):
    """The header timeout runs from the request's first byte: a client that sends a header line every 0.1 s, never
    ending its headers, is closed after it, not kept alive by each byte."""
    with _serve(loop, header_timeout=1.0) as srv, socket.create_connection((srv.host, srv.port)) as sock:
        t0 = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        for i in range(40):
            time.sleep(0.1)
            try:
                if _is_closed(sock):
                    break
                sock.sendall(b"X-Slow: %d\r\n" % i)
            except OSError:  # closed while the line was on its way
                break
        elapsed = time.monotonic() - t0
    assert EARLY <= elapsed < 2.5, elapsed


def test_idle_connections_are_closed_before_a_first_request_and_after_a_response(loop):
    with _serve(loop, keep_alive_timeout=1.0) as srv:
        t0 = time.monotonic()
        with socket.create_connection((srv.host, srv.port)) as sock:  # connected, nothing sent
            elapsed, reply = _until_closed(sock, 10, t0)
        assert reply == b"" and EARLY <= elapsed < 2.5, elapsed
        with socket.create_connection((srv.host, srv.port)) as sock:
            t0 = time.monotonic()
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            elapsed, reply = _until_closed(sock, 10, t0)
        assert reply.startswith(b"HTTP/1.1 200 ") and reply.endswith(b"ok") and EARLY <= elapsed < 2.5, elapsed


def _aborts(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith('gdn_jax_requests_finished_total{finish_reason="abort"}'):
            return float(line.split()[-1])
    return 0.0


NEVER_READ = dict(n=16, max_tokens=1000, logprobs=5, temperature=1.0, ignore_eos=True, stream=True)
HELD_BOUND = 48 << 20


def _never_reading_client(srv: ServerThread, body: bytes) -> socket.socket:
    """A connection that sends a request and reads nothing of the answer: a small window, so the server's buffers
    fill."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((srv.host, srv.port))
    sock.sendall(_post_head("/v1/completions", body) + body)
    return sock


def _until_it_left_the_engine(loop, limit: float = 120) -> float:
    """Seconds until the one request submitted has left the engine, aborted or at its end."""
    t0, started = time.monotonic(), False
    while time.monotonic() - t0 < limit:
        if started and loop.num_active == 0:
            break
        started |= loop.num_active > 0
        time.sleep(0.05)
    return time.monotonic() - t0


def _bodies(count: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    return [json.dumps({"model": "tiny", "prompt": rng.integers(4, 200, 24).tolist(), "seed": i,
                        **NEVER_READ}).encode() for i in range(count)]


def test_a_client_that_never_reads_holds_bounded_memory(loop):
    """One request of 16 samples x 1000 tokens with 5 logprobs each, whose client never reads, runs to its end: the
    server holds the latest output per prompt meanwhile, not every step's (each holds all the tokens and logprobs so
    far: a queue of them grows with the square of the length). Measured as the most memory Python allocated and
    held while the request ran (the process's RSS would hide it in what an earlier request freed)."""
    warm, never_read = _bodies(2)
    with _serve(loop) as srv:
        r = httpx.post(srv.url + "/v1/completions", content=warm, timeout=300,  # every step shape compiles
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        aborts = _aborts(srv.url)
        tracemalloc.start()
        try:
            with _never_reading_client(srv, never_read):
                elapsed = _until_it_left_the_engine(loop)
                held = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        print(f"\nat most {held / 2**20:.1f} MiB allocated and held in the {elapsed:.1f} s the request ran, its "
              f"client reading nothing")
        assert _aborts(srv.url) == aborts, "the request was aborted before its end"
        assert held < HELD_BOUND, f"the server held {held / 2**20:.1f} MiB for a client that reads nothing"


def test_a_client_that_never_reads_is_dropped_after_the_stream_timeout(loop, monkeypatch):
    """Once the client's buffers are full and it has read nothing for the stream timeout, its connection is dropped
    and its request aborted, its slots and blocks freed. (Steps are slowed to 5 ms, so that the request outlives the
    timeout on any machine.)"""
    worker = loop.engine.worker
    real = worker.execute
    monkeypatch.setattr(worker, "execute", lambda *a, **kw: (threading.Event().wait(0.005), real(*a, **kw))[1])
    with _serve(loop, stream_timeout=1.0) as srv:
        aborts = _aborts(srv.url)
        with _never_reading_client(srv, _bodies(3)[2]):
            elapsed = _until_it_left_the_engine(loop)
        assert _aborts(srv.url) == aborts + 1, "the request ran to its end: it was never aborted"
        assert elapsed >= EARLY
        for _ in range(100):  # bounded: the snapshot follows the abort
            stats = loop.stats
            if stats["num_running"] == 0 and stats["live_slots"] == 0:
                break
            time.sleep(0.05)
        assert loop.num_active == 0 and loop.queued_sequences == 0
        assert stats["num_running"] == stats["num_waiting"] == stats["live_slots"] == 0
        assert stats["kv_blocks_free"] == loop.engine.memory.num_kv_blocks - 1


def test_a_full_queue_is_a_429_with_retry_after_and_a_request_past_the_bound_a_400(loop, monkeypatch):
    """With the engine held inside its first step, a request of 4 samples waits to start: another request would pass
    `max_waiting_sequences` (4) and gets a 429 with Retry-After, served once the queue moved. A request of 2 prompts x
    n=3 passes `max_sequences_per_request` (4) whatever the queue: a 400 naming the bound."""
    worker = loop.engine.worker
    real, entered, release = worker.execute, threading.Event(), threading.Event()

    def held(*args, **kw):
        entered.set()
        release.wait(60)
        return real(*args, **kw)

    monkeypatch.setattr(worker, "execute", held)
    done = {}
    with _serve(loop, max_sequences_per_request=4, max_waiting_sequences=4) as srv:
        def first():
            done["first"] = httpx.post(srv.url + "/v1/completions", timeout=120,
                                       json={"prompt": "a queued request", "n": 4, "max_tokens": 3, "stream": True})

        thread = threading.Thread(target=first)
        thread.start()
        try:
            assert entered.wait(60)
            assert loop.queued_sequences == 4
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": "one more", "max_tokens": 2}, timeout=10)
            assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
            assert "max_waiting_sequences" in r.json()["error"]["message"]
            assert r.json()["error"]["type"] == "rate_limit_error"
        finally:
            release.set()
            thread.join(120)
        assert done["first"].status_code == 200 and done["first"].text.rstrip().endswith("data: [DONE]")
        assert '"error"' not in done["first"].text
        assert loop.queued_sequences == 0
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "one more", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": ["a", "b"], "n": 3, "max_tokens": 2}, timeout=60)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "n", r.text
        assert "adds 6 sequences (2 prompt(s) x n=3); at most 4 per request" in error["message"]


def test_the_prompts_of_one_request_take_one_turn_in_the_queue(loop, monkeypatch):
    """The engine admits its waiting requests group by group in turn: the prompts of one HTTP request are one group,
    so that a client's many prompts wait behind each other, not in front of other clients' requests."""
    groups = []
    real = loop.engine.add_request

    def recording(request_id, *args, queue_group=None, **kw):
        groups.append(queue_group)
        return real(request_id, *args, queue_group=queue_group, **kw)

    monkeypatch.setattr(loop.engine, "add_request", recording)
    with _serve(loop) as srv:
        for prompt in (["a", "b", "c"], "d"):
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60)
            assert r.status_code == 200, r.text
    assert len(groups) == 4 and None not in groups and groups[0] == groups[1] == groups[2] != groups[3]


def test_the_engines_own_full_queue_is_a_429_too(loop, monkeypatch):
    """An engine built with max_waiting_sequences of its own refuses an add with EngineFull: its client gets a 429 with
    Retry-After, not a server error."""
    from gdn_jax.engine import EngineFull

    def full(*args, **kw):
        raise EngineFull(5, 1, 5)

    monkeypatch.setattr(loop.engine, "add_request", full)
    with _serve(loop) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
    assert "past max_waiting_sequences=5" in r.json()["error"]["message"] and loop.queued_sequences == 0


def test_server_config_refuses_bad_limits():
    for settings, message in (({"stream_timeout": 0}, "stream_timeout must be a positive finite number"),
                              ({"body_timeout": float("inf")}, "body_timeout must be a positive finite number"),
                              ({"header_timeout": True}, "header_timeout must be a positive finite number"),
                              ({"max_waiting_sequences": 0}, "max_waiting_sequences must be an integer >= 1"),
                              ({"max_sequences_per_request": 9, "max_waiting_sequences": 8},
                               "max_sequences_per_request (9) must not exceed max_waiting_sequences (8)")):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            ServerConfig(**settings)


def test_serve_flags_reach_the_server_config(monkeypatch):
    import gdn_jax.engine
    from gdn_jax.entrypoints.cli import main
    from gdn_jax.entrypoints.openai import api_server

    seen = {}
    monkeypatch.setattr(gdn_jax.engine, "LLMEngine", lambda config: None)
    monkeypatch.setattr(api_server, "serve", lambda engine, config, **kw: seen.update(config=config))
    limits = ("max_sequences_per_request", "max_waiting_sequences", "stream_timeout", "header_timeout",
              "body_timeout", "keep_alive_timeout", "shutdown_timeout")
    main(["serve", "--no-warm-up", "--port", "0", "--max-sequences-per-request", "7", "--max-waiting-sequences", "9",
          "--stream-timeout", "1.5", "--header-timeout", "2", "--body-timeout", "3", "--keep-alive-timeout", "4",
          "--shutdown-timeout", "0.5"])
    assert [getattr(seen["config"], name) for name in limits] == [7, 9, 1.5, 2.0, 3.0, 4.0, 0.5]
    main(["serve", "--no-warm-up", "--port", "0"])  # unset: ServerConfig's defaults
    assert [getattr(seen["config"], name) for name in limits] == [getattr(ServerConfig, name) for name in limits]
