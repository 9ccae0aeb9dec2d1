"""What the stub OpenAI-style servers of the `bench serve` tests share: reading one HTTP
request (request line, headers, JSON body) from a socketserver handler."""

from __future__ import annotations

import json
import socketserver
from typing import Any


def read_request(handler: socketserver.StreamRequestHandler) -> tuple[str, dict[str, Any]]:
    """(request line, JSON body or {}) of the next request on the handler's connection."""
    request = handler.rfile.readline().decode()
    length = 0
    while (line := handler.rfile.readline().strip()) != b"":
        name, _, value = line.decode().partition(":")
        if name.lower() == "content-length":
            length = int(value)
    return request, json.loads(handler.rfile.read(length) or b"{}")
