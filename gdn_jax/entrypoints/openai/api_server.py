"""An OpenAI-compatible HTTP server over the step-level engine (FastAPI + uvicorn, `pip install gdn-jax[serve]`).

One background thread owns the `LLMEngine` and drives `step()` (`EngineLoop`); the HTTP handlers run on the asyncio
loop and never touch the engine (`OpenAIServing`).

Endpoints: POST /v1/completions, POST /v1/chat/completions (models with a chat template), GET /v1/models,
GET /health, GET /metrics (Prometheus text). A request's `model`, if given, must be the served name
(`ServerConfig.model_name`, serve's `--served-model-name`, else its `--model`): another is a 404, as in vLLM. With
`api_key` set, /v1/* needs `Authorization: Bearer <key>`, compared in constant time; /health and /metrics stay open
(bind to loopback, the default, to keep them private).

Connections (`TimedHTTPProtocol`): one idle for `keep_alive_timeout` is closed, before its first request too; one
whose request headers have not all come `header_timeout` after their first byte is closed; a response whose client
leaves it unread for `stream_timeout` is dropped, which aborts its requests as a disconnect does. Shutdown
(SIGTERM, SIGINT): no new connection is accepted; running requests have `shutdown_timeout` to finish, then end (a
stream with an error event and `data: [DONE]`); a connection still open `SHUTDOWN_GRACE_S` later is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from gdn_jax.engine import LLMEngine
from gdn_jax.entrypoints.openai.engine_loop import EngineLoop
from gdn_jax.entrypoints.openai.protocol import BadRequest, EngineError, error_response
from gdn_jax.entrypoints.openai.server_config import ServerConfig
from gdn_jax.entrypoints.openai.serving_chat import OpenAIServingChat
from gdn_jax.entrypoints.openai.serving_completion import OpenAIServingCompletion
from gdn_jax.entrypoints.openai.serving_engine import GracefulShutdown

SHUTDOWN_GRACE_S = 2.0  # past the shutdown's deadline: the time its requests have to send their end
log = logging.getLogger(__name__)


def create_app(loop: EngineLoop, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI application over a started `EngineLoop`."""
    config = config or ServerConfig()
    shutdown = GracefulShutdown()
    completion, chat = OpenAIServingCompletion(loop, config, shutdown), OpenAIServingChat(loop, config, shutdown)
    app = FastAPI(title="gdn-jax", version="0.1.0", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving_completion, app.state.serving_chat = completion, chat
    app.state.server_config, app.state.shutdown = config, shutdown

    @app.exception_handler(BadRequest)
    async def _bad(_: Request, e: BadRequest):
        return error_response(e.status, e.message, e.param, headers=e.headers)

    @app.exception_handler(EngineError)
    async def _engine_failed(_: Request, e: EngineError):
        return error_response(500, str(e))

    @app.exception_handler(StarletteHTTPException)  # an unknown path or method: the same error shape as the rest
    async def _http(request: Request, e: StarletteHTTPException):
        return error_response(e.status_code, f"{e.detail} ({request.method} {request.url.path})")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await completion.create_completion(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await chat.create_chat_completion(request)

    @app.get("/v1/models")
    async def models(request: Request):
        completion.check_auth(request)
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "gdn-jax", "max_model_len": completion.max_model_len}]}

    @app.get("/health")
    async def health():
        if loop.consecutive_failures:
            return PlainTextResponse(f"unhealthy: the last {loop.consecutive_failures} engine step(s) failed", 503)
        return PlainTextResponse("ok")

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(loop.registry), media_type=CONTENT_TYPE_LATEST)

    return app


class TimedHTTPProtocol(AutoHTTPProtocol):
    """uvicorn's HTTP/1.1 protocol with the connection timeouts of the app's `ServerConfig` (the module's docstring).
    uvicorn closes a connection idle after a response; this one closes it idle before its first request too."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.limits: ServerConfig = self.config.app.state.server_config
        self._timers: dict[str, asyncio.TimerHandle] = {}

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is None or self.cycle.response_complete:  # a request whose headers have not all come
            self._arm("header", self.limits.header_timeout, "its request headers did not all come within "
                      f"{self.limits.header_timeout:g} s")
        else:
            self._disarm("header")

    def pause_writing(self) -> None:  # the transport's buffer is full: the client reads nothing
        super().pause_writing()
        self._arm("stream", self.limits.stream_timeout,
                  f"its client read nothing of the response for {self.limits.stream_timeout:g} s")

    def resume_writing(self) -> None:
        super().resume_writing()
        self._disarm("stream")

    def shutdown(self) -> None:
        super().shutdown()
        self._arm("shutdown", self.limits.shutdown_timeout + SHUTDOWN_GRACE_S, "still open at the shutdown's end")

    def connection_lost(self, exc) -> None:
        for name in list(self._timers):
            self._disarm(name)
        super().connection_lost(exc)

    def _arm(self, name: str, delay: float, why: str) -> None:
        if name not in self._timers:
            self._timers[name] = self.loop.call_later(delay, self._drop, name, why)

    def _disarm(self, name: str) -> None:
        timer = self._timers.pop(name, None)
        if timer is not None:
            timer.cancel()

    def _drop(self, name: str, why: str) -> None:
        self._timers.pop(name, None)
        if not self.transport.is_closing():
            log.warning("dropped the connection of %s: %s", "%s:%d" % self.client if self.client else "a client", why)
            self.transport.abort()  # what its buffers hold is dropped; its request sees a disconnect


class _Server(uvicorn.Server):
    """uvicorn's server, whose shutdown first gives the app's running requests their deadline."""

    async def shutdown(self, sockets=None) -> None:
        state = self.config.app.state
        state.shutdown.begin(state.server_config.shutdown_timeout)
        await super().shutdown(sockets=sockets)


def uvicorn_server(app: FastAPI, log_level: str = "info", **kwargs) -> uvicorn.Server:
    """A uvicorn server of `app` (`create_app`'s) with its `ServerConfig`'s timeouts; `kwargs` go to uvicorn.Config."""
    config: ServerConfig = app.state.server_config
    return _Server(uvicorn.Config(app, log_level=log_level, http=TimedHTTPProtocol,
                                  timeout_keep_alive=config.keep_alive_timeout,
                                  timeout_graceful_shutdown=config.shutdown_timeout + 2 * SHUTDOWN_GRACE_S,
                                  **kwargs))


class ServerThread:
    """A uvicorn server in a background thread on a loopback port (tests, benchmarks, notebooks).
    `port=0` picks a free port; `.url` is the base URL."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn_server(app, log_level)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        for _ in range(200):  # bounded: 20 s
            if self.server.started:
                return self
            time.sleep(0.1)
        raise RuntimeError("the server did not start within 20 s")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(self.server.config.timeout_graceful_shutdown + 5)
        self.sock.close()


def serve(engine: LLMEngine, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info") -> None:
    """Runs the server in the foreground until SIGTERM or SIGINT (Ctrl-C), then shuts it down gracefully (a second
    Ctrl-C: at once). uvicorn raises the signal again once the server stopped: SIGTERM then ends the process as it
    would have; SIGINT's KeyboardInterrupt ends this call quietly."""
    loop = EngineLoop(engine).start()
    try:
        uvicorn_server(create_app(loop, config), log_level, host=host, port=port).run()
    except KeyboardInterrupt:
        pass
    finally:
        loop.shutdown()


__all__ = ["EngineLoop", "ServerConfig", "ServerThread", "TimedHTTPProtocol", "create_app", "serve",
           "uvicorn_server"]
