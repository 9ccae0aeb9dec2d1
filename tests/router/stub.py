"""Stub replicas (aiohttp) and an in-process router for the router's tests: fast, and each
failure on demand. A completion's prompt (or the stub's `mode`) says what the stub does:
  "err"    -> 400 with an OpenAI error body (and an X-Request-Id)
  "busy"   -> 503
  "reset"  -> the connection is dropped before any answer
  "cut"    -> two SSE events, then the connection is dropped
  anything else -> `events` SSE events `gap` seconds apart, then [DONE] (or one JSON body)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from aiohttp import web

from skyline.config import RouterConfig
from skyline.router.app import build_app
from skyline.router.fleet import Fleet
from skyline.router.launch import free_port


@dataclass
class Stub:
    name: str
    events: int = 3
    gap: float = 0.0
    healthy: bool = True
    mode: str = ""
    port: int = 0
    received: list[dict[str, Any]] = field(default_factory=list)
    runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/fleet", self.fleet)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
        await self.runner.setup()
        self.port = self.port or free_port()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def fleet(self, request: web.Request) -> web.Response:
        return web.json_response({"role": "both", "block_size": 4, "num_blocks": 64,
                                  "kv_events_port": None})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stub"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        prompt = self.mode or str(body.get("prompt") or body.get("messages"))
        if "err" in prompt:
            return web.json_response(
                {"error": {"message": "bad", "type": "invalid_request_error", "param": "prompt",
                           "code": 400}}, status=400, headers={"X-Request-Id": "req-1"})
        if "busy" in prompt:
            return web.json_response({"error": {"message": "down", "type": "x", "code": 503}},
                                     status=503)
        if "reset" in prompt:
            assert request.transport is not None
            request.transport.abort()
            await asyncio.sleep(10)
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": self.name}], "usage": {
                "prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11,
                "prompt_tokens_details": {"cached_tokens": 8}}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = 2 if "cut" in prompt else self.events
        for i in range(n):
            await resp.write(f"data: {json.dumps({'choices': [{'text': f'{self.name}{i}'}]})}"
                             f"\n\n".encode())
            await asyncio.sleep(self.gap)
        if "cut" in prompt:
            assert request.transport is not None
            request.transport.abort()
            return resp
        usage = {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 4}}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp


@asynccontextmanager
async def router(stubs: list[Stub], hasher: Any = None, discover: Any = None,
                 **cfg: Any) -> AsyncIterator[str]:
    """A router over the stubs (or those `discover` names), served by uvicorn in this event
    loop; yields its base URL."""
    for s in stubs:
        if s.runner is None and s.port == 0:
            await s.start()
    cfg.setdefault("health_interval_s", 0.2)
    urls = discover() if discover is not None else [s.url for s in stubs]
    fleet = Fleet(RouterConfig(replicas=tuple(urls), **cfg), hasher, discover)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(fleet), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        assert not task.done(), "the router did not start"
        await asyncio.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
        for s in stubs:
            await s.stop()
