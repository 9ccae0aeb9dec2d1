"""POST /v1/responses: the request runs as its chat request; the output is answered as
response output items (a message, function calls), whole or as the typed events the Responses
API streams (response.created ... response.output_text.delta ... response.completed)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from skyline.server.chat import ChatRun, collect_chat, start_chat, stream_deltas
from skyline.server.errors import error_body
from skyline.server.responses.protocol import (
    FunctionCallOutput,
    IncompleteDetails,
    InputTokensDetails,
    MessageItem,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from skyline.server.serving import ServerState, stream_error_status
from skyline.server.tools import message


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _response(state: ServerState, src: ResponsesRequest, run: ChatRun,
              output: list[MessageItem | FunctionCallOutput], done: bool) -> ResponseObject:
    """The response object: in progress, or done (with its status and usage)."""
    resp = ResponseObject(
        id=run.rid, model=state.model_name, output=output, status="in_progress",
        instructions=src.instructions, max_output_tokens=src.max_output_tokens,
        temperature=src.temperature, top_p=src.top_p, tools=src.tools or [],
        tool_choice=src.tool_choice or "auto", parallel_tool_calls=src.parallel_tool_calls,
        text=src.text.model_dump(by_alias=True, exclude_none=True) if src.text else
        {"format": {"type": "text"}}, metadata=src.metadata or {}, user=src.user)
    if done:
        u = run.usage()
        resp.usage = ResponseUsage(input_tokens=u.prompt_tokens,
                                   output_tokens=u.completion_tokens,
                                   total_tokens=u.total_tokens,
                                   input_tokens_details=InputTokensDetails(
                                       cached_tokens=run.num_cached))
        if run.choices[0].finish_reason == "length":
            resp.status = "incomplete"
            resp.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        else:
            resp.status = "completed"
    return resp


async def create_response(state: ServerState, raw: Request) -> Response:
    parsed, deadline = await state.parse("responses", raw)
    src: ResponsesRequest = parsed.source
    run = await start_chat(state, parsed.request, parsed.messages, deadline, prefix="resp")
    headers = {"X-Request-Id": run.rid}
    if src.stream:
        return StreamingResponse(_events(state, src, run), media_type="text/event-stream",
                                 headers=headers)
    if not await collect_chat(raw, run):
        return Response(status_code=499)
    msg = message(run.plan, run.choices[0].text)
    output: list[MessageItem | FunctionCallOutput] = []
    if msg.content:
        output.append(MessageItem(id=_item_id("msg"), content=[OutputText(text=msg.content)]))
    for c in msg.tool_calls or []:
        output.append(FunctionCallOutput(id=_item_id("fc"), call_id=c.id or _item_id("call"),
                                         name=c.function.name, arguments=c.function.arguments))
    return JSONResponse(_response(state, src, run, output, True).model_dump(),
                        headers=headers)


class _Events:
    """The stream's events, numbered, and the output items they build."""

    def __init__(self) -> None:
        self.seq = 0
        self.output: list[MessageItem | FunctionCallOutput] = []
        self.text: MessageItem | None = None  # the message item being written
        self.call: FunctionCallOutput | None = None  # the call being written

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq,
                **{k: v.model_dump() if isinstance(v, BaseModel) else v
                   for k, v in fields.items()}}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def where(self, item: MessageItem | FunctionCallOutput) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": self.output.index(item)}

    def add_text(self, text: str) -> list[str]:
        out = self.end_call()
        if self.text is None:
            self.text = MessageItem(id=_item_id("msg"), status="in_progress",
                                    content=[OutputText(text="")])
            self.output.append(self.text)
            out += [self.event("response.output_item.added", item=self.text,
                               output_index=len(self.output) - 1),
                    self.event("response.content_part.added", **self.where(self.text),
                               content_index=0, part=OutputText(text=""))]
        self.text.content[0].text += text
        out.append(self.event("response.output_text.delta", **self.where(self.text),
                              content_index=0, delta=text, logprobs=[]))
        return out

    def end_text(self) -> list[str]:
        item, self.text = self.text, None
        if item is None:
            return []
        item.status = "completed"
        part = item.content[0]
        return [self.event("response.output_text.done", **self.where(item), content_index=0,
                           text=part.text, logprobs=[]),
                self.event("response.content_part.done", **self.where(item), content_index=0,
                           part=part),
                self.event("response.output_item.done", item=item,
                           output_index=self.output.index(item))]

    def add_call_piece(self, piece: dict[str, Any]) -> list[str]:
        out: list[str] = []
        if "id" in piece:  # a new call
            out += self.end_text() + self.end_call()
            self.call = FunctionCallOutput(id=_item_id("fc"), call_id=piece["id"],
                                           name=piece["function"]["name"], arguments="",
                                           status="in_progress")
            self.output.append(self.call)
            out.append(self.event("response.output_item.added", item=self.call,
                                  output_index=len(self.output) - 1))
        args = piece["function"].get("arguments", "")
        if args and self.call is not None:
            self.call.arguments += args
            out.append(self.event("response.function_call_arguments.delta",
                                  **self.where(self.call), delta=args))
        return out

    def end_call(self) -> list[str]:
        item, self.call = self.call, None
        if item is None:
            return []
        item.status = "completed"
        return [self.event("response.function_call_arguments.done", **self.where(item),
                           name=item.name, arguments=item.arguments),
                self.event("response.output_item.done", item=item,
                           output_index=self.output.index(item))]


async def _events(state: ServerState, src: ResponsesRequest, run: ChatRun
                  ) -> AsyncIterator[str]:
    ev = _Events()
    try:
        yield ev.event("response.created", response=_response(state, src, run, [], False))
        yield ev.event("response.in_progress", response=_response(state, src, run, [], False))
        async for items in stream_deltas(state, run):
            for _, delta, _, _ in items:
                for line in ev.add_text(delta.content) if delta.content else []:
                    yield line
                for piece in delta.tool_calls or []:
                    for line in ev.add_call_piece(piece):
                        yield line
        for line in ev.end_text() + ev.end_call():
            yield line
        final = _response(state, src, run, ev.output, True)
        kind = "response.completed" if final.status == "completed" else "response.incomplete"
        yield ev.event(kind, response=final)
    except Exception as e:
        status, message = stream_error_status(e)
        yield ev.event("error", code=str(error_body(status, message)["error"]["type"]),
                       message=message, param=None)
