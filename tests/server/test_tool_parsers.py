"""Tool-call parsers on outputs written as each format's documentation shows them (Hermes 2 Pro /
Qwen 2.5, Llama 3.1 JSON tool calling, Mistral v0.3): whole and streamed in random pieces
(the same calls, ids and names first, arguments in pieces), malformed output as content, the
format guessed from chat templates, tools written into prompts, and the forced-call grammar."""

from __future__ import annotations

import json
import random

import pytest

from skyline.server.tool_parsers import PARSERS, guess_parser
from skyline.server.tool_parsers.prompt import template_takes_tools, tool_messages
from skyline.server.tool_parsers.stream import ToolCallStream, parse_tool_calls

NAMES = {"get_current_temperature", "get_temperature_date", "get_current_conditions",
         "get_current_weather"}
TEMP = '{"location": "San Francisco, CA, USA"}'
DATE = '{"location": "San Francisco, CA, USA", "date": "2024-10-01"}'
# format, model output, expected content, expected calls (name, arguments)
RECORDED = [
    ("hermes", f'<tool_call>\n{{"name": "get_current_temperature", "arguments": {TEMP}}}\n'
               f'</tool_call>\n<tool_call>\n{{"name": "get_temperature_date", "arguments": '
               f"{DATE}}}\n</tool_call>", None,
     [("get_current_temperature", TEMP), ("get_temperature_date", DATE)]),
    ("hermes", f"Let me check the weather.\n<tool_call>\n{{\"name\": "
               f'"get_current_temperature", "arguments": {TEMP}}}\n</tool_call>',
     "Let me check the weather.\n", [("get_current_temperature", TEMP)]),
    ("llama3_json", '{"name": "get_current_conditions", "parameters": {"location": "San '
                    'Francisco, CA", "unit": "Fahrenheit"}}', None,
     [("get_current_conditions", '{"location": "San Francisco, CA", "unit": "Fahrenheit"}')]),
    ("llama3_json", f'<|python_tag|>{{"name": "get_current_temperature", "parameters": {TEMP}}}'
                    f'; {{"name": "get_temperature_date", "parameters": {DATE}}}', None,
     [("get_current_temperature", TEMP), ("get_temperature_date", DATE)]),
    ("mistral", '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": '
                '"Paris, France", "format": "celsius"}}]', None,
     [("get_current_weather", '{"location": "Paris, France", "format": "celsius"}')]),
    ("mistral", f'Sure.[TOOL_CALLS] [{{"name": "get_current_temperature", "arguments": {TEMP}}},'
                f' {{"name": "get_temperature_date", "arguments": {DATE}}}]', "Sure.",
     [("get_current_temperature", TEMP), ("get_temperature_date", DATE)]),
    # arguments given as JSON text (some fine-tunes write them so)
    ("hermes", '<tool_call>\n{"name": "get_current_weather", "arguments": "{\\"location\\": '
               '\\"Oslo\\"}"}\n</tool_call>', None,
     [("get_current_weather", '{"location": "Oslo"}')]),
]
MALFORMED = [
    ("hermes", '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": }\n'
               "</tool_call>"),  # invalid JSON after the name
    ("hermes", '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>'),
    ("hermes", "<tool_call>I would call a tool here</tool_call>"),
    ("hermes", '<tool_call>\n{"arguments": {"location": "Oslo"}}\n</tool_call>'),  # no name
    ("hermes", '<tool_call>\n{"name": "get_current_weather", "arguments": [1, 2]}\n</tool_call>'),
    ("llama3_json", 'The call would be {"name": "get_current_weather", "parameters": {}}'),
    ("llama3_json", '{"name": "get_current_weather", "parameters": {"location": "Oslo"'),
    ("mistral", '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "P'),
    ("mistral", "[TOOL_CALLS] not a list"),
]


def _stream(fmt: str, text: str, seed: int, names=NAMES, parallel: bool = True):
    """Feed `text` in random pieces; returns (content, [(id, name, arguments)], broken)."""
    rng = random.Random(seed)
    s = ToolCallStream(PARSERS[fmt], names, parallel)
    content, calls = "", []
    i = 0
    deltas = []
    while i < len(text):
        j = i + rng.randint(1, 6)
        deltas.append(s.feed(text[i:j]))
        i = j
    deltas.append(s.finish())
    for d in deltas:
        content += d.content
        for p in d.calls:
            if p.id is not None:
                assert p.index == len(calls) and p.name and p.arguments == ""
                calls.append([p.id, p.name, ""])
            else:
                assert p.index == len(calls) - 1, "arguments of an earlier call"
                calls[p.index][2] += p.arguments
    return content, calls, s.broken


@pytest.mark.parametrize("fmt,text,content,calls", RECORDED)
def test_recorded_outputs(fmt, text, content, calls):
    got_content, got = parse_tool_calls(PARSERS[fmt], text, NAMES)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got] == calls
    assert all(json.loads(c.arguments) for c in got)
    assert len({c.id for c in got}) == len(got)
    for seed in range(12):
        s_content, s_calls, broken = _stream(fmt, text, seed)
        assert not broken
        assert [(n, a) for _, n, a in s_calls] == calls
        assert (s_content if s_content.strip() else None) == content


@pytest.mark.parametrize("fmt,text", MALFORMED)
def test_malformed_output_is_content(fmt, text):
    assert parse_tool_calls(PARSERS[fmt], text, NAMES) == (text, [])
    for seed in range(6):
        content, calls, broken = _stream(fmt, text, seed)
        # streamed: text unless a call's name was already sent (then marked broken)
        assert broken or (content == text and not calls)


def test_parallel_off_keeps_the_first_call():
    text = RECORDED[0][1]
    _, calls = parse_tool_calls(PARSERS["hermes"], text, NAMES, parallel=False)
    assert [c.name for c in calls] == ["get_current_temperature"]
    assert [n for _, n, _ in _stream("hermes", text, 0, parallel=False)[1]] == [calls[0].name]


def test_text_without_calls_streams_through():
    """Plain answers pass untouched; only a possible marker's first characters wait."""
    s = ToolCallStream(PARSERS["hermes"], NAMES)
    assert s.feed("The answer is 4 <").content == "The answer is 4 "
    assert s.feed("3").content == "<3"
    assert s.finish().content == ""
    s = ToolCallStream(PARSERS["llama3_json"], NAMES)
    assert s.feed("  ").content == ""  # could still open a call
    assert s.feed("Hi {").content == "  Hi {"


QWEN_LIKE = ("{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}"
             "{{ t | tojson }}{% endfor %}</tools>\n<tool_call>...</tool_call><|im_end|>{% endif %}"
             "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
             "{% endfor %}")
LLAMA_LIKE = ("{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>"
              "{% if m.tool_calls %}<|python_tag|>{% endif %}{{ m.content }}<|eot_id|>"
              "{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}")
MISTRAL_LIKE = ("{% for m in messages %}{% if m.tool_calls %}[TOOL_CALLS] {{ m.tool_calls | "
                "tojson }}{% else %}[INST] {{ m.content }} [/INST]{% endif %}{% endfor %}")
CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


@pytest.mark.parametrize("template,expected", [
    (QWEN_LIKE, "hermes"), (LLAMA_LIKE, "llama3_json"), (MISTRAL_LIKE, "mistral"),
    (CHATML, "hermes"), ("{{ messages[0].content }}", None), (QWEN_LIKE + MISTRAL_LIKE, None),
    (None, None),
])
def test_guess_parser(template, expected):
    assert guess_parser(template) == expected


TOOLS = [{"type": "function", "function": {"name": "get_current_weather",
                                           "parameters": {"type": "object", "properties": {
                                               "location": {"type": "string"}},
                                               "required": ["location"]}}}]
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo and Bergen?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "get_current_weather",
                                                     "arguments": {"location": "Oslo"}}},
        {"id": "b", "type": "function", "function": {"name": "get_current_weather",
                                                     "arguments": '{"location": "Bergen"}'}}]},
    {"role": "tool", "content": "4C", "tool_call_id": "a"},
    {"role": "tool", "content": "7C", "tool_call_id": "b"},
]


def test_tools_written_into_a_template_without_tools():
    assert template_takes_tools(QWEN_LIKE) and not template_takes_tools(CHATML)
    out = tool_messages(PARSERS["hermes"], HISTORY, TOOLS)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert json.dumps(TOOLS[0]) in out[0]["content"]
    # past calls as the model writes them: the parser reads them back
    _, calls = parse_tool_calls(PARSERS["hermes"], out[2]["content"], NAMES)
    assert [json.loads(c.arguments) for c in calls] == [{"location": "Oslo"},
                                                        {"location": "Bergen"}]
    assert out[3]["content"] == ("<tool_response>\n4C\n</tool_response>\n"
                                 "<tool_response>\n7C\n</tool_response>")
    for fmt in ("llama3_json", "mistral"):
        text = tool_messages(PARSERS[fmt], HISTORY, TOOLS)[2]["content"]
        assert len(parse_tool_calls(PARSERS[fmt], text, NAMES)[1]) == 2, text


@pytest.fixture(scope="module")
def ll_tokenizer():
    from skyline.engine.frontend.structured import make_ll_tokenizer
    from skyline.engine.frontend.tokenizer import Tokenizer
    from skyline.model.default import default_model_path

    tok = Tokenizer.load(default_model_path())
    return make_ll_tokenizer(tok, tok.vocab_size, tok.eos_token_ids)


@pytest.mark.parametrize("fmt", sorted(PARSERS))
def test_forced_grammar_accepts_one_valid_call(fmt, ll_tokenizer):
    import llguidance

    f = PARSERS[fmt]
    tools = TOOLS + [{"type": "function", "function": {"name": "get_temperature_date"}}]
    grammar = llguidance.LLMatcher.grammar_from_lark(f.forced_grammar(tools, None))
    assert not llguidance.LLMatcher.validate_grammar_with_warnings(grammar)[0]

    def accepts(text: str) -> bool:
        m = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
        tokens = ll_tokenizer.tokenize_str(text)
        return m.try_consume_tokens(tokens) == len(tokens) and m.is_accepting()

    good = f.render_calls([{"name": "get_current_weather", "arguments": {"location": "Oslo"}}])
    good = good.replace("[TOOL_CALLS] [", "[TOOL_CALLS][")  # the grammar's compact layout
    assert accepts(good), good
    assert parse_tool_calls(f, good, NAMES)[1][0].name == "get_current_weather"
    assert not accepts(good.replace('"Oslo"', "7"))  # the schema's type
    assert not accepts(good.replace("get_current_weather", "get_weather"))
