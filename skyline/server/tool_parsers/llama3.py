"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: `{"name": ..., "parameters": {...}}` as the whole
answer (optionally after `<|python_tag|>`), several separated by `;`."""

from __future__ import annotations

import json
from typing import Any

from skyline.server.tool_parsers.base import ToolFormat


class Llama3JsonFormat(ToolFormat):
    name = "llama3_json"
    markers = ("<|python_tag|>",)
    anywhere = False
    bare_json = True
    separators = (";", "<|python_tag|>")
    arguments_keys = ("parameters", "arguments")

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        # Meta's wording for JSON-based tool calling (the Llama 3.1 chat template's)
        listed = "\n\n".join(json.dumps(t, indent=4, ensure_ascii=False) for t in tools)
        return ("Given the following functions, please respond with a JSON for a function call "
                "with its proper arguments that best answers the given prompt.\n\n"
                'Respond in the format {"name": function name, "parameters": dictionary of '
                "argument name and its value}. Do not use variables.\n\n" + listed)

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return "; ".join(self.call_json(c) for c in calls)

    def wrap_call(self, call: str) -> str:
        return call


LLAMA3_JSON = Llama3JsonFormat()
