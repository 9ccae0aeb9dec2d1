"""Chat templates: jinja2 in an immutable sandbox, set up as Hugging Face transformers does
(trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` that
keeps non-ASCII, and a no-op `{% generation %}` block), so prompts render identically.

A server renders with `RenderLimits`: the output is bounded in characters and the render in
time (checked at every call, attribute or item access, operator and output chunk), and `*` and
`**` cannot build huge values, so that no conversation makes a template run away.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template rejected the conversation (e.g. roles that do not alternate)."""


class TemplateBudgetError(ChatTemplateError):
    """Rendering went over its RenderLimits."""


@dataclass(frozen=True)
class RenderLimits:
    max_chars: int  # of the rendered prompt, and of any string or list `*` builds
    deadline: float  # time.monotonic() by which rendering must end


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, with the RenderLimits of the render running in this thread enforced."""

    intercepted_binops = frozenset({"*", "**"})  # also keeps them from folding at compile time

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.budget = threading.local()  # .limits: the render in this thread, or None

    def check(self) -> RenderLimits | None:
        limits: RenderLimits | None = getattr(self.budget, "limits", None)
        if limits is not None and time.monotonic() > limits.deadline:
            raise TemplateBudgetError("rendering the chat template took too long for this "
                                      "conversation; send a shorter one")
        return limits

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        __self.check()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        self.check()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        self.check()
        return super().getitem(obj, argument)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        limits = self.check()
        if limits is not None and operator == "*":
            for seq, count in ((left, right), (right, left)):
                if (isinstance(seq, str | list | tuple) and isinstance(count, int)
                        and len(seq) * count > limits.max_chars):
                    raise TemplateBudgetError("the chat template built a value larger than the "
                                              "prompt limit")
        if (limits is not None and operator == "**" and isinstance(left, int)
                and isinstance(right, int) and abs(left) > 1
                and right * abs(left).bit_length() > 4096):
            raise TemplateBudgetError("the chat template computed a power too large")
        return super().call_binop(context, operator, left, right)


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
    env = _BoundedSandbox(
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
    limits: RenderLimits | None = None,
    **kwargs: Any,
) -> str:
    """Render `messages` with template `source`; special_tokens (bos_token, eos_token, ...) are
    visible to the template as transformers passes them, and kwargs override them. With
    `limits`, raise TemplateBudgetError once the output or the time runs over them."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ChatTemplateError("messages must be a list of {'role': ..., 'content': ...} dicts")
    template = compile_template(source)
    env = template.environment
    assert isinstance(env, _BoundedSandbox)
    variables = {**(special_tokens or {}), **kwargs}
    env.budget.limits = limits
    try:
        chunks = template.generate(messages=messages, tools=tools,
                                   add_generation_prompt=add_generation_prompt, **variables)
        if limits is None:
            return "".join(chunks)
        out, size = [], 0
        for chunk in chunks:
            size += len(chunk)
            if size > limits.max_chars:
                raise TemplateBudgetError(f"the chat template renders this conversation to more "
                                          f"than {limits.max_chars} characters; send a shorter "
                                          "one")
            env.check()
            out.append(chunk)
        return "".join(out)
    except ChatTemplateError:
        raise
    except Exception as e:  # whatever the template raised on these messages (e.g. {{ 1/0 }})
        why = str(e) if isinstance(e, jinja2.exceptions.TemplateError) else (
            f"{type(e).__name__}: {e}")
        raise ChatTemplateError(f"the chat template rejected the messages: {why}") from None
    finally:
        env.budget.limits = None
