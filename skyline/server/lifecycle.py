"""How uvicorn runs the app: a graceful shutdown that ends cut requests with OpenAI-shaped
errors, malformed HTTP answered in JSON, and logs that no client text can forge lines in."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
from collections.abc import Callable
from typing import Any

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from skyline.server.errors import error_body

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def escape_controls(text: str) -> str:
    """Control characters as escapes (a newline as \\n): a log line stays one line, whatever a
    client put in a field that is logged (a traceback is added after, by the formatter)."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


class EscapeControlChars(logging.Filter):
    """On a handler: every record's message rendered once, with its control characters
    escaped."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        escaped = escape_controls(message)
        if escaped != message:
            record.msg, record.args = escaped, None
        return True


def escape_log_controls() -> None:
    """Escape control characters in what every handler configured so far writes."""
    names = ["", "uvicorn", "uvicorn.error", "uvicorn.access"]
    for handler in {h for n in names for h in logging.getLogger(n).handlers}:
        if not any(isinstance(f, EscapeControlChars) for f in handler.filters):
            handler.addFilter(EscapeControlChars())


class JSONErrorProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    """uvicorn's HTTP protocol, with requests it cannot parse (a bad Content-Length, a broken
    request line) answered with an OpenAI-shaped JSON 400 instead of plain text. The hook is
    uvicorn's `send_400_response`; the connection is closed after it, as uvicorn does."""

    def send_400_response(self, msg: str) -> None:
        body = json.dumps(error_body(400, "the HTTP request is malformed (a bad request line, "
                                          "header or Content-Length); fix the client")).encode()
        head = (b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n")
        self.transport.write(head + body)
        self.transport.close()


class DrainingServer(uvicorn.Server):
    """uvicorn.Server that, on SIGTERM / Ctrl-C, calls `on_drain` on the event loop first (stop
    taking requests, then cut what still runs after the drain timeout, so that cut requests end
    with errors the app writes, before uvicorn's own timeout cancels their tasks)."""

    def __init__(self, config: uvicorn.Config, on_drain: Callable[[], None],
                 ignore_sigint: bool = False) -> None:
        """`ignore_sigint`: one of several API processes, which a terminal's Ctrl-C reaches
        with their parent; the parent forwards it as one SIGTERM (a second signal would make
        uvicorn skip the graceful drain)."""
        super().__init__(config)
        self.on_drain = on_drain
        self.ignore_sigint = ignore_sigint
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets=sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.ignore_sigint and sig == signal.SIGINT:
            return
        if not self._draining and self._loop is not None:
            self._draining = True
            self._loop.call_soon_threadsafe(self.on_drain)
        super().handle_exit(sig, frame)
