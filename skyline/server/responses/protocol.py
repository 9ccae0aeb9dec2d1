"""Responses API bodies: the request (text or input items in; instructions, sampling, function
tools, a text format), its translation to a chat request, and the response object."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from skyline.server.protocol import (
    I64_MAX,
    ChatCompletionRequest,
    RequestBody,
)


class InputText(RequestBody):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(RequestBody):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]  # text parts (others are refused by name)


class FunctionCallItem(RequestBody):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(RequestBody):
    type: Literal["function_call_output"]
    call_id: str
    output: str


InputItem = FunctionCallItem | FunctionCallOutputItem | InputMessage


class TextFormat(RequestBody):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(RequestBody):
    format: TextFormat | None = None


class ResponsesRequest(RequestBody):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=I64_MAX)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None  # function tools: {"type", "name", ...}
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "name"}
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    text: TextConfig | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None  # nothing is stored

    def to_chat(self) -> ChatCompletionRequest:
        """The chat request this asks for. Raises ValueError naming what has no chat
        equivalent here."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        items = [InputMessage(role="user", content=self.input)] if isinstance(
            self.input, str) else self.input
        for i, item in enumerate(items):
            if isinstance(item, InputMessage):
                messages.append({"role": item.role, "content": _text(item.content, i)})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if messages and messages[-1]["role"] == "assistant" and messages[-1].get(
                        "tool_calls"):
                    messages[-1]["tool_calls"].append(call)  # parallel calls: one turn
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                messages.append({"role": "tool", "content": item.output,
                                 "tool_call_id": item.call_id})
        tools = None
        if self.tools is not None:
            tools = [{"type": t.get("type"), "function": {
                k: v for k, v in t.items() if k in ("name", "description", "parameters", "strict")}}
                     for t in self.tools]
        choice = self.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function":
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        fmt = self.text.format if self.text is not None else None
        response_format = None
        if fmt is not None and fmt.type != "text":
            response_format = {"type": fmt.type}
            if fmt.type == "json_schema":
                response_format["json_schema"] = {"name": fmt.name or "response",
                                                  "schema": fmt.schema_}
        if not messages:
            raise ValueError("input is empty; give text or at least one input item")
        return ChatCompletionRequest.model_validate({
            "model": self.model, "messages": messages,
            "max_tokens": self.max_output_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "tools": tools, "tool_choice": choice,
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": response_format, "user": self.user})


def _text(content: str | list[dict[str, Any]], i: int) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for p in content:
        if p.get("type") not in ("input_text", "output_text", "text") or not isinstance(
                p.get("text"), str):
            raise ValueError(f"input[{i}] has a '{p.get('type')}' content part; this model "
                             "reads text parts only")
        parts.append(p["text"])
    return "".join(parts)


# ---------------------------------------------------------------------------------- responses


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class MessageItem(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallOutput(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "incomplete", "in_progress", "failed"] = "completed"
    model: str
    output: list[MessageItem | FunctionCallOutput] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: Any = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
