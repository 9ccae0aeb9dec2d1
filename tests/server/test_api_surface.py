"""What real clients send, through the official openai client against one real `skyline serve`
(default model, CPU): tool calls (forced, chosen by the model, malformed, streamed, a round trip
with the tool's result), structured outputs under each field name vLLM accepts, logit_bias,
echo with logprobs and prompt_logprobs (checked against the model's own sampled logprobs), and
the Responses API, streamed and not."""

from __future__ import annotations

import json
import re

import openai
import pytest

pytestmark = pytest.mark.slow

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY,
                                           "description": "The weather in a city now"}},
         {"type": "function", "function": {"name": "get_time", "parameters": CITY}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory("--max-model-len", "512")


def _chat(client, model, **kw):
    return client.chat.completions.create(model=model, **{"messages": ASK, "temperature": 0,
                                                          "max_tokens": 40, **kw})


def _streamed(stream) -> tuple[str, dict[int, list], str | None]:
    """Content, calls {index: [id, name, arguments, pieces]} and the finish reason of a
    streamed chat, checking that each call's first piece has its id and name."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.function.name and tc.type == "function"
                calls[tc.index] = [tc.id, tc.function.name, "", 0]
            else:
                assert tc.id is None and tc.function.name is None
            calls[tc.index][2] += tc.function.arguments or ""
            calls[tc.index][3] += 1
        finish = choice.finish_reason or finish
    return content, calls, finish


# ------------------------------------------------------------------ tools


def test_tool_round_trip(client, model):
    r = _chat(client, model, tools=TOOLS, tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ("get_weather", "get_time")
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    history = [*ASK, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'}]
    answer = _chat(client, model, messages=history, tools=TOOLS, max_tokens=16)
    reply = answer.choices[0]
    assert reply.message.content or reply.message.tool_calls
    assert reply.finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage.prompt_tokens > r.usage.prompt_tokens  # the call and result are in it


def test_named_tool_streams_like_openai(client, model):
    choice = {"type": "function", "function": {"name": "get_time"}}
    whole = _chat(client, model, tools=TOOLS, tool_choice=choice).choices[0]
    content, calls, finish = _streamed(_chat(client, model, tools=TOOLS, tool_choice=choice,
                                             stream=True))
    assert finish == "tool_calls" and not content.strip()
    (call,) = calls.values()
    assert call[1] == "get_time" and call[3] > 2  # arguments came in pieces
    assert call[2] == whole.message.tool_calls[0].function.arguments
    assert json.loads(call[2])["city"]


HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_a_call_the_model_writes_is_parsed(client, model):
    """tool_choice auto: the model's own text (here pinned by a regex) holds a call."""
    pin = {"guided_regex": re.escape(HERMES_CALL)}
    r = _chat(client, model, tools=TOOLS, extra_body=pin).choices[0]
    assert r.finish_reason == "tool_calls"
    assert json.loads(r.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    content, calls, finish = _streamed(_chat(client, model, tools=TOOLS, extra_body=pin,
                                             stream=True))
    assert finish == "tool_calls" and [c[1:3] for c in calls.values()] == [
        ["get_weather", '{"city": "Paris"}']]
    # without tools (or with tool_choice none) the same text is content
    r = _chat(client, model, tools=TOOLS, tool_choice="none", extra_body=pin).choices[0]
    assert r.message.content == HERMES_CALL and r.message.tool_calls is None


@pytest.mark.parametrize("text,stream", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>', False),
    ('<tool_call>\n{"name": "get_weather", "arguments": "not json"}\n</tool_call>', False),
    ("<tool_call>the weather tool, please</tool_call>", False),
    ("<tool_call>the weather tool, please</tool_call>", True),
    ('<tool_call>\n{"name": "delete_files", "arguments": {}}\n</tool_call>', True),
])
def test_malformed_calls_come_back_as_content(client, model, text, stream):
    pin = {"guided_regex": re.escape(text)}
    if stream:
        content, calls, finish = _streamed(_chat(client, model, tools=TOOLS, extra_body=pin,
                                                 stream=True))
        assert (content, calls, finish) == (text, {}, "stop")
    else:
        r = _chat(client, model, tools=TOOLS, extra_body=pin).choices[0]
        assert (r.message.content, r.message.tool_calls, r.finish_reason) == (text, None, "stop")


def test_tool_request_errors(server, model):
    chat = {"model": model, "messages": ASK, "max_tokens": 2, "tools": TOOLS}
    for body, param in [
            ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
            ({"tool_choice": "sometimes"}, "tool_choice"),
            ({"tools": [], "tool_choice": "required"}, "tool_choice"),
            ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
            ({"tools": [{"type": "retrieval"}]}, "tools"),
            ({"tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
            ({"tool_choice": "required", "tools": [{"type": "function", "function": {
                "name": "f", "parameters": {"type": "object", "properties": {
                    "x": {"type": "no-such-type"}}}}}]}, "tools")]:
        status, _, raw = server.request("POST", "/v1/chat/completions", {**chat, **body})
        assert status == 400, raw
        assert json.loads(raw)["error"]["param"] == param, raw


# ------------------------------------------------------------------ structured outputs

OBJ = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
       "required": ["n"], "additionalProperties": False}


def _json_n(text: str) -> bool:
    n = json.loads(text)["n"]
    return isinstance(n, int) and 0 <= n <= 999  # the schema's bounds hold the digits in


@pytest.mark.parametrize("body,check", [
    ({"structured_outputs": {"json": OBJ}}, _json_n),
    ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}},
     lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
    ({"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
     lambda t: t in ("yes", "no", "maybe")),
    ({"structured_outputs": {"grammar": 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[1-9]/'}},
     lambda t: re.fullmatch(r"\([1-9](\+[1-9])*\)", t)),
    ({"structured_outputs": {"json_object": True}}, lambda t: isinstance(json.loads(t), dict)),
    ({"guided_json": OBJ}, _json_n),
    ({"guided_regex": "(red|green|blue)!"}, lambda t: t in ("red!", "green!", "blue!")),
    ({"guided_choice": ["Paris", "Rome"]}, lambda t: t in ("Paris", "Rome")),
    ({"guided_grammar": 'start: "x=" ("1" | "2") ";"'}, lambda t: t in ("x=1;", "x=2;")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": OBJ}}},
     _json_n),
])
def test_structured_outputs_by_every_name(client, model, body, check):
    r = _chat(client, model, max_tokens=30, extra_body=body).choices[0]
    assert r.finish_reason == "stop" and check(r.message.content), r.message.content
    if "json_object" not in str(body):  # any object: the model's keys may run past max_tokens
        c = client.completions.create(model=model, prompt="Answer:", max_tokens=30,
                                      temperature=0, extra_body=body).choices[0]
        assert c.finish_reason == "stop" and check(c.text), c.text


@pytest.mark.parametrize("body,param,words", [
    ({"guided_regex": "(a"}, "guided_regex", "regex"),
    ({"structured_outputs": {"regex": "[z-a]"}}, "structured_outputs", "regex"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", "grammar"),
    ({"structured_outputs": {"grammar": 'start: "a'}}, "structured_outputs", "grammar"),
    ({"guided_json": {"type": "objekt"}}, "guided_json", "json_schema"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice", "one constraint"),
    ({"structured_outputs": {"structural_tag": {"x": 1}}}, "structured_outputs", "not supported"),
])
def test_invalid_constraints_are_400s(server, model, body, param, words):
    for path, base in (("/v1/chat/completions", {"messages": ASK}),
                       ("/v1/completions", {"prompt": "x"})):
        status, _, raw = server.request("POST", path, {"model": model, "max_tokens": 2,
                                                       **base, **body})
        err = json.loads(raw)["error"]
        assert status == 400 and err["param"] == param and words in err["message"], raw


# ------------------------------------------------------------------ logit_bias, logprobs


def _ids(server, text: str) -> list[int]:
    status, _, raw = server.request("POST", "/tokenize", {"prompt": text,
                                                          "add_special_tokens": False})
    assert status == 200
    return json.loads(raw)["tokens"]


def test_logit_bias(server, client, model):
    (banana,) = _ids(server, " banana")
    prompt = "The capital of France is"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=1.0,
                                  seed=3, logit_bias={str(banana): 100}, logprobs=0)
    assert r.choices[0].text == " banana" * 4
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0,
                                      logprobs=0)
    (first,) = _ids(server, plain.choices[0].logprobs.tokens[0])
    banned = client.completions.create(model=model, prompt=prompt, max_tokens=1,
                                       temperature=0, logit_bias={str(first): -100})
    assert _ids(server, banned.choices[0].text) != [first]
    for bias in ({"1": 100.5}, {"x": 1}, {str(10**9): 1}, {"-3": 1}):
        status, _, raw = server.request("POST", "/v1/completions", {
            "model": model, "prompt": prompt, "max_tokens": 1, "logit_bias": bias})
        assert status == 400 and json.loads(raw)["error"]["param"].startswith("logit_bias"), raw


def test_echo_and_prompt_logprobs_score_text(server, client, model):
    """A prompt token's logprob (echo / prompt_logprobs) equals the logprob the model gave it
    when it sampled it: score the greedy continuation of a prompt as part of a longer one."""
    prompt = _ids(server, "The capital of France is")
    gen = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0,
                                    logprobs=2).choices[0].logprobs
    tokens = prompt + _ids(server, "".join(gen.tokens))
    assert len(tokens) == len(prompt) + 2
    scored = client.completions.create(model=model, prompt=tokens, max_tokens=1,
                                       temperature=0, echo=True, logprobs=2,
                                       extra_body={"prompt_logprobs": 2}).choices[0]
    lp = scored.logprobs
    assert scored.text.startswith("The capital of France is" + "".join(gen.tokens))
    assert len(lp.tokens) == len(tokens) + 1 and lp.token_logprobs[0] is None
    # the default model serves in bfloat16 with other kernels for one row than for a prompt's
    # rows (the CPU decode step's attention, the LM head's 8-bit copy against its bfloat16
    # logits, rounded by up to 1/32 near 16): a few 1e-2 apart; a wrong position is further
    assert lp.token_logprobs[len(prompt):len(tokens)] == pytest.approx(gen.token_logprobs,
                                                                        abs=5e-2)
    assert lp.top_logprobs[len(prompt)] == pytest.approx(gen.top_logprobs[0], abs=5e-2)
    vllm = scored.model_extra["prompt_logprobs"]
    assert len(vllm) == len(tokens) and vllm[0] is None
    for j in range(1, len(tokens)):
        entry = vllm[j][str(tokens[j])]
        assert entry["logprob"] == pytest.approx(lp.token_logprobs[j], abs=1e-6)
        assert entry["rank"] >= 1 and len(vllm[j]) <= 3
    # streamed: the first chunk carries the prompt's text and logprobs
    chunks = list(client.completions.create(model=model, prompt=tokens, max_tokens=2,
                                            temperature=0, echo=True, logprobs=1,
                                            stream=True))
    first = chunks[0].choices[0]
    assert first.text.startswith("The capital of France is")
    assert first.logprobs.token_logprobs[:len(tokens)] == pytest.approx(
        lp.token_logprobs[:len(tokens)], abs=1e-3)
    # chat: vLLM's prompt_logprobs beside the choices
    chat = client.chat.completions.create(model=model, messages=ASK, max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens


# ------------------------------------------------------------------ responses


def test_responses(client, model):
    r = client.responses.create(model=model, input="What is the capital of France?",
                                instructions="Answer in one short sentence.",
                                max_output_tokens=12, temperature=0)
    assert r.object == "response" and r.id.startswith("resp")
    assert r.output_text and r.status in ("completed", "incomplete")
    assert r.usage.output_tokens <= 12 and r.usage.input_tokens > 5
    assert r.instructions == "Answer in one short sentence."
    events = list(client.responses.create(model=model, input=[
        {"role": "user", "content": [{"type": "input_text",
                                      "text": "What is the capital of France?"}]}],
        instructions="Answer in one short sentence.", max_output_tokens=12, temperature=0,
        stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text == events[-1].response.output_text


def test_responses_function_calls(client, model):
    tools = [{"type": "function", "name": "get_weather", "parameters": CITY}]
    r = client.responses.create(model=model, input="Weather in Rome?", tools=tools,
                                tool_choice="required", max_output_tokens=40, temperature=0)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments)["city"]
    follow = client.responses.create(model=model, tools=tools, max_output_tokens=16,
                                     temperature=0, input=[
        {"role": "user", "content": "Weather in Rome?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 25C"}])
    assert follow.output and follow.usage.input_tokens > r.usage.input_tokens
    events = list(client.responses.create(model=model, input="Weather in Rome?", tools=tools,
                                          tool_choice={"type": "function",
                                                       "name": "get_weather"},
                                          max_output_tokens=40, temperature=0, stream=True))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert len(deltas) > 2 and "".join(deltas) == done.arguments == call.arguments
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model=model, input="x", previous_response_id="resp_1")
