"""Mistral (7B v0.3, Nemo, Small): `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`, after
any text. `[TOOL_CALLS]` is a special token there, so the text keeps special tokens while tools
are on. (The later `[TOOL_CALLS]name[ARGS]{...}` layout is not read.)"""

from __future__ import annotations

import json
import uuid
from typing import Any

from skyline.server.tool_parsers.base import ToolFormat, lark_string

MARKER = "[TOOL_CALLS]"


class MistralFormat(ToolFormat):
    name = "mistral"
    markers = (MARKER,)
    separators = ("[", "]", ",", MARKER)
    special_markers = True

    def new_call_id(self) -> str:
        return uuid.uuid4().hex[:9]  # Mistral's templates take ids of nine letters or digits

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listed = json.dumps(tools, ensure_ascii=False)
        return (f"[AVAILABLE_TOOLS] {listed}[/AVAILABLE_TOOLS]\n"
                f"To call tools, answer {MARKER} followed by a JSON list of "
                '{"name": <function-name>, "arguments": <args-json-object>} objects.')

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return f"{MARKER} [{', '.join(self.call_json(c) for c in calls)}]"

    def render_result(self, content: str) -> str:
        return f"[TOOL_RESULTS] {json.dumps({'content': content}, ensure_ascii=False)}" \
               "[/TOOL_RESULTS]"

    def wrap_call(self, call: str) -> str:
        return f"{lark_string(MARKER + '[')} {call} {lark_string(']')}"


MISTRAL = MistralFormat()
