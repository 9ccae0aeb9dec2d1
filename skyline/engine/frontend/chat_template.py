"""Chat templates: jinja2 in an immutable sandbox, set up as Hugging Face transformers does
(trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` that
keeps non-ASCII, and a no-op `{% generation %}` block), so prompts render identically."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template rejected the conversation (e.g. roles that do not alternate)."""


class _GenerationBlock(jinja2.ext.Extension):
    # transformers marks assistant text with {% generation %}...{% endgeneration %} for
    # training masks; rendering just emits the body.
    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(
            f"the chat template is not valid jinja ({e.message}, line {e.lineno}); fix the template"
        ) from None


def render_chat_template(
    source: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    special_tokens: dict[str, str] | None = None,
    **kwargs: Any,
) -> str:
    """Render `messages` with template `source`; special_tokens (bos_token, eos_token, ...) are
    visible to the template as transformers passes them, and kwargs override them."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ChatTemplateError("messages must be a list of {'role': ..., 'content': ...} dicts")
    template = compile_template(source)
    variables = {**(special_tokens or {}), **kwargs}
    try:
        return template.render(messages=messages, tools=tools,
                               add_generation_prompt=add_generation_prompt, **variables)
    except (jinja2.exceptions.TemplateError, TypeError) as e:  # TypeError: e.g. list content
        raise ChatTemplateError(f"the chat template rejected the messages: {e}") from None
