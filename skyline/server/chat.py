"""POST /v1/chat/completions, with tools (server/tools.py) and constrained output."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from skyline.engine.frontend.async_llm import RequestStream
from skyline.engine.frontend.chat_template import RenderLimits, render_chat_template
from skyline.server.errors import APIError
from skyline.server.metrics import RequestTracker
from skyline.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    DeltaMessage,
    Usage,
    random_id,
)
from skyline.server.sampling import build_params, check_constraint
from skyline.server.serving import (
    SSE_DONE,
    Choice,
    ServerState,
    TextChunks,
    chat_logprobs,
    collect_whole,
    encode_text,
    log_finished,
    make_usage,
    merged,
    prompt_logprobs_body,
    sse,
    start_request,
    stream_error,
    stream_usage,
)
from skyline.server.tools import (
    StreamedChoice,
    ToolPlan,
    finish_reason,
    message,
    plan_tools,
    template_input,
)
from skyline.types import RequestOutput, TokenLogprobs

log = logging.getLogger("skyline.server")


def render_chat(state: ServerState, messages: list[dict[str, Any]],
                add_generation_prompt: bool, kwargs: dict[str, Any] | None,
                deadline: float, tools: list[dict[str, Any]] | None = None
                ) -> tuple[str, list[int]]:
    """The conversation (and the tools it may call) as prompt text and token ids, through the
    model's (or the operator's) chat template, within the request's limits. Blocking: run it
    on a preparation thread."""
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
    messages, tools = template_input(state.tool_format, tok.chat_template, messages, tools)
    text = render_chat_template(tok.chat_template, messages,
                                add_generation_prompt=add_generation_prompt, tools=tools,
                                special_tokens=special, limits=limits, **(kwargs or {}))
    return text, encode_text(tok, text, add_special_tokens=False)


@dataclass
class ChatRun:
    """A chat request, queued: its id, tool plan, prompt and output stream."""

    rid: str
    req: ChatCompletionRequest
    plan: ToolPlan | None
    num_prompt: int
    stream: RequestStream
    tracker: RequestTracker
    choices: list[Choice] = field(default_factory=list)
    num_cached: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def observe(self, out: RequestOutput) -> None:
        self.tracker.observe(out)
        self.num_cached = out.num_cached_tokens
        self.prompt_logprobs = self.prompt_logprobs or out.prompt_logprobs

    def usage(self) -> Usage:
        return make_usage(self.num_prompt, self.choices, self.num_cached)


async def start_chat(state: ServerState, req: ChatCompletionRequest,
                     messages: list[dict[str, Any]], deadline: float,
                     prefix: str = "chatcmpl") -> ChatRun:
    """Check a parsed chat request, render and tokenize it (off the event loop) and queue it;
    its errors are APIErrors."""
    state.check_model(req.model)
    plan = plan_tools(state.tool_format, req)
    max_tokens = req.max_completion_tokens or req.max_tokens
    num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params, constrained_by = build_params(req, max_tokens, num_logprobs, state.llm.vocab_size)
    if plan is not None and plan.forced:
        if constrained_by is not None:
            raise APIError(400, f"tool_choice {req.tool_choice!r} forces a tool call, which "
                                f"{constrained_by} cannot constrain too; send one of them",
                           param=constrained_by)
        constrained_by = "tools"
    if plan is not None and plan.fmt.special_markers:
        params.skip_special_tokens = False  # the text must keep the call markers

    def prepare() -> tuple[str, list[int]]:
        if plan is not None and plan.forced:
            params.grammar = plan.grammar()
        check_constraint(params, constrained_by)
        return render_chat(state, messages, req.add_generation_prompt,
                           req.chat_template_kwargs, deadline, plan.tools if plan else None)

    text, ids = await state.in_thread(deadline, prepare)
    rid = random_id(prefix)
    stream = start_request(state, ids, params, rid, prompt_text=text)
    log.info("%s: chat, %d prompt tokens, n=%d, max_tokens=%s, stream=%s%s%s", rid, len(ids),
             req.n, max_tokens, req.stream, f", {len(plan.tools)} tools" if plan else "",
             f", user={req.user}" if req.user else "")
    return ChatRun(rid, req, plan, len(ids), stream, state.metrics.tracker(len(ids)),
                   [Choice() for _ in range(req.n)])


async def collect_chat(raw: Request, run: ChatRun) -> bool:
    """Gather a whole (non-streamed) chat's choices; False if the client left first (the
    request is then aborted)."""

    async def collect() -> bool:
        async for _, out in merged([run.stream]):
            run.observe(out)
            for c in out.outputs:
                run.choices[c.index].add(c)
        return True

    def done() -> None:
        run.stream.close()
        run.tracker.finish([c.finish_reason for c in run.choices])

    if not await collect_whole(raw, run.rid, collect(), done):
        return False
    log_finished(run.rid, run.choices, run.tracker.arrival)
    return True


async def create_chat_completion(state: ServerState, raw: Request) -> Response:
    parsed, deadline = await state.parse("chat", raw)
    assert parsed.messages is not None
    run = await start_chat(state, parsed.request, parsed.messages, deadline)
    req = run.req
    headers = {"X-Request-Id": run.rid}
    if req.stream:
        return StreamingResponse(_stream(state, run), media_type="text/event-stream",
                                 headers=headers)
    if not await collect_chat(raw, run):
        return Response(status_code=499)
    messages_out = [message(run.plan, c.text) for c in run.choices]
    body = ChatCompletionResponse(
        id=run.rid, model=state.model_name,
        choices=[ChatChoice(index=i, message=m,
                            logprobs=chat_logprobs(state, c.logprobs) if req.logprobs else None,
                            finish_reason=finish_reason(c.finish_reason, bool(m.tool_calls)),
                            stop_reason=c.stop_reason)
                 for i, (c, m) in enumerate(zip(run.choices, messages_out, strict=True))],
        usage=run.usage(), prompt_logprobs=prompt_logprobs_body(state, run.prompt_logprobs),
    )
    return JSONResponse(body.model_dump(), headers=headers)


async def stream_deltas(state: ServerState, run: ChatRun
                        ) -> AsyncIterator[list[tuple[int, DeltaMessage, str | None, Any]]]:
    """A streamed chat's deltas as they come: per output, (choice index, delta, finish
    reason, its CompletionOutput) for each choice that has something to say. Ends the request
    (aborting it if unfinished) when the iteration stops."""
    tools = [StreamedChoice(run.plan) for _ in run.choices] if run.plan is not None else None
    try:
        async for _, out in merged([run.stream]):
            run.observe(out)
            items = []
            for c in out.outputs:
                acc = run.choices[c.index]
                if acc.finish_reason is not None:
                    continue  # finished earlier; siblings are still running
                acc.add(c)
                delta, reason = DeltaMessage(content=c.text), c.finish_reason
                if tools is not None:
                    t = tools[c.index]
                    delta = t.delta(c.text, c.finish_reason is not None)
                    reason = finish_reason(reason, t.has_calls)
                if delta.content or delta.tool_calls or reason or c.logprobs:
                    items.append((c.index, delta, reason, c))
            if items:
                yield items
        log_finished(run.rid, run.choices, run.tracker.arrival)
    finally:
        run.stream.close()
        run.tracker.finish([c.finish_reason for c in run.choices])
        if not all(c.finish_reason for c in run.choices):
            log.info("%s: stream ended early (client gone or shutdown); aborted", run.rid)


async def _stream(state: ServerState, run: ChatRun) -> AsyncIterator[str]:
    req, created = run.req, int(time.time())
    include_usage, continuous = stream_usage(req.stream_options)

    def chunk(items: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return sse(ChatCompletionChunk(id=run.rid, created=created, model=state.model_name,
                                       choices=items, usage=usage))

    text_chunk = TextChunks(lambda i, text: ChatCompletionChunk(
        id=run.rid, created=created, model=state.model_name,
        choices=[ChatChunkChoice(index=i, delta=DeltaMessage(content=text))]))
    try:
        yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                     for i in range(req.n)])
        async for items in stream_deltas(state, run):
            if len(items) == 1 and not continuous:
                i, delta, reason, c = items[0]
                if (reason is None and c.stop_reason is None and delta.tool_calls is None
                        and delta.role is None and delta.content and not req.logprobs):
                    yield text_chunk(i, delta.content)  # the common chunk: new text only
                    continue
            yield chunk([ChatChunkChoice(
                index=i, delta=delta, finish_reason=reason, stop_reason=c.stop_reason,
                logprobs=chat_logprobs(state, c.logprobs) if req.logprobs and c.logprobs
                else None) for i, delta, reason, c in items],
                run.usage() if continuous else None)
        if include_usage:
            yield chunk([], run.usage())
        yield SSE_DONE
    except Exception as e:
        yield stream_error(e)
        yield SSE_DONE
