"""A conversation with tools, for a chat template that knows nothing of tools: the tools in
the system prompt, past calls as the model writes them, results as user turns (as Qwen 2.5's
own template writes them), all in the format's words."""

from __future__ import annotations

import re
from typing import Any

from skyline.server.tool_parsers.base import ToolFormat

_TOOLS = re.compile(r"\btools\b")


def template_takes_tools(chat_template: str) -> bool:
    """Whether a chat template reads the `tools` variable (as Hugging Face templates with tool
    support do): then it renders tools, calls and results itself."""
    return _TOOLS.search(chat_template) is not None


def tool_messages(fmt: ToolFormat, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """`messages` with the tools in the system prompt and tool calls and results as text."""
    out: list[dict[str, Any]] = []
    rest = messages
    if tools:
        block = fmt.system_prompt(tools)
        if messages and messages[0]["role"] == "system":
            out.append({**messages[0], "content": f"{messages[0]['content']}\n\n{block}"})
            rest = messages[1:]
        else:
            out.append({"role": "system", "content": block})
    results_open = False  # the last message is a user turn of tool results
    for m in rest:
        if m["role"] == "tool":
            result = fmt.render_result(m["content"])
            if results_open:
                out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{result}"}
            else:
                out.append({"role": "user", "content": result})
            results_open = True
            continue
        results_open = False
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = fmt.render_calls([c["function"] for c in m["tool_calls"]])
            text = f"{m['content']}\n{calls}" if m.get("content") else calls
            out.append({"role": "assistant", "content": text})
        else:
            out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
    return out
