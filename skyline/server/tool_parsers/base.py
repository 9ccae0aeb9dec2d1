"""What a tool-call format is: how a model writes calls (markers, separators, the key of the
arguments), how tools and past calls are written into a prompt whose chat template knows
nothing of tools, and the grammar that forces one call (constrained decoding)."""

from __future__ import annotations

import json
import uuid
from typing import Any

# Compact JSON, as structured output writes it (engine/frontend/structured.py): a small model
# cannot wander off into whitespace.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def tool_functions(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The `function` objects of OpenAI tools."""
    return [t["function"] for t in tools]


def arguments_object(arguments: Any) -> Any:
    """A call's arguments as the object templates expect (OpenAI sends them as JSON text)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


class ToolFormat:
    """One model family's tool-call format. Subclasses set the class attributes and write the
    prompt texts; the stream parser (stream.py) and the forced grammar use the attributes."""

    name = ""
    markers: tuple[str, ...] = ()  # texts that open the tool calls
    # Whether calls may follow other text (else only at the very start of the output), and
    # whether a bare "{" opens them there.
    anywhere = True
    bare_json = False
    separators: tuple[str, ...] = ()  # what may stand between two calls, besides whitespace
    arguments_keys: tuple[str, ...] = ("arguments",)
    # Whether its markers are special tokens, which the text keeps only when decoded with
    # skip_special_tokens off.
    special_markers = False

    def new_call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def call_json(self, call: dict[str, Any]) -> str:
        """A past call ({"name", "arguments"}) as the JSON the model writes."""
        obj = {"name": call["name"], self.arguments_keys[0]: arguments_object(call["arguments"])}
        return json.dumps(obj, ensure_ascii=False)

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        """Tells the model its tools and how to call them (for templates without tools)."""
        raise NotImplementedError

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        """An assistant turn's calls ({"name", "arguments"}) as the model writes them."""
        raise NotImplementedError

    def render_result(self, content: str) -> str:
        """A tool's result, as the user turn that hands it back to the model."""
        return content

    def wrap_call(self, call: str) -> str:
        """The Lark grammar of one call whose JSON is the rule `call`."""
        raise NotImplementedError

    def forced_grammar(self, tools: list[dict[str, Any]], name: str | None) -> str:
        """A Lark grammar for exactly one call: of the function `name`, or of any of the
        tools; the arguments follow the function's JSON schema."""
        funcs = [f for f in tool_functions(tools) if name is None or f["name"] == name]
        key = self.arguments_keys[0]
        options = [{"type": "object", "additionalProperties": False,
                    "required": ["name", key],
                    "properties": {"name": {"const": f["name"]},
                                   key: f.get("parameters") or {"type": "object"}}}
                   for f in funcs]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        schema = {**schema, "x-guidance": JSON_LAYOUT}
        return f"start: {self.wrap_call('call')}\ncall: %json {json.dumps(schema)}\n"


def lark_string(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text)
