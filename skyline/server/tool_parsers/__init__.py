"""Tool calls in each model family's own format: parsed from the model's output into OpenAI
`tool_calls` (stream.py, one parser for every format), written back into prompts whose chat
template knows no tools (prompt.py), and forced by a grammar (base.py).

`--tool-call-parser` names a format of PARSERS, or `auto`: the format the chat template writes,
where that is unambiguous (`guess_parser`).
"""

from __future__ import annotations

from skyline.server.tool_parsers.base import ToolFormat
from skyline.server.tool_parsers.hermes import HERMES
from skyline.server.tool_parsers.llama3 import LLAMA3_JSON
from skyline.server.tool_parsers.mistral import MISTRAL

PARSERS: dict[str, ToolFormat] = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}


def guess_parser(chat_template: str | None) -> str | None:
    """The format a chat template writes tool calls in: by the markers it spells, else
    hermes for a ChatML template (Hermes, Qwen, SmolLM: the format ChatML models are tuned
    on); None when nothing says."""
    t = chat_template or ""
    found = [name for name, markers in (("hermes", ("<tool_call>",)),
                                        ("mistral", ("[TOOL_CALLS]",)),
                                        ("llama3_json", ("<|python_tag|>", "<|eom_id|>")))
             if any(m in t for m in markers)]
    if len(found) == 1:
        return found[0]
    if not found and "<|im_start|>" in t:
        return "hermes"
    return None
