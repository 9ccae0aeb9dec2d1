"""`skyline router`: one OpenAI-compatible endpoint over replicas.

The routes are the server's: chat and text completions are routed by the policy (the prompt's
cached prefix and the replicas' load); /tokenize, /detokenize and /v1/models go to any healthy
replica; /health is 200 while one replica is healthy; /metrics is the router's own. Bodies,
statuses and errors pass through unchanged; the router's own errors (no replica, a body too
large, a wrong API key) are OpenAI-shaped like the server's.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from skyline.router.fleet import Fleet
from skyline.router.metrics import CONTENT_TYPE, render
from skyline.router.pd import Disaggregated
from skyline.router.proxy import Proxy, Routed, error_response, until_disconnect

log = logging.getLogger("skyline.router")

OFF_LOOP_BYTES = 64 << 10  # bodies larger than this are parsed in a thread
_KINDS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
# What a plain request may go to: a prefill-only replica gets only the prefill halves of
# disaggregated requests (router/pd.py).
SERVING_ROLES = ("both", "decode")

async def _read_body(request: Request, limit: int) -> bytes | None:
    """The body, or None past `limit` bytes."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        return None
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _parse(body: bytes) -> dict[str, Any] | None:
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def build_app(fleet: Fleet, on_stop: Callable[[], None] | None = None) -> Starlette:
    """The router's ASGI app; `on_stop` runs (in a thread) when it stops. Chat and
    completions are disaggregated (router/pd.py) while the fleet has a prefill replica."""
    proxy = Proxy(fleet)
    disaggregated = Disaggregated(fleet, proxy)
    cfg = fleet.cfg
    key = cfg.api_key.encode() if cfg.api_key else None

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await fleet.start()
        try:
            yield
        finally:
            await fleet.close()
            # Here, not after uvicorn returns: uvicorn re-raises SIGTERM once it has stopped.
            if on_stop is not None:
                await asyncio.to_thread(on_stop)

    def authorized(request: Request) -> bool:
        if key is None:
            return True
        auth = request.headers.get("authorization", "")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        return hmac.compare_digest(token.encode(), key)

    async def routed(request: Request) -> Response:
        path = request.url.path
        if not authorized(request):
            return error_response(401, "invalid or missing API key; send it as "
                                       "'Authorization: Bearer <key>'",
                                  {"WWW-Authenticate": "Bearer"})
        body = await _read_body(request, cfg.max_body_bytes)
        if body is None:
            return error_response(413, f"the request body is larger than {cfg.max_body_bytes} "
                                       "bytes; send a smaller one")
        kind = _KINDS.get(path)
        parsed = None
        if kind is not None:
            parsed = (await asyncio.to_thread(_parse, body) if len(body) > OFF_LOOP_BYTES
                      else _parse(body))
        if parsed is not None and "kv_transfer_params" in parsed:
            # the router's own field: a client's would make replicas move KV at its bidding
            return error_response(400, "kv_transfer_params is set by the router, not by "
                                       "clients; remove it")
        req = Routed(kind, body, parsed)
        pd = kind is not None and bool(fleet.healthy(("prefill",)))
        if kind is not None and (fleet.policy.uses_cache or pd):
            n, hashes = await fleet.prompt_hashes(kind, parsed, fleet.block_size())
            req.num_prompt_tokens, req.hashes = n, tuple(hashes)
        if pd:
            work = asyncio.ensure_future(disaggregated(request, req))
        else:
            work = asyncio.ensure_future(proxy.forward(request, path, req, SERVING_ROLES))
        return await until_disconnect(request, work)

    async def health(request: Request) -> Response:
        if fleet.healthy():
            return Response(status_code=200)
        down = "; ".join(f"{r.name}: {r.down_reason}" for r in fleet.replicas)
        return error_response(503, f"no replica is healthy ({down})")

    async def metrics(request: Request) -> Response:
        return Response(render(fleet, lambda: proxy.num_no_replica), media_type=CONTENT_TYPE)

    async def not_found(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 405:
            return error_response(405, f"{request.method} is not allowed on {request.url.path}")
        return error_response(exc.status_code, f"there is no route {request.url.path}")

    async def bug(request: Request, exc: Exception) -> Response:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal router error ({type(exc).__name__}); this is a "
                                   "bug in skyline, please report it")

    routes = [
        Route("/v1/chat/completions", routed, methods=["POST"]),
        Route("/v1/completions", routed, methods=["POST"]),
        Route("/tokenize", routed, methods=["POST"]),
        Route("/detokenize", routed, methods=["POST"]),
        Route("/v1/models", routed, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: not_found, Exception: bug})
    app.state.fleet = fleet
    app.state.proxy = proxy
    return app


def serve(fleet: Fleet, sock: socket.socket, log_level: str = "info",
          on_stop: Callable[[], None] | None = None) -> None:
    """Run the router on `sock` (bound by the caller, listened on from here) until SIGTERM /
    Ctrl-C, then `on_stop`."""
    import uvicorn

    app = build_app(fleet, on_stop)
    sock.listen(2048)
    host, port = sock.getsockname()[:2]
    names = ", ".join(r.url for r in fleet.replicas)
    print(f"skyline: routing at http://{host}:{port}/v1 over {len(fleet.replicas)} "
          f"replica(s) ({names}), policy {fleet.cfg.policy}", flush=True)
    config = uvicorn.Config(app, log_level=log_level, access_log=False)
    uvicorn.Server(config).run(sockets=[sock])
