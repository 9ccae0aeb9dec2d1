"""POST /v1/chat/completions."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from skyline.engine.frontend.chat_template import RenderLimits, render_chat_template
from skyline.server.errors import APIError
from skyline.server.metrics import RequestTracker
from skyline.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    DeltaMessage,
    PromptTokensDetails,
    Usage,
    random_id,
)
from skyline.server.serving import (
    SSE_DONE,
    Choice,
    ServerState,
    build_params,
    chat_logprobs,
    encode_text,
    http_error,
    merged,
    sse,
    start_request,
    stream_error,
    until_disconnect,
)

log = logging.getLogger("skyline.server")


def render_chat(state: ServerState, messages: list[dict[str, Any]],
                add_generation_prompt: bool, kwargs: dict[str, Any] | None,
                deadline: float) -> tuple[str, list[int]]:
    """The conversation as prompt text and token ids, through the model's (or the operator's)
    chat template, within the request's limits. Blocking: run it on a preparation thread."""
    tok = state.llm.tokenizer
    if tok is None:
        raise APIError(400, "this model has no tokenizer, so it cannot chat; use /v1/completions "
                            "with prompt token ids")
    if not tok.chat_template:
        raise APIError(400, "this model has no chat template; use /v1/completions, or start the "
                            "server with --chat-template FILE")
    special = {k: v for k, v in (("bos_token", tok.bos_token), ("eos_token", tok.eos_token),
                                 ("unk_token", tok.unk_token), ("pad_token", tok.pad_token))
               if v is not None}
    limits = RenderLimits(max_chars=state.limits.max_prompt_chars, deadline=deadline)
    text = render_chat_template(tok.chat_template, messages,
                                add_generation_prompt=add_generation_prompt,
                                special_tokens=special, limits=limits, **(kwargs or {}))
    return text, encode_text(tok, text, add_special_tokens=False)


def _usage(num_prompt: int, num_generated: int, num_cached: int) -> Usage:
    return Usage(prompt_tokens=num_prompt, completion_tokens=num_generated,
                 total_tokens=num_prompt + num_generated,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached))


async def create_chat_completion(state: ServerState, raw: Request) -> Response:
    parsed, deadline = await state.parse("chat", raw)
    req: ChatCompletionRequest = parsed.request
    assert parsed.messages is not None
    state.check_model(req.model)
    if req.tools and req.tool_choice != "none":
        raise APIError(400, "tool calling is not supported by this server", param="tools")
    max_tokens = req.max_completion_tokens or req.max_tokens
    num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = build_params(req, max_tokens, num_logprobs, state.llm.vocab_size)
    messages = parsed.messages
    text, ids = await state.in_thread(deadline, lambda: render_chat(
        state, messages, req.add_generation_prompt, req.chat_template_kwargs, deadline))
    rid = random_id("chatcmpl")
    stream = start_request(state, ids, params, rid, prompt_text=text)
    log.info("%s: chat, %d prompt tokens, n=%d, max_tokens=%s, stream=%s%s", rid, len(ids),
             req.n, max_tokens, req.stream, f", user={req.user}" if req.user else "")
    tracker = state.metrics.tracker(len(ids))
    headers = {"X-Request-Id": rid}
    if req.stream:
        return StreamingResponse(_stream(state, req, rid, stream, tracker),
                                 media_type="text/event-stream", headers=headers)
    choices = [Choice() for _ in range(req.n)]
    num_cached = 0

    async def collect() -> bool:
        nonlocal num_cached
        async for _, out in merged([stream]):
            tracker.observe(out)
            num_cached = out.num_cached_tokens
            for c in out.outputs:
                choices[c.index].add(c)
        return True

    try:
        done = await until_disconnect(raw, collect(), lambda: None)
    except Exception as e:
        raise http_error(e) from None
    finally:
        stream.close()
        tracker.finish([c.finish_reason for c in choices])
    if done is None:
        log.info("%s: client disconnected; aborted", rid)
        return Response(status_code=499)
    generated = sum(c.num_tokens for c in choices)
    _log_done(rid, choices, generated, tracker)
    body = ChatCompletionResponse(
        id=rid, model=state.model_name,
        choices=[ChatChoice(index=i, message=AssistantMessage(content=c.text),
                            logprobs=chat_logprobs(state, c.logprobs) if req.logprobs else None,
                            finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                 for i, c in enumerate(choices)],
        usage=_usage(len(ids), generated, num_cached),
    )
    return JSONResponse(body.model_dump(), headers=headers)


def _log_done(rid: str, choices: list[Choice], generated: int, tracker: RequestTracker) -> None:
    reasons = ",".join(str(c.finish_reason) for c in choices)
    log.info("%s: finished (%s), %d tokens generated in %.2fs", rid, reasons, generated,
             time.monotonic() - tracker.arrival)


async def _stream(state: ServerState, req: ChatCompletionRequest, rid: str, stream: Any,
                  tracker: RequestTracker) -> AsyncIterator[str]:
    created = int(time.time())
    opts = req.stream_options
    include_usage = opts is not None and opts.include_usage
    continuous = include_usage and opts is not None and opts.continuous_usage_stats
    choices = [Choice() for _ in range(req.n)]
    num_prompt = stream.num_prompt_tokens
    num_cached = 0

    def chunk(items: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return sse(ChatCompletionChunk(id=rid, created=created, model=state.model_name,
                                       choices=items, usage=usage))

    try:
        yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                     for i in range(req.n)])
        async for _, out in merged([stream]):
            tracker.observe(out)
            num_cached = out.num_cached_tokens
            items = []
            for c in out.outputs:
                acc = choices[c.index]
                if acc.finish_reason is not None:
                    continue  # finished earlier; siblings are still running
                acc.add(c)
                if not c.text and c.finish_reason is None and not c.logprobs:
                    continue  # tokens that do not make a whole character yet
                lps = chat_logprobs(state, c.logprobs) if req.logprobs and c.logprobs else None
                items.append(ChatChunkChoice(index=c.index, delta=DeltaMessage(content=c.text),
                                             logprobs=lps, finish_reason=c.finish_reason,
                                             stop_reason=c.stop_reason))
            if items:
                generated = sum(c.num_tokens for c in choices)
                usage = _usage(num_prompt, generated, num_cached) if continuous else None
                yield chunk(items, usage)
        generated = sum(c.num_tokens for c in choices)
        if include_usage:
            yield chunk([], _usage(num_prompt, generated, num_cached))
        yield SSE_DONE
        _log_done(rid, choices, generated, tracker)
    except Exception as e:
        yield stream_error(e)
        yield SSE_DONE
    finally:
        stream.close()
        tracker.finish([c.finish_reason for c in choices])
        if not all(c.finish_reason for c in choices):
            log.info("%s: stream ended early (client gone or shutdown); aborted", rid)
