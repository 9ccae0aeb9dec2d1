"""engine/frontend/detokenizer.py: streaming text deltas, UTF-8 split over tokens, stop strings."""

from __future__ import annotations

import random

import pytest
from spm_vocab import write_spm_gguf

from skyline.engine.frontend.detokenizer import IncrementalDetokenizer
from skyline.engine.frontend.tokenizer import Tokenizer
from skyline.model.default import default_model_path


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path())


def stream(tok: Tokenizer, ids: list[int], chunk: int = 1, **kw) -> tuple[list[str], object]:
    d = IncrementalDetokenizer(tok, **kw)
    deltas = [d.step(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(d.flush())
    return deltas, d


TEXTS = [
    "Hello world, this is a test.",
    "Ünïcödé façade — “quotes” 日本語のテキスト 🙂👍🏽 👨‍👩‍👧 🇫🇷",
    "def f(x):\n    return x ** 2\n\n",
    "  spaces   and\ttabs  ",
]


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_deltas_concatenate_to_full_decode(tok, chunk) -> None:
    for text in TEXTS:
        ids = tok.encode(text)
        deltas, d = stream(tok, ids, chunk)
        assert "".join(deltas) == tok.decode(ids) == text == d.text
        assert not any("\ufffd" in x for x in deltas)  # never half a character


def test_multibyte_split_over_tokens(tok) -> None:
    ids = tok.encode("🙂")
    assert len(ids) > 1  # the emoji is several byte-level tokens
    d = IncrementalDetokenizer(tok)
    assert [d.step([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert d.step(ids[-1:]) == "🙂"
    # stopped in the middle of a character: flush shows what there is
    d = IncrementalDetokenizer(tok)
    assert d.step(ids[:1]) == "" and d.flush() == tok.decode(ids[:1])


def test_random_token_streams(tok) -> None:
    rng = random.Random(0)
    for _ in range(30):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        for skip in (True, False):
            deltas, _ = stream(tok, ids, rng.choice([1, 3]), skip_special_tokens=skip)
            assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


def test_special_tokens(tok) -> None:
    ids = tok.encode("<|im_start|>assistant\nHi!<|im_end|>")
    assert "".join(stream(tok, ids)[0]) == "assistant\nHi!"
    assert "".join(stream(tok, ids, skip_special_tokens=False)[0]) == (
        "<|im_start|>assistant\nHi!<|im_end|>")


def test_stop_string_across_tokens(tok) -> None:
    text = "Hello world. The end is near."
    ids = tok.encode(text)
    deltas, d = stream(tok, ids, stop=["end is"])
    assert "end is" not in tok.decode(ids[:1]) and d.stop_matched == "end is"
    assert "".join(deltas) == d.text == "Hello world. The "
    deltas, d = stream(tok, ids, stop=["end is"], include_stop_str_in_output=True)
    assert "".join(deltas) == d.text == "Hello world. The end is"
    assert d.step(tok.encode(" more")) == "" and d.flush() == ""  # finished


def test_earliest_stop_wins(tok) -> None:
    ids = tok.encode("one two three four")
    _, d = stream(tok, ids, stop=["four", "two", "three"])
    assert d.stop_matched == "two" and d.text == "one "
    _, d = stream(tok, tok.encode("xyz tail"), stop=["x"])
    assert d.stop_matched == "x" and d.text == ""


def test_partial_match_held_back_then_released(tok) -> None:
    ids = tok.encode("Hello world. Worldwide.")
    assert tok.decode(ids[:2]) == "Hello world"  # " world" arrives as a token of its own
    d = IncrementalDetokenizer(tok, stop=["worldwide"])
    # "world" could be the start of "worldwide": held back while undecided, then released
    assert d.step(ids[:2]) == "Hello " and d.text == "Hello "
    assert d.step(ids[2:3]) == "world."
    assert "".join(d.step([i]) for i in ids[3:]) + d.flush() == " Worldwide."
    assert d.stop_matched is None and d.text == "Hello world. Worldwide."
    # held back up to the end of the request: flush releases it
    d = IncrementalDetokenizer(tok, stop=["world peace"])
    assert d.step(ids[:2]) == "Hello "
    assert d.flush() == "world" and d.text == "Hello world"


def test_stop_prefix_overlap(tok) -> None:
    # "aab": after "aa" the tail "a" and "aa" are both prefixes; the match must still be found
    d = IncrementalDetokenizer(tok, stop=["aab"])
    out = "".join(d.step([i]) for i in tok.encode("xaaab tail"))
    assert d.stop_matched == "aab" and out == d.text == "xa"


def test_sentencepiece_leading_space(tmp_path) -> None:
    write_spm_gguf(str(tmp_path / "spm.gguf"))
    spm = Tokenizer.from_gguf(str(tmp_path / "spm.gguf"))
    prompt = spm.encode("hello")
    out = spm.encode("world", add_special_tokens=False)  # [▁world]
    assert IncrementalDetokenizer(spm).step(out) == "world"  # start of the text: no space
    d = IncrementalDetokenizer(spm, prompt_token_ids=prompt)
    assert d.step(out) == " world" and d.flush() == ""
    ids = spm.encode("héllo world ü", add_special_tokens=False)  # ü: two byte-fallback tokens
    deltas, _ = stream(spm, ids)
    assert "".join(deltas) == spm.decode(ids) == "héllo world ü"
    assert not any("\ufffd" in x for x in deltas)
