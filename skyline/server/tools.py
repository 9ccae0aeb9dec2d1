"""Tool calling in chat completions: the format the served model writes calls in, what a
request's tools and tool_choice ask of it, and each choice's text as content and tool_calls
(whole, or streamed as OpenAI streams them: id and name first, then arguments in pieces)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from skyline.server.errors import APIError
from skyline.server.protocol import (
    AssistantMessage,
    ChatCompletionRequest,
    DeltaMessage,
    FunctionCall,
    ToolCall,
)
from skyline.server.tool_parsers import PARSERS, guess_parser
from skyline.server.tool_parsers.base import ToolFormat
from skyline.server.tool_parsers.hermes import HERMES
from skyline.server.tool_parsers.prompt import template_takes_tools, tool_messages
from skyline.server.tool_parsers.stream import Delta, ToolCallStream, parse_tool_calls


def resolve_tool_format(name: str, chat_template: str | None) -> ToolFormat | None:
    """--tool-call-parser: a format of PARSERS, none, or auto (the chat template's, where
    unambiguous)."""
    if name == "none":
        return None
    if name == "auto":
        guessed = guess_parser(chat_template)
        return PARSERS[guessed] if guessed is not None else None
    return PARSERS[name]


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask: calls parsed from the output in `fmt`; with `forced`
    (tool_choice "required" or a named function), exactly one call, by constrained decoding."""

    fmt: ToolFormat
    tools: list[dict[str, Any]]
    names: frozenset[str]
    forced: bool
    function: str | None  # the function tool_choice names
    parallel: bool

    def grammar(self) -> str:
        return self.fmt.forced_grammar(self.tools, self.function)


def plan_tools(fmt: ToolFormat | None, req: ChatCompletionRequest) -> ToolPlan | None:
    """None when the request uses no tools (none given, or tool_choice "none"): the model then
    neither sees them nor has its output parsed. tool_choice was checked with the tools."""
    choice = req.tool_choice
    if not req.tools or choice == "none":
        return None
    if fmt is None:
        raise APIError(400, "this server does not know the tool-call format of its model; "
                            "start it with --tool-call-parser (one of "
                            f"{', '.join(PARSERS)})", param="tools")
    function = choice["function"]["name"] if isinstance(choice, dict) else None
    return ToolPlan(fmt, req.tools, frozenset(t["function"]["name"] for t in req.tools),
                    choice not in (None, "auto"), function, req.parallel_tool_calls)


def template_input(fmt: ToolFormat | None, chat_template: str, messages: list[dict[str, Any]],
                   tools: list[dict[str, Any]] | None
                   ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools the chat template renders: as they are for a template that
    takes tools, else written into the messages in the tool format's words (hermes when the
    server knows none)."""
    if template_takes_tools(chat_template):
        return messages, tools
    if not tools and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return messages, None
    return tool_messages(fmt or HERMES, messages, tools), None


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and reason == "stop" else reason


def message(plan: ToolPlan | None, text: str) -> AssistantMessage:
    """A whole choice's message: its calls, if its text holds valid ones (else all text)."""
    if plan is None:
        return AssistantMessage(content=text)
    content, calls = parse_tool_calls(plan.fmt, text, plan.names, plan.parallel)
    if not calls:
        return AssistantMessage(content=content)
    return AssistantMessage(content=content, tool_calls=[
        ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in calls])


class StreamedChoice:
    """One streamed choice's text as content and tool-call pieces."""

    def __init__(self, plan: ToolPlan) -> None:
        self.stream = ToolCallStream(plan.fmt, plan.names, plan.parallel)

    @property
    def has_calls(self) -> bool:
        return bool(self.stream.calls)

    def delta(self, text: str, final: bool) -> DeltaMessage:
        d = self.stream.feed(text)
        if final:
            end = self.stream.finish()
            d = Delta(d.content + end.content, d.calls + end.calls)
        pieces = []
        for p in d.calls:
            fn: dict[str, Any] = {"arguments": p.arguments}
            piece: dict[str, Any] = {"index": p.index, "function": fn}
            if p.id is not None:
                piece.update(id=p.id, type="function")
                fn["name"] = p.name
            pieces.append(piece)
        return DeltaMessage(content=d.content or None, tool_calls=pieces or None)
