"""What chat and text completions share: request -> SamplingParams, starting a request with its
errors mapped to HTTP, merged output streams, logprobs, SSE framing and disconnect handling."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from skyline.engine.frontend.async_llm import (
    AsyncLLM,
    EngineDeadError,
    EngineOverloadedError,
    RequestStream,
)
from skyline.engine.frontend.tokenizer import Tokenizer
from skyline.server.errors import APIError, error_body
from skyline.server.limits import RequestLimits
from skyline.server.metrics import Metrics
from skyline.server.parse import UNICODE_ERROR, Parsed, ParsePool, PrepareTimeout, Rejected
from skyline.server.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    StreamOptions,
    TopLogprob,
    Usage,
)
from skyline.server.tool_parsers.base import ToolFormat
from skyline.types import RequestOutput, SamplingParams, TokenLogprobs, is_valid_unicode

log = logging.getLogger("skyline.server")

T = TypeVar("T")
PREPARE_THREADS = 4
_MIN_LOGPROB = -9999.0  # JSON has no -inf; masked tokens report this (as vLLM does)


@dataclass
class ServerState:
    llm: AsyncLLM
    model_name: str
    metrics: Metrics
    limits: RequestLimits = field(default_factory=RequestLimits)
    tool_format: ToolFormat | None = None  # how the model writes tool calls (--tool-call-parser)
    parse_pool: ParsePool | None = None  # set when the app starts
    shutting_down: bool = False
    token_text_cache: dict[int, str] = field(default_factory=dict)
    # Chat templates and tokenization run here, never on the event loop; a few threads, as
    # tokenizers encodes without the GIL and templates yield it every few milliseconds.
    threads: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        PREPARE_THREADS, thread_name_prefix="skyline-prepare"))

    async def parse(self, kind: str, raw: Request) -> tuple[Parsed, float]:
        """The request body validated and within the limits, and the deadline (monotonic) by
        which the request must be ready to queue."""
        deadline = time.monotonic() + self.limits.prepare_timeout_s
        body = await raw.body()
        assert self.parse_pool is not None, "the app has not started"
        try:
            result = await self.parse_pool.parse(kind, body, self.limits.prepare_timeout_s)
        except PrepareTimeout as e:
            if e.busy:
                raise APIError(503, "the server is busy parsing other large requests; retry "
                                    "shortly", headers={"Retry-After": "1"}) from None
            raise self._timeout(str(e)) from None
        if isinstance(result, Rejected):
            raise APIError(result.status, result.message, param=result.param)
        return result, deadline

    async def in_thread(self, deadline: float, fn: Callable[[], T]) -> T:
        """`fn()` on a preparation thread, by `deadline`. A thread cannot be stopped: what
        runs there bounds itself (the template's RenderLimits, the prompt's length)."""
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(self.threads, fn),
                                          max(deadline - time.monotonic(), 0.001))
        except TimeoutError:
            raise self._timeout("its chat template and tokenization took that long") from None
        except ValueError as e:  # the template or the tokenizer refused the input
            raise APIError(400, str(e)) from None

    def _timeout(self, why: str) -> APIError:
        return APIError(400, f"the request was not ready to run within "
                             f"{self.limits.prepare_timeout_s:g} s ({why}); send a smaller one",
                        code="request_too_expensive")

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves "
                                f"'{self.model_name}'", param="model", code="model_not_found")

    def token_text(self, token_id: int) -> str:
        text = self.token_text_cache.get(token_id)
        if text is None:
            tok = self.llm.tokenizer
            text = tok.decode([token_id], skip_special_tokens=False) if tok else str(token_id)
            self.token_text_cache[token_id] = text
        return text


def encode_text(tok: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text`, as Tokenizer.encode gives them, for a preparation thread: the batch
    entry point holds the GIL only to hand over the text and the ids, not while it encodes."""
    if not is_valid_unicode(text):
        raise ValueError(UNICODE_ERROR)
    backend = tok.backend
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    return encode([text], add_special_tokens=add_special_tokens)[0].ids


def start_request(state: ServerState, prompt: str | list[int], params: SamplingParams,
                  request_id: str, prompt_text: str | None = None) -> RequestStream:
    """Queue a request (its output constraint already checked, by `check_constraint`); its
    errors become the HTTP errors OpenAI clients expect."""
    if state.shutting_down:
        raise APIError(503, "the server is shutting down; retry on another replica",
                       headers={"Retry-After": "5"})
    try:
        return state.llm.add_request(prompt, params, request_id, prompt_text,
                                     structured_checked=True)
    except EngineOverloadedError as e:
        raise APIError(429, str(e), headers={"Retry-After": "1"}) from None
    except EngineDeadError as e:
        raise APIError(503, str(e), headers={"Retry-After": "5"}) from None
    except ValueError as e:
        code = "context_length_exceeded" if "context length" in str(e) else None
        raise APIError(400, str(e), code=code) from None


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the stream's index. Closing the
    iterator (or cancelling its task) aborts every unfinished request."""
    try:
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, s: RequestStream) -> None:
            try:
                async for out in s:
                    queue.put_nowait((i, out))
            except Exception as e:
                queue.put_nowait((i, e))
            finally:
                queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
    finally:
        for s in streams:
            s.close()


async def until_disconnect(request: Request, work: Awaitable[T],
                           on_disconnect: Callable[[], None]) -> T | None:
    """Run `work`; if the client goes away first, cancel it (aborting its requests) and
    return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # e.g. shutdown: the work must not outlive its handler
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        on_disconnect()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        return None
    return task.result()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def sse(obj: BaseModel | dict[str, Any]) -> str:
    if isinstance(obj, BaseModel):
        return f"data: {obj.model_dump_json()}\n\n"
    return f"data: {json.dumps(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"

_MARK = "\x00skyline-text\x00"  # a string no text delta holds in this position


class TextChunks:
    """SSE chunks of one stream that differ only in one choice's new text: the common chunk
    of a streamed response. Its pydantic model is serialized once per choice index, around
    a marker; each chunk is then that JSON with the text, escaped as JSON, in place of the
    marker (the same bytes as `sse(model)`, at a fraction of the cost: building and dumping
    a pydantic model per token per stream is most of the API process's work at hundreds of
    streams)."""

    def __init__(self, build: Callable[[int, str], BaseModel]) -> None:
        """`build(index, text)`: the chunk of choice `index` with new text `text`."""
        self.build = build
        self.parts: dict[int, tuple[str, str]] = {}

    def __call__(self, index: int, text: str) -> str:
        parts = self.parts.get(index)
        if parts is None:
            body = self.build(index, _MARK).model_dump_json()
            head, _, tail = body.partition(json.dumps(_MARK))
            parts = self.parts[index] = ("data: " + head, tail + "\n\n")
        return parts[0] + json.dumps(text, ensure_ascii=False) + parts[1]


def stream_error_status(e: Exception) -> tuple[int, str]:
    """The status and message of an error in the middle of a stream (headers already sent)."""
    if isinstance(e, EngineDeadError):
        return 503, str(e)
    if isinstance(e, ValueError):
        return 400, str(e)
    log.error("stream failed", exc_info=e)
    return 500, f"internal server error ({type(e).__name__})"


def stream_error(e: Exception) -> str:
    """An error in the middle of a stream: an SSE error event."""
    return sse(error_body(*stream_error_status(e)))


def http_error(e: Exception) -> APIError:
    """An error while collecting a whole (non-streamed) response."""
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), headers={"Retry-After": "5"})
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    raise e


def _lp(x: float) -> float:
    return max(x, _MIN_LOGPROB)


def chat_logprobs(state: ServerState, lps: list[TokenLogprobs]) -> ChatLogprobs:
    content = []
    for lp in lps:
        text = state.token_text(lp.token_ids[0])
        top = [TopLogprob(token=(t := state.token_text(i)), logprob=_lp(v),
                          bytes=list(t.encode("utf-8")))
               for i, v in zip(lp.token_ids[1:], lp.logprobs[1:], strict=False)]
        content.append(ChatTokenLogprob(token=text, logprob=_lp(lp.logprobs[0]),
                                        bytes=list(text.encode("utf-8")), top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(state: ServerState, lps: list[TokenLogprobs], offset: int,
                        out: CompletionLogprobs | None = None, k: int | None = None
                        ) -> CompletionLogprobs:
    """The legacy logprobs of tokens from text offset `offset` on, appended to `out`; `k`
    bounds the top logprobs of each (prompt logprobs may hold more)."""
    out = out if out is not None else CompletionLogprobs()
    for lp in lps:
        text = state.token_text(lp.token_ids[0])
        out.tokens.append(text)
        out.token_logprobs.append(_lp(lp.logprobs[0]))
        ids, values = lp.token_ids[1:], lp.logprobs[1:]
        if k is not None:
            ids, values = ids[:k], values[:k]
        top = {state.token_text(i): _lp(v) for i, v in zip(ids, values, strict=False)}
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def echo_logprobs(state: ServerState, prompt_ids: list[int],
                  prompt_lps: list[TokenLogprobs | None], k: int) -> CompletionLogprobs:
    """The legacy logprobs of an echoed prompt: none for its first token, then each token's
    given those before it."""
    first = state.token_text(prompt_ids[0])
    out = CompletionLogprobs(text_offset=[0], token_logprobs=[None], tokens=[first],
                             top_logprobs=[None])
    rest = [lp for lp in prompt_lps[1:] if lp is not None]
    return completion_logprobs(state, rest, len(first), out, k)


def prompt_logprobs_body(state: ServerState, lps: list[TokenLogprobs | None] | None
                         ) -> PromptLogprobs | None:
    """vLLM's prompt_logprobs: per prompt token, None for the first, else its token id and the
    top ones -> {logprob, rank, decoded_token}."""
    if lps is None:
        return None
    out: PromptLogprobs = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        entry = {str(lp.token_ids[0]): PromptLogprob(logprob=_lp(lp.logprobs[0]),
                                                     rank=lp.sampled_rank,
                                                     decoded_token=state.token_text(
                                                         lp.token_ids[0]))}
        for rank, (i, v) in enumerate(zip(lp.token_ids[1:], lp.logprobs[1:], strict=False)):
            entry.setdefault(str(i), PromptLogprob(logprob=_lp(v), rank=rank + 1,
                                                   decoded_token=state.token_text(i)))
        out.append(entry)
    return out


@dataclass
class Choice:
    """One choice accumulated from output deltas."""

    text: str = ""
    num_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, c: Any) -> None:
        self.text += c.text
        self.num_tokens += len(c.token_ids)
        if c.logprobs:
            self.logprobs.extend(c.logprobs)
        if c.finish_reason is not None:
            self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason


def make_usage(num_prompt: int, choices: list[Choice], num_cached: int) -> Usage:
    """A response's usage: `num_prompt` prompt tokens (`num_cached` of them from the prefix
    cache) and every choice's generated tokens."""
    num_generated = sum(c.num_tokens for c in choices)
    return Usage(prompt_tokens=num_prompt, completion_tokens=num_generated,
                 total_tokens=num_prompt + num_generated,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached))


def stream_usage(opts: StreamOptions | None) -> tuple[bool, bool]:
    """(a last chunk with the usage, the usage in every chunk) as stream_options asks."""
    include_usage = opts is not None and opts.include_usage
    return include_usage, include_usage and opts is not None and opts.continuous_usage_stats


def log_finished(rid: str, choices: list[Choice], arrival: float) -> None:
    reasons = ",".join(str(c.finish_reason) for c in choices)
    log.info("%s: finished (%s), %d tokens generated in %.2fs", rid, reasons,
             sum(c.num_tokens for c in choices), time.monotonic() - arrival)


async def collect_whole(raw: Request, rid: str, work: Awaitable[object],
                        done: Callable[[], None]) -> bool:
    """Run `work` (gathering a non-streamed response's outputs), then `done()` whatever
    happened; False if the client left first (its requests are then aborted)."""
    try:
        result = await until_disconnect(raw, work, lambda: None)
    except Exception as e:
        raise http_error(e) from None
    finally:
        done()
    if result is None:
        log.info("%s: client disconnected; aborted", rid)
        return False
    return True
