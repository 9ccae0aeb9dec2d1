"""Request bodies to validated requests, held to the RequestLimits, off the event loop.

Parsing and validating JSON holds the GIL: a 13 MB body of tiny objects takes pydantic seconds,
and a thread would stall /health and every stream for as long. So a body larger than
INLINE_BODY_BYTES is parsed in a worker process (`python -m skyline.server.parse`, which imports
pydantic and the protocol only), and a worker that runs past its time limit is killed and
replaced. What comes back is bounded by the limits, so reading it back is cheap. A small body
is parsed on the event loop, where it costs less than the round trip.

Worker protocol over stdin/stdout: frames of an 8-byte big-endian length and a pickle; the first
frame to a worker is its RequestLimits, then (kind, body) -> Parsed | Rejected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import struct
import sys
import time
from dataclasses import dataclass
from typing import Any, BinaryIO

import pydantic

from skyline.server.limits import (
    LimitError,
    RequestLimits,
    check_chat,
    check_completion,
    check_detokenize,
)
from skyline.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from skyline.server.responses.protocol import ResponsesRequest
from skyline.server.tool_parsers.base import arguments_object

log = logging.getLogger("skyline.server")

INLINE_BODY_BYTES = 64 << 10  # pydantic validates this much of any JSON in a few milliseconds
UNICODE_ERROR = ("the request holds a string that is not valid Unicode (a lone surrogate such as "
                 "\\ud800, or bytes that are not UTF-8); send UTF-8 text")
_MODELS: dict[str, type[pydantic.BaseModel]] = {
    "chat": ChatCompletionRequest, "completion": CompletionRequest,
    "tokenize": TokenizeRequest, "detokenize": DetokenizeRequest,
    "responses": ResponsesRequest,
}
_HEADER = struct.Struct(">Q")


@dataclass
class Parsed:
    """A validated request; the messages of a chat (or tokenize) request travel as the plain
    dicts the chat template reads, and its `messages` field is emptied."""

    request: Any
    messages: list[dict[str, Any]] | None = None
    source: Any = None  # a Responses request, whose `request` is its chat request


@dataclass
class Rejected:
    status: int
    message: str
    param: str | None = None


class PrepareTimeout(Exception):
    """The request was not prepared within the time limit: because of its own cost, or (`busy`)
    because every worker stayed busy with others."""

    def __init__(self, message: str, busy: bool = False) -> None:
        super().__init__(message)
        self.busy = busy


def validation_message(errors: list[Any]) -> tuple[str, str | None]:
    """pydantic's first error as one sentence, and the field it names."""
    if not errors:
        return "the request body is invalid", None
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    # Unions report one error per member; the first one's location is the useful part.
    loc = [x for x in loc if not x.startswith(("list[", "str", "int", "function-"))]
    field = ".".join(loc) or None
    kind, msg = e.get("type", ""), str(e.get("msg", ""))
    if kind == "json_invalid":
        if "surrogate" in msg or "hex escape" in msg or "unicode" in msg.lower():
            return UNICODE_ERROR, None
        if "line 1 column 0" in msg:
            return "the request body is missing; send a JSON object", None
        return "the request body is not valid JSON", None
    if kind == "missing" and field is None:
        return "the request body is missing; send a JSON object", None
    if kind == "missing":
        return f"the field '{field}' is required", field
    if field is None:
        return f"the request body is invalid: {msg}", None
    return f"invalid value for '{field}': {msg}", field


def to_template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Chat messages as the template reads them (text parts joined; developer -> system)."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            parts = []
            for p in content:
                if p.type != "text" or p.text is None:
                    raise LimitError(f"messages[{i}] has a '{p.type}' content part; this model "
                                     "reads text parts only", "messages")
                parts.append(p.text)
            content = "".join(parts)
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                               "content": content or ""}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            # arguments as objects: chat templates write them with `tojson`
            msg["tool_calls"] = [{"id": c.id or f"call_{i}_{j}", "type": "function",
                                  "function": {"name": c.function.name,
                                               "arguments": arguments_object(c.function.arguments)}}
                                 for j, c in enumerate(m.tool_calls)]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def _responses_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """A Responses request as its chat request (pydantic.ValidationError, LimitError)."""
    if req.previous_response_id is not None:
        raise LimitError("previous_response_id is not supported: this server stores no "
                         "responses; send the whole conversation as input",
                         "previous_response_id")
    try:
        return req.to_chat()
    except ValueError as e:
        if isinstance(e, pydantic.ValidationError):
            raise
        raise LimitError(str(e), "input") from None


def parse(kind: str, body: bytes, limits: RequestLimits) -> Parsed | Rejected:
    """Parse and validate one body of `kind` (chat, completion, tokenize, detokenize,
    responses: read as its chat request, the original in `Parsed.source`)."""
    source = None
    try:
        req = _MODELS[kind].model_validate_json(body)
        if isinstance(req, ResponsesRequest):
            source, req = req, _responses_chat(req)
            source.input = ""  # the conversation travels as `messages`
    except pydantic.ValidationError as e:
        message, param = validation_message(e.errors(include_url=False))
        return Rejected(400, message, param)
    except LimitError as e:
        return Rejected(400, str(e), e.param)
    try:
        if isinstance(req, ChatCompletionRequest):
            check_chat(req, limits)
        elif isinstance(req, CompletionRequest):
            check_completion(req, limits)
        elif isinstance(req, DetokenizeRequest):
            check_detokenize(req.tokens, limits)
        messages = None
        if isinstance(req, ChatCompletionRequest | TokenizeRequest) and req.messages is not None:
            messages = to_template_messages(req.messages)
            chars = sum(len(m["content"]) for m in messages)
            if chars > limits.max_prompt_chars:
                raise LimitError(f"the messages hold {chars} characters; this server allows "
                                 f"{limits.max_prompt_chars} per prompt", "messages")
            req.messages = []
    except LimitError as e:
        return Rejected(400, str(e), e.param)
    return Parsed(req, messages, source)


# ---------------------------------------------------------------------------------- workers


def _write(f: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(_HEADER.pack(len(data)) + data)
    f.flush()


def _read(f: BinaryIO) -> Any:
    header = f.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError
    (n,) = _HEADER.unpack(header)
    return pickle.loads(f.read(n))


def _serve_worker() -> None:
    """A parse worker's loop: frames in on stdin, frames out on stdout, until stdin closes."""
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but frames may reach the parent's pipe
    limits: RequestLimits = _read(inp)
    while True:
        try:
            kind, body = _read(inp)
        except EOFError:
            return
        _write(out, parse(kind, body, limits))


class _Worker:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def call(self, kind: str, body: bytes) -> Parsed | Rejected:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        data = pickle.dumps((kind, body), protocol=pickle.HIGHEST_PROTOCOL)
        self.proc.stdin.write(_HEADER.pack(len(data)) + data)
        await self.proc.stdin.drain()
        (n,) = _HEADER.unpack(await self.proc.stdout.readexactly(_HEADER.size))
        return pickle.loads(await self.proc.stdout.readexactly(n))  # from our own child

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()


class ParsePool:
    """Worker processes that parse large bodies; `start` and `close` on the event loop."""

    def __init__(self, num_workers: int, limits: RequestLimits) -> None:
        self.num_workers = max(1, num_workers)
        self.limits = limits
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._all: set[_Worker] = set()
        self._spawning: set[asyncio.Task[None]] = set()
        self._closed = False

    async def start(self) -> None:
        await asyncio.gather(*(self._spawn() for _ in range(self.num_workers)))

    async def parse(self, kind: str, body: bytes, timeout: float) -> Parsed | Rejected:
        """Parse `body` (inline when small); raise PrepareTimeout after `timeout` seconds."""
        if len(body) <= INLINE_BODY_BYTES:
            return parse(kind, body, self.limits)
        deadline = time.monotonic() + timeout
        try:
            worker = await asyncio.wait_for(self._idle.get(), timeout)
        except TimeoutError:
            raise PrepareTimeout("every body parser stayed busy", busy=True) from None
        try:
            result = await asyncio.wait_for(worker.call(kind, body),
                                            max(deadline - time.monotonic(), 0.001))
        except BaseException as e:
            # Timed out, cancelled (the client left) or dead: its pipe may hold a stale reply,
            # so it is replaced rather than reused.
            self._replace(worker)
            if isinstance(e, TimeoutError):
                raise PrepareTimeout("its body took that long to parse") from None
            if isinstance(e, asyncio.IncompleteReadError | ConnectionError):
                raise RuntimeError("a parse worker died") from None
            raise
        self._idle.put_nowait(worker)
        return result

    async def close(self) -> None:
        self._closed = True
        for t in self._spawning:
            t.cancel()
        for w in list(self._all):
            w.kill()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(w.proc.wait(), 5)
        self._all.clear()

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._all.discard(worker)
        if not self._closed:
            task = asyncio.get_running_loop().create_task(self._spawn())
            self._spawning.add(task)
            task.add_done_callback(self._spawning.discard)

    async def _spawn(self) -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "skyline.server.parse",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        worker = _Worker(proc)
        assert proc.stdin is not None
        data = pickle.dumps(self.limits, protocol=pickle.HIGHEST_PROTOCOL)
        proc.stdin.write(_HEADER.pack(len(data)) + data)
        await proc.stdin.drain()
        if self._closed:
            worker.kill()
            return
        self._all.add(worker)
        self._idle.put_nowait(worker)


if __name__ == "__main__":
    # Run the module's own copy (not __main__'s), so that the replies pickle as
    # skyline.server.parse.Parsed, which the parent can read.
    from skyline.server.parse import _serve_worker as serve_worker

    serve_worker()
