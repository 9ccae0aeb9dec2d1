"""`train-speculator --synthesize` (tools/speculator/data.py): the default model writes user
messages after its chat template's user header; they come back as chats for the target to answer."""

from __future__ import annotations

import pytest

from skyline import LLM
from skyline.tools.speculator.data import SYNTH_MIN_TOKENS, synthesize, user_prefix


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=512, enable_prefix_caching=False)


def test_user_prefix_ends_where_a_user_message_begins(llm):
    prefix = llm.tokenizer.decode(user_prefix(llm), skip_special_tokens=False)
    assert prefix.endswith("<|im_start|>user\n")
    assert prefix.startswith("<|im_start|>system\n")  # the template's own system prompt
    rendered = llm.render_chat([{"role": "user", "content": "Hello there"}])
    assert rendered[: len(user_prefix(llm))] == user_prefix(llm)


def test_synthesized_messages_are_rendered_chats_new_and_reproducible(llm):
    first = synthesize(llm, 8, max_tokens=48, seed=3)
    assert 0 < len(first) <= 8
    prefix = user_prefix(llm)
    header = llm.tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n",
                                  add_special_tokens=False)
    texts = []
    for ex in first:
        assert ex.completion is None  # the target answers it when recording
        assert ex.prompt[: len(prefix)] == prefix and ex.prompt[-len(header):] == header
        body = ex.prompt[len(prefix) : -len(header)]
        assert len(body) >= SYNTH_MIN_TOKENS - 1  # the end-of-turn token is not kept
        texts.append(llm.tokenizer.decode(body))
    assert len(set(texts)) == len(texts)
    assert [ex.prompt for ex in synthesize(llm, 8, max_tokens=48, seed=3)] == \
        [ex.prompt for ex in first]
