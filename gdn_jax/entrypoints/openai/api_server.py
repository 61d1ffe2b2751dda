"""An OpenAI-compatible HTTP server over the step-level engine (FastAPI + uvicorn, `pip install gdn-jax[serve]`).

One background thread owns the `LLMEngine` and drives `step()` (`EngineLoop`); the HTTP handlers run on the asyncio
loop and never touch the engine (`OpenAIServing`).

Endpoints: POST /v1/completions, POST /v1/chat/completions (models with a chat template), GET /v1/models,
GET /health, GET /metrics (Prometheus text). A request's `model`, if given, must be the served name
(`ServerConfig.model_name`, serve's `--served-model-name`, else its `--model`): another is a 404, as in vLLM. With
`api_key` set, /v1/* needs `Authorization: Bearer <key>`, compared in constant time; /health and /metrics stay open
(bind to loopback, the default, to keep them private).
"""

from __future__ import annotations

import socket
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from gdn_jax.engine import LLMEngine
from gdn_jax.entrypoints.openai.engine_loop import EngineLoop
from gdn_jax.entrypoints.openai.protocol import BadRequest, EngineError, error_response
from gdn_jax.entrypoints.openai.serving_chat import OpenAIServingChat
from gdn_jax.entrypoints.openai.serving_completion import OpenAIServingCompletion
from gdn_jax.entrypoints.openai.serving_engine import ServerConfig


def create_app(loop: EngineLoop, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI application over a started `EngineLoop`."""
    config = config or ServerConfig()
    completion, chat = OpenAIServingCompletion(loop, config), OpenAIServingChat(loop, config)
    app = FastAPI(title="gdn-jax", version="0.1.0", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving_completion, app.state.serving_chat = completion, chat

    @app.exception_handler(BadRequest)
    async def _bad(_: Request, e: BadRequest):
        return error_response(e.status, e.message, e.param)

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


class ServerThread:
    """A uvicorn server in a background thread on a loopback port (tests, benchmarks, notebooks).
    `port=0` picks a free port; `.url` is the base URL."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=2))
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
        self.thread.join(10)
        self.sock.close()


def serve(engine: LLMEngine, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info") -> None:
    """Runs the server in the foreground until interrupted."""
    import uvicorn
    loop = EngineLoop(engine).start()
    try:
        uvicorn.run(create_app(loop, config), host=host, port=port, log_level=log_level,
                    timeout_graceful_shutdown=5)
    finally:
        loop.shutdown()


__all__ = ["EngineLoop", "ServerConfig", "ServerThread", "create_app", "serve"]
