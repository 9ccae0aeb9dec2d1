"""Hermes / Qwen: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, after any
text, one block per call (Hermes 2 Pro, Qwen 2.5 / 3, and ChatML models generally)."""

from __future__ import annotations

import json
from typing import Any

from skyline.server.tool_parsers.base import ToolFormat, lark_string

OPEN, CLOSE = "<tool_call>\n", "\n</tool_call>"


class HermesFormat(ToolFormat):
    name = "hermes"
    markers = ("<tool_call>",)
    separators = ("<tool_call>", "</tool_call>")

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        # Qwen 2.5's own wording (its chat template), which Hermes-style models are trained on
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n"
                f"<tools>\n{listed}\n</tools>\n\n"
                "For each function call, return a json object with function name and arguments "
                "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(f"{OPEN}{self.call_json(c)}{CLOSE}" for c in calls)

    def render_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"

    def wrap_call(self, call: str) -> str:
        return f"{lark_string(OPEN)} {call} {lark_string(CLOSE)}"


HERMES = HermesFormat()
