"""The embedded default model (SmolLM2-135M-Instruct Q4_1 GGUF) through the offline API."""

from __future__ import annotations

import pytest

from skyline import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=1024)


def test_answers_a_real_question(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=30))[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # stopped at <|im_end|>, not by length
    assert "<|im_end|>" not in out.text


def test_stop_string_not_leaked_and_streaming_matches(llm):
    msgs = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    prompt = llm.render_chat(msgs)
    full = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40))[0]
    text = full.outputs[0].text
    assert "5" in text
    stop = text[text.index("5"):text.index("5") + 2]  # e.g. "5,"
    cut = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, stop=[stop]))[0]
    assert cut.outputs[0].text == text[: text.index(stop)]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == stop
    deltas = [o.outputs[0].text for o in llm.stream(prompt, SamplingParams(temperature=0.0,
                                                                             max_tokens=40))]
    assert "".join(deltas) == text and len(deltas) > 5
    assert not llm.engine.has_unfinished()


def test_json_schema_offline(llm):
    import json

    from skyline.types import SamplingParams as SP

    short = {"type": "string", "maxLength": 24}
    schema = {"type": "object", "properties": {"city": short, "country": short},
              "required": ["city", "country"], "additionalProperties": False}
    prompt = llm.render_chat([{"role": "user", "content": "Give the capital of France and its "
                               "country as JSON."}])
    out = llm.generate([prompt], SP(temperature=0.0, max_tokens=60, json_schema=schema))[0]
    data = json.loads(out.outputs[0].text)  # constrained: always valid, whatever the model
    assert set(data) == {"city", "country"} and all(isinstance(v, str) for v in data.values())
