"""The OpenAI-compatible HTTP server: FastAPI routes over an AsyncLLM, served by uvicorn.

`skyline serve` binds the port, starts the engine-core process, prints what it serves and runs
uvicorn. SIGTERM (or Ctrl-C) stops accepting connections, lets in-flight requests finish for up
to --shutdown-timeout seconds, aborts the rest, then stops the engine.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from skyline.engine.frontend.async_llm import AsyncLLM
from skyline.server.chat import create_chat_completion, render_chat
from skyline.server.completions import create_completion
from skyline.server.errors import APIError, error_body, install_error_handlers
from skyline.server.metrics import CONTENT_TYPE, Metrics
from skyline.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from skyline.server.serving import ServerState

log = logging.getLogger("skyline.server")

_PROTECTED = ("/v1/", "/tokenize", "/detokenize")


class _Guard:
    """ASGI middleware: API key (constant-time compare) and request-body size limit. The body is
    read here, so a too-large one is refused before any parsing, and replayed to the app."""

    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def _reply(self, scope: Any, receive: Any, send: Any, status: int, message: str,
                     headers: dict[str, str] | None = None) -> None:
        await JSONResponse(error_body(status, message), status_code=status,
                           headers=headers)(scope, receive, send)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and scope["path"].startswith(_PROTECTED):
            auth = headers.get(b"authorization", b"")
            token = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.api_key):
                return await self._reply(scope, receive, send, 401,
                                         "invalid or missing API key; send it as "
                                         "'Authorization: Bearer <key>'",
                                         {"WWW-Authenticate": "Bearer"})
        length = headers.get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > self.max_body_bytes
            except ValueError:
                return await self._reply(scope, receive, send, 400, "bad Content-Length header")
            if too_big:
                return await self._reply(scope, receive, send, 413, self._too_big())
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks, total = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            total += len(body)
            if total > self.max_body_bytes:
                return await self._reply(scope, receive, send, 413, self._too_big())
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: wait for the client to disconnect

        await self.app(scope, replay, send)

    def _too_big(self) -> str:
        return f"the request body is larger than {self.max_body_bytes} bytes; send a smaller one"


def build_app(llm: AsyncLLM, *, api_key: str | None = None,
              max_body_bytes: int = 16 << 20) -> FastAPI:
    state = ServerState(llm, llm.model_name, Metrics(llm.model_name, lambda: llm.stats))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        # uvicorn has drained (or cancelled) the in-flight requests: stop the engine now, as
        # uvicorn re-raises SIGTERM once this returns.
        state.shutting_down = True
        llm.shutdown()
        print("skyline: server stopped", file=sys.stderr, flush=True)

    app = FastAPI(title="skyline", version="0.1.0", lifespan=lifespan, docs_url=None,
                  redoc_url=None)
    app.state.skyline = state
    install_error_handlers(app)
    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=max_body_bytes)

    @app.get("/health")
    async def health() -> Response:
        if llm.dead is not None or not llm.engine.alive:
            return JSONResponse(error_body(503, llm.dead or "the engine is not running"),
                                status_code=503)
        return Response(status_code=200)

    @app.get("/fleet")
    async def fleet() -> dict[str, Any]:
        """What a router (skyline/router/) reads when this replica joins."""
        i = llm.info
        return {"pid": os.getpid(), **{k: i.get(k) for k in (
            "model_name", "role", "block_size", "num_blocks", "kv_events_port")}}

    @app.get("/v1/models")
    async def models() -> ModelList:
        card = ModelCard(id=state.model_name, root=llm.info["model_path"],
                         max_model_len=llm.max_model_len)
        return ModelList(data=[card])

    @app.get("/metrics")
    async def metrics() -> Response:
        await llm.refresh_stats()
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        state.check_model(req.model)
        tok = llm.tokenizer
        if tok is None:
            raise APIError(400, "this model has no tokenizer")
        if req.messages is not None:
            _, ids = render_chat(state, req.messages, req.add_generation_prompt, None)
        elif req.prompt is not None:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise APIError(400, "give either 'prompt' or 'messages'")
        return {"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        state.check_model(req.model)
        tok = llm.tokenizer
        if tok is None:
            raise APIError(400, "this model has no tokenizer")
        if any(not 0 <= t < llm.vocab_size for t in req.tokens):
            raise APIError(400, f"tokens must be in 0..{llm.vocab_size - 1}", param="tokens")
        return {"prompt": tok.decode(req.tokens)}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(state, req, raw)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await create_completion(state, req, raw)

    return app


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port "
                      "or stop the process using it") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def banner(llm: AsyncLLM, host: str, port: int) -> str:
    i = llm.info
    where = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    weights = i.get("weights_gib")
    lines = [
        f"skyline: serving {llm.model_name} ({i['model_path']}) at {where}/v1",
        f"  device {i['device']}, dtype {i['dtype']}, context {llm.max_model_len} tokens, "
        f"loaded in {i.get('load_seconds', 0):.1f}s"
        + (f", weights {weights:.2f} GiB" if weights else ""),
        f"  KV cache {i.get('kv_cache_gib', 0):.2f} GiB: {i.get('num_blocks', 0)} blocks of "
        f"{i['block_size']} tokens ({i.get('kv_cache_tokens', 0)} tokens), "
        f"up to {i['max_num_seqs']} running requests",
        f"  engine core: pid {i['pid']}; API process: pid {os.getpid()}",
    ]
    return "\n".join(lines)


def serve(engine_args: Any, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, max_body_bytes: int = 16 << 20,
          shutdown_timeout: float = 30.0, log_level: str = "info") -> None:
    """Run the server until SIGTERM / Ctrl-C. Raises OSError / EngineStartError with one
    sentence when it cannot start."""
    import uvicorn

    sock = bind_socket(host, port)
    try:
        llm = AsyncLLM(engine_args)
    except BaseException:
        sock.close()
        raise
    try:
        app = build_app(llm, api_key=api_key, max_body_bytes=max_body_bytes)
        print(banner(llm, host, sock.getsockname()[1]), flush=True)
        config = uvicorn.Config(app, log_level=log_level, access_log=False,
                                timeout_graceful_shutdown=shutdown_timeout, lifespan="on")
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        llm.shutdown()  # already done by the lifespan unless uvicorn failed
        sock.close()
