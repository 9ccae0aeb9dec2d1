"""The ASGI middleware in front of every route: the API key, the request body's size and arrival
time, and bugs answered as OpenAI-shaped 500s. The body is read here, so that a too-large or a
too-slow one is refused before any parsing, and is then replayed to the app."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Any

from fastapi.responses import JSONResponse

from skyline.server.errors import error_body

log = logging.getLogger("skyline.server")

# Open without the API key: load balancers probe it, and it says nothing about the traffic.
PUBLIC_PATHS = frozenset({"/health"})


class Guard:
    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int,
                 body_timeout_s: float = 30.0) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def _reply(self, scope: Any, receive: Any, send: Any, status: int, message: str,
                     headers: dict[str, str] | None = None) -> None:
        await JSONResponse(error_body(status, message), status_code=status,
                           headers=headers)(scope, receive, send)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and scope["path"] not in PUBLIC_PATHS:
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
            return await self._run(scope, receive, send)
        chunks, total = [], 0
        deadline = time.monotonic() + self.body_timeout_s
        while True:
            try:
                msg = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0))
            except TimeoutError:
                log.info("%s %s -> 408: the body did not arrive in %gs", scope["method"],
                         scope["path"], self.body_timeout_s)
                return await self._reply(scope, receive, send, 408,
                                         f"the request body did not arrive within "
                                         f"{self.body_timeout_s:g} s; send it whole, at once",
                                         {"Connection": "close"})
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

        await self._run(scope, replay, send)

    async def _run(self, scope: Any, receive: Any, send: Any) -> None:
        """The app, with a bug answered as an OpenAI-shaped 500 on a connection that stays
        open (Starlette's own handler re-raises, and uvicorn then drops the connection)."""
        started = False

        async def tracked(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:
            log.exception("internal error on %s %s", scope["method"], scope["path"])
            if started:
                raise  # the response is half sent: only closing the connection ends it
            await self._reply(scope, receive, send, 500, "internal server error; this is a bug "
                              "in skyline, please report it (the server log has the details)")

    def _too_big(self) -> str:
        return f"the request body is larger than {self.max_body_bytes} bytes; send a smaller one"
