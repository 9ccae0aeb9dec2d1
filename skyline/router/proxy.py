"""Forwarding: a client's request to the replica the policy picks, and the replica's answer back
unchanged (status, body, errors, SSE events as they come).

A request is tried on another replica (up to `max_attempts` in all) while nothing of its
answer has reached the client: when the replica refuses the connection or fails before its
first SSE event (or its whole body), or answers 503 (down, shutting down) or 429 (queue full)
while another replica may take it. Once a stream's first event went out, the stream is the
replica's: if the replica fails, the client gets an SSE error event and [DONE].

Streams are relayed event by event: bytes are held only until the event they belong to is
complete (so that an error event never lands inside a half-sent one), and each complete event
is written at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from skyline.router.fleet import Fleet
from skyline.router.replica import Replica
from skyline.server.protocol import ErrorInfo, ErrorResponse

log = logging.getLogger("skyline.router")

# Headers that belong to one connection, not to the request or answer (RFC 9110 7.6.1), and
# those the router sets itself.
_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                  "trailer", "transfer-encoding", "upgrade", "host", "content-length",
                  "accept-encoding"})
_RETRY_STATUS = (429, 503)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                404: "not_found_error", 405: "invalid_request_error",
                413: "invalid_request_error", 503: "service_unavailable"}
SSE_DONE = b"data: [DONE]\n\n"
REPLICA_HEADER = "X-Skyline-Replica"


def error_body(status: int, message: str) -> dict[str, Any]:
    info = ErrorInfo(message=message, type=_ERROR_TYPES.get(status, "server_error"), code=status)
    return ErrorResponse(error=info).model_dump()


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse(error_body(status, message), status_code=status, headers=headers)


def sse_error(status: int, message: str) -> bytes:
    return f"data: {json.dumps(error_body(status, message))}\n\n".encode() + SSE_DONE


class NotStarted(Exception):
    """This attempt failed before anything reached the client."""

    def __init__(self, reason: str, answer: Response | None = None) -> None:
        super().__init__(reason)
        self.answer = answer  # what to give the client if no other replica takes it


@dataclass
class Routed:
    """One request as routed: its prompt and where it went."""

    kind: str | None  # chat | completion | None (not routed by prompt)
    body: bytes
    parsed: dict[str, Any] | None
    num_prompt_tokens: int = 0
    hashes: tuple[bytes, ...] = ()

    @property
    def stream(self) -> bool:
        return self.parsed is not None and self.parsed.get("stream") is True


def record_usage(r: Replica, usage: Any) -> None:
    """Count a response's usage (the replica's actual prefix-cache hits)."""
    if not isinstance(usage, dict):
        return
    details = usage.get("prompt_tokens_details") or {}
    r.usage_prompt_tokens += int(usage.get("prompt_tokens") or 0)
    r.usage_cached_tokens += int(details.get("cached_tokens") or 0)


def _usage_in(event: bytes) -> Any:
    """The usage object of an SSE event that carries one (the last event of a stream with
    include_usage), else None. Only events that mention cached_tokens are parsed."""
    if b'"cached_tokens"' not in event:
        return None
    for line in event.split(b"\n"):
        if line.startswith(b"data:") and b'"cached_tokens"' in line:
            with contextlib.suppress(ValueError, AttributeError):
                return json.loads(line[5:]).get("usage")
    return None


class Proxy:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.num_no_replica = 0

    def forward_headers(self, request: Request) -> dict[str, str]:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        headers.update(self.fleet.headers)  # the router's own key, if it has one
        return headers

    async def forward(self, request: Request, path: str, routed: Routed,
                      roles: tuple[str, ...] | None = None) -> Response:
        """Send the request to a replica (another, while it has not started), return its
        answer."""
        cfg = self.fleet.cfg
        headers = self.forward_headers(request)
        tried: set[int] = set()
        answer: Response | None = None
        for _ in range(cfg.max_attempts):
            candidates = [r for r in self.fleet.healthy(roles) if r.index not in tried]
            if not candidates:
                break
            choice = self.fleet.route(list(routed.hashes), candidates)
            r = choice.replica
            tried.add(r.index)
            try:
                out = await self.attempt(r, request, path, routed, headers)
            except NotStarted as e:
                r.retries += 1
                answer = e.answer or answer
                log.info("request to %s%s did not start (%s); trying another replica",
                         r.name, path, e)
                continue
            self.count(r, routed, choice.hit_blocks)
            return out
        if answer is not None:
            return answer
        self.num_no_replica += 1
        down = "; ".join(f"{r.name}: {r.down_reason}" for r in self.fleet.replicas
                         if not r.healthy) or "every replica failed this request"
        return error_response(503, f"no replica can serve this request now ({down}); retry "
                                   "later", {"Retry-After": "5"})

    def count(self, r: Replica, routed: Routed, hit_blocks: int) -> None:
        r.routed += 1
        if routed.num_prompt_tokens:
            bs = r.block_size or 0
            r.prompt_tokens += routed.num_prompt_tokens
            r.predicted_hit_tokens += min(hit_blocks * bs, routed.num_prompt_tokens - 1)

    async def attempt(self, r: Replica, request: Request, path: str, routed: Routed,
                      headers: dict[str, str]) -> Response:
        """One replica's answer as the client's response; raises NotStarted if it failed before
        any of it could be sent."""
        session = self.fleet.session
        assert session is not None
        r.in_flight += 1
        resp: aiohttp.ClientResponse | None = None
        handed_over = False
        try:
            try:
                resp = await session.request(request.method, f"{r.url}{path}",
                                             data=routed.body or None, headers=headers)
            except (aiohttp.ClientError, TimeoutError, OSError) as e:
                self.fleet.suspect(r, f"{type(e).__name__}: {e}")
                raise NotStarted(f"{type(e).__name__}") from None
            out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
            out_headers[REPLICA_HEADER] = r.name
            is_stream = resp.content_type == "text/event-stream"
            if resp.status in _RETRY_STATUS or not (resp.status == 200 and is_stream):
                data = await self._read_all(r, resp)
                answer = Response(data, status_code=resp.status, headers=out_headers)
                if resp.status in _RETRY_STATUS:
                    raise NotStarted(f"HTTP {resp.status}", answer)
                if resp.status == 200 and resp.content_type == "application/json":
                    with contextlib.suppress(ValueError, AttributeError):
                        record_usage(r, json.loads(data).get("usage"))
                return answer
            first = await self._first_event(r, resp)
            handed_over = True
            return StreamingResponse(self.relay(r, resp, first), status_code=resp.status,
                                     headers=out_headers)
        finally:
            if not handed_over:
                r.in_flight -= 1
                if resp is not None:
                    resp.close()

    async def _read_all(self, r: Replica, resp: aiohttp.ClientResponse) -> bytes:
        try:
            return await resp.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            self.fleet.suspect(r, f"{type(e).__name__} while reading an answer")
            raise NotStarted(f"{type(e).__name__} while reading the answer") from None

    async def _first_event(self, r: Replica, resp: aiohttp.ClientResponse) -> bytes:
        """The stream's first complete event (with any bytes after it): until it arrives the
        request may still go to another replica."""
        buf = b""
        try:
            while (end := buf.find(b"\n\n")) < 0:
                chunk = await resp.content.readany()
                if not chunk:
                    break
                buf += chunk
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            self.fleet.suspect(r, f"{type(e).__name__} before the first event")
            raise NotStarted(f"{type(e).__name__} before the first event") from None
        if end < 0:
            self.fleet.suspect(r, "the stream ended before its first event")
            raise NotStarted("the stream ended before its first event")
        return buf

    async def relay(self, r: Replica, resp: aiohttp.ClientResponse,
                    first: bytes) -> AsyncIterator[bytes]:
        """The replica's SSE stream, complete event by complete event."""
        buf = first
        try:
            while True:
                end = buf.rfind(b"\n\n")
                if end >= 0:
                    out, buf = buf[: end + 2], buf[end + 2:]
                    usage = _usage_in(out)
                    if usage is not None:
                        record_usage(r, usage)
                    yield out
                chunk = await resp.content.readany()
                if not chunk:
                    break
                buf += chunk
            if buf:
                yield buf
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            r.failed_streams += 1
            self.fleet.suspect(r, f"{type(e).__name__} in a stream")
            log.warning("a stream from %s failed (%s: %s); ending it with an error event",
                        r.name, type(e).__name__, e)
            yield sse_error(503, f"the replica serving this request failed "
                                 f"({type(e).__name__}); retry the request")
        finally:
            r.in_flight -= 1
            resp.close()


async def until_disconnect(request: Request, work: asyncio.Future[Response]) -> Response:
    """`work`'s response, or 499 if the client leaves first (then `work` is cancelled, which
    closes its connection to the replica, which aborts the request there)."""
    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if work.done():
        return work.result()
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await work
    return Response(status_code=499)
