"""`skyline quantize --calib-self` (tools/quantize/self_text.py): the default model writes its own
calibration text, answering the built-in prompts; reproducible, and no more than asked."""

from __future__ import annotations

import pytest

from skyline import LLM
from skyline.tools.quantize.self_text import self_text


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=512, enable_prefix_caching=False)


def test_self_text_answers_prompts_reproducibly(llm):
    text = self_text(llm, 30, max_tokens=10, batch=4)
    answers = text.split("\n\n")
    assert len(answers) >= 3  # 30 tokens at 10 per answer: three answers at least
    assert all(a.strip() for a in answers) and len(set(answers)) == len(answers)
    n = len(llm.tokenizer.encode(text, add_special_tokens=False))
    assert 20 <= n <= 80  # answers of at most 10 tokens, stopping once 30 are written
    assert self_text(llm, 30, max_tokens=10, batch=4) == text  # seeded samples
    assert len(self_text(llm, 5, max_tokens=20).split("\n\n")) == 1  # one short answer


def test_cli_calib_self_and_file_exclude_each_other(tmp_path):
    from skyline.cli import main

    with pytest.raises(SystemExit) as e:
        main(["quantize", "model", "--format", "int8", "--out", str(tmp_path),
              "--calib-self", "--calib-file", "x.txt"])
    assert str(e.value) == "skyline: error: pass --calib-file or --calib-self, not both"
