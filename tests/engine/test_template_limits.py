"""A chat template rendered with RenderLimits cannot run away: bounded output, bounded time,
no huge values from `*` or `**`, and whatever it raises is a ChatTemplateError (a 400)."""

from __future__ import annotations

import time

import pytest

from skyline.engine.frontend.chat_template import (
    ChatTemplateError,
    RenderLimits,
    TemplateBudgetError,
    render_chat_template,
)

MSGS = [{"role": "user", "content": "hi"}]


def _render(source: str, max_chars: int = 10_000, seconds: float = 1.0, **kw) -> str:
    limits = RenderLimits(max_chars=max_chars, deadline=time.monotonic() + seconds)
    return render_chat_template(source, kw.pop("messages", MSGS), add_generation_prompt=True,
                                limits=limits, **kw)


def test_a_normal_template_renders_as_without_limits():
    src = "{% for m in messages %}<{{ m['role'] }}>{{ m.content }}{% endfor %}"
    assert _render(src) == render_chat_template(src, MSGS, add_generation_prompt=True)


@pytest.mark.parametrize("source", [
    "{{ 'x' * 2**30 }}",
    "{{ 2 * ['x'] * 100000000 }}",
    "{{ 10 ** 100000 }}",
    "{% for i in range(100000) %}{{ 'abcdefgh' }}{% endfor %}",
])
def test_huge_output_or_values_are_refused(source):
    with pytest.raises(TemplateBudgetError):
        _render(source, max_chars=100_000)


@pytest.mark.parametrize("source", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% for a in messages %}{% for b in messages %}{% for c in messages %}"
    "{% if c.role == 'x' %}{% endif %}{% endfor %}{% endfor %}{% endfor %}",
])
def test_a_render_that_runs_long_is_stopped_at_its_deadline(source):
    many = [{"role": "user", "content": "x"}] * 2000
    t = time.monotonic()
    with pytest.raises(TemplateBudgetError, match="too long"):
        _render(source, seconds=0.3, messages=many)
    assert time.monotonic() - t < 2.0


@pytest.mark.parametrize("source", ["{{ 1/0 }}", "{{ nothing() }}", "{{ 'a' + 1 }}",
                                    "{{ raise_exception('no') }}"])
def test_template_failures_are_template_errors(source):
    with pytest.raises(ChatTemplateError):
        _render(source)
