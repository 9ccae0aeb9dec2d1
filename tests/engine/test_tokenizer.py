"""engine/frontend/tokenizer.py: GGUF- and HF-dir-built tokenizers against transformers, chat
templates."""

from __future__ import annotations

import json
import os
import re

import pytest
from spm_vocab import write_spm_gguf
from tokenizers import pre_tokenizers

from skyline.config import ConfigError
from skyline.engine.frontend.chat_template import ChatTemplateError
from skyline.engine.frontend.tokenizer import Tokenizer
from skyline.model.default import default_model_path

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x ** 2  # square\n\n\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "I'm sure you'll see they've said it's 'quoted' -- we'D",
    "Ünïcödé façade naïve — “quotes” 日本語のテキスト 中文，标点。 Ελληνικά Кириллица",
    "emoji 🙂👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "   leading spaces, trailing   ",
    "tabs\t\tand\r\nCRLF\n\n\nnewlines \n \n",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more <repo_name>x",
    "x" * 40 + " " + "ab" * 20,
    "",
    " ",
    "https://example.com/path?q=1&r=2#frag",
]
# transformers builds the "smollm" pre-tokenizer as plain GPT-2 (it has no entry for it), while
# llama.cpp and the original SmolLM2 tokenizer.json split every digit first; they differ on
# digits next to whitespace runs, so those texts are checked against the original semantics only.
DIGIT_TEXTS = ["12345 67.89 1,000,000", "  12  ", "abc123def", "x = 3.14159\n  42\n", "2024-01-31"]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path())


@pytest.fixture(scope="module")
def ref():
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                      gguf_file=os.path.basename(path))


@pytest.fixture(scope="module")
def original(ref):
    # SmolLM2's own tokenizer.json pre-tokenizer: individual digits, then GPT-2 byte level.
    backend = ref.backend_tokenizer.__class__.from_str(ref.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    return backend


def test_gguf_encode_matches_transformers(ours, ref, original) -> None:
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text), text
    for text in TEXTS + DIGIT_TEXTS:
        ids = ours.encode(text)
        assert ids == original.encode(text).ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_gguf_special_tokens(ours) -> None:
    assert ours.vocab_size == 49152
    assert ours.bos_token == "<|im_start|>" and ours.bos_token_id == 1
    assert 2 in ours.eos_token_ids  # <|im_end|>: the default model stops at the end of a turn
    assert ours.encode("<|im_start|>") == [1]
    assert ours.encode("a") == ours.encode("a", add_special_tokens=False)  # no BOS for SmolLM2
    assert ours.decode([1, 19556, 2]) == "Hello"
    assert ours.decode([1, 19556, 2], skip_special_tokens=False) == "<|im_start|>Hello<|im_end|>"


CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "Ünïcode ok?"}],
    [{"role": "user", "content": "multi\nline\n\n  indented"}],
]

# Exercises what HF templates use: tojson, namespace, loop controls, raise_exception,
# whitespace control, trim_blocks/lstrip_blocks, tools, extra kwargs, special tokens.
CUSTOM_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(sys='') %}
{% for m in messages %}
    {% if m.role == 'system' %}{% set ns.sys = m.content %}{% continue %}{% endif %}
    {% if m.role not in ['user', 'assistant'] %}
        {{- raise_exception('bad role ' + m.role) }}
    {% endif %}
<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>
{% endfor %}
{% if tools %}TOOLS: {{ tools | tojson }}
{% endif %}
{% if ns.sys %}SYS={{ ns.sys }}{% endif %}
{% if enable_thinking is defined and not enable_thinking %}<no_think>{% endif %}
{% if add_generation_prompt %}<assistant>{% endif %}"""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Wetter für Köln",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_chat_template_matches_transformers(ours, ref) -> None:
    for conv in CONVERSATIONS:
        for gen in (True, False):
            want = ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(conv, add_generation_prompt=gen) == want
    for conv in CONVERSATIONS:
        kwargs = dict(tools=TOOLS, enable_thinking=False)
        want = ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=True,
                                       chat_template=CUSTOM_TEMPLATE, **kwargs)
        got = ours.apply_chat_template(conv, chat_template=CUSTOM_TEMPLATE, **kwargs)
        assert got == want
    with pytest.raises(ChatTemplateError, match="bad role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}], chat_template=CUSTOM_TEMPLATE)


def test_chat_prompt_encoding(ours) -> None:
    conv = CONVERSATIONS[0]
    ids = ours.encode_chat(conv)
    assert ids == ours.encode(ours.apply_chat_template(conv), add_special_tokens=False)
    assert ids[0] == 1 and ids[-4:] == ours.encode("<|im_start|>assistant\n")


def test_hf_dir(tmp_path, ours, ref) -> None:
    ref.save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").is_file()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.load(str(tmp_path))
    for text in TEXTS:
        assert tok.encode(text) == ours.encode(text), text
    assert tok.apply_chat_template(CONVERSATIONS[1]) == ours.apply_chat_template(CONVERSATIONS[1])
    assert tok.eos_token_ids == (2, 0) and tok.bos_token_id == 1
    # explicit add_bos_token is honored, and a chat prompt still gets exactly one BOS
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "chat_template.jinja").unlink()
    cfg["chat_template"] = [{"name": "default", "template": CUSTOM_TEMPLATE}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_hf_dir(str(tmp_path))
    assert tok.encode("Hello") == [1, 19556]
    assert tok.encode("Hello", add_special_tokens=False) == [19556]
    ids = tok.encode_chat(CONVERSATIONS[0])
    assert ids[0] == 1 and ids[1] != 1


def llama_cpp_spm(text: str, tokens: list[str], scores: list[float]) -> list[int]:
    """llama.cpp's SentencePiece tokenization (llm_tokenizer_spm_session), for reference: BOS,
    then per text fragment (special tokens cut it) a leading space, spaces as ▁, and the
    highest-scoring adjacent pair merged first (leftmost on ties); unknown chars as bytes."""
    vocab = {t: i for i, t in enumerate(tokens)}
    out = [vocab["<s>"]]
    for k, frag in enumerate(re.split(r"(<s>|</s>)", text)):
        if k % 2:
            out.append(vocab[frag])
            continue
        if not frag:
            continue
        syms = list(("▁" + frag).replace(" ", "▁"))
        while True:
            pairs = [(scores[vocab[syms[i] + syms[i + 1]]], -i) for i in range(len(syms) - 1)
                     if syms[i] + syms[i + 1] in vocab]
            if not pairs:
                break
            i = -max(pairs)[1]
            syms[i : i + 2] = [syms[i] + syms[i + 1]]
        for sym in syms:
            out += [vocab[sym]] if sym in vocab else [vocab[f"<0x{b:02X}>"] for b in sym.encode()]
    return out


def test_sentencepiece_gguf(tmp_path) -> None:
    template = "{% for m in messages %}{{ bos_token }}[{{ m.content }}]{% endfor %}"
    path = tmp_path / "spm.gguf"
    tokens, scores = write_spm_gguf(str(path), template)
    tok = Tokenizer.from_gguf(str(path))
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    texts = ["hello world", "hello", "abcab hello  world", "héllo\nworld", "z", "cabc abc",
             "bcab", "abcabc   "]
    # transformers prepends ▁ only to the very start, and not to text already starting with a
    # space; llama.cpp prepends it to every fragment, so these differ by a ▁ from transformers
    fragment_texts = [" hello", "world</s>hello", "<s>abc"]
    for text in texts + fragment_texts:
        ids = tok.encode(text)
        assert ids == llama_cpp_spm(text, tokens, scores), text
        if text in texts:
            assert ids == ref.encode(text), text
            assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert tok.encode("hello world") == [1, tok.token_to_id("▁hello"), tok.token_to_id("▁world")]
    assert tok.decode(tok.encode("héllo\nworld")) == "héllo\nworld"  # byte fallback
    # the template writes <s> itself: the chat prompt has one BOS, where encode() would add two
    conv = [{"role": "user", "content": "abc"}]
    assert tok.encode_chat(conv).count(1) == 1 and tok.encode_chat(conv)[0] == 1
    assert tok.encode(tok.apply_chat_template(conv))[:2] == [1, 1]


def test_errors(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        Tokenizer.load(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        Tokenizer.load(str(tmp_path))
    path = tmp_path / "spm.gguf"
    write_spm_gguf(str(path))
    tok = Tokenizer.load(str(path))
    with pytest.raises(ConfigError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ChatTemplateError, match="list of"):
        tok.apply_chat_template("hi", chat_template="{{ messages }}")  # type: ignore[arg-type]
    with pytest.raises(ChatTemplateError, match="not valid jinja"):
        tok.apply_chat_template([], chat_template="{% if %}")


@pytest.mark.parametrize("pre,hf_regex", [
    # the pre-tokenizer regexes of the original tokenizer.json files, as transformers keeps them
    ("llama-bpe", r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    ("qwen2", r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
])
def test_llama_cpp_regexes_split_like_originals(pre, hf_regex) -> None:
    from tokenizers import Regex

    from skyline.engine.frontend.gguf_tokenizer import PRE_TOKENIZER_SPLITS

    ours = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(rx), behavior="isolated")
                                    for rx in PRE_TOKENIZER_SPLITS[pre]])
    theirs = pre_tokenizers.Split(Regex(hf_regex), behavior="isolated")
    for text in TEXTS + DIGIT_TEXTS + ["I'M HE'LL THEY'RE", "a\r\n\r\n  b\n", "1234567 x"]:
        assert ours.pre_tokenize_str(text) == theirs.pre_tokenize_str(text), text
