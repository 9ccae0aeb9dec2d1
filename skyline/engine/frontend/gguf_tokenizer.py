"""Build a `tokenizers.Tokenizer` from the tokenizer a GGUF file describes, as llama.cpp reads it
(src/llama-vocab.cpp): byte-level BPE ("gpt2") with the pre-tokenizer regexes named by
`tokenizer.ggml.pre`, or SentencePiece ("llama") as a byte-fallback BPE whose merges follow the
token scores (as transformers converts SentencePiece models).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gguf import GGUFReader
from tokenizers import (
    AddedToken,
    Regex,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)
from tokenizers import Tokenizer as Backend

from skyline.config import ConfigError
from skyline.model.gguf import gguf_value

# llama_token_type values stored in tokenizer.ggml.token_type
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer regexes, applied in order, each splitting every piece and keeping both the
# matches and the text between them (llama.cpp's unicode_regex_split).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]
_LLAMA3_NAMES = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                 "midm-2.0", "lfm2", "dbrx", "smaug-bpe")
_GROUPS: list[tuple[tuple[str, ...], list[str]]] = [
    (_LLAMA3_NAMES, [_LLAMA3]),
    (("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "hunyuan"), [_QWEN2]),
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
     [r"\p{N}", _GPT2]),
    (("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "roberta-bpe", "exaone4", "trillion"),
     [_GPT2]),
    (("default",), _DEFAULT),
]
PRE_TOKENIZER_SPLITS: dict[str, list[str]] = {n: rx for names, rx in _GROUPS for n in names}


@dataclass
class GGUFVocab:
    """A tokenizer built from GGUF metadata, with what the Tokenizer wrapper needs besides."""

    backend: Backend
    bos_token: str | None = None
    eos_token: str | None = None
    unk_token: str | None = None
    pad_token: str | None = None
    chat_template: str | None = None
    end_ids: list[int] = field(default_factory=list)  # eos, eot, eom ids the file names


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from bytes to printable characters (byte-level BPE spells tokens in it)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def build_gguf_vocab(reader: GGUFReader, path: str) -> GGUFVocab:
    def value(key: str, default: Any = None) -> Any:
        return gguf_value(reader, f"tokenizer.ggml.{key}", default)

    model = value("model")
    tokens: list[str] = value("tokens") or []
    if not tokens:
        raise ConfigError(f"{path} has no tokenizer vocabulary; pass a tokenizer directory too")
    types: list[int] = value("token_type") or [NORMAL] * len(tokens)
    if model == "gpt2":
        pre = value("pre") or "default"
        if pre not in PRE_TOKENIZER_SPLITS:
            raise ConfigError(
                f"{path} asks for the pre-tokenizer {pre!r}, which skyline does not know; "
                f"supported: {', '.join(sorted(PRE_TOKENIZER_SPLITS))}"
            )
        merges: list[str] = value("merges") or []
        backend = _byte_level(tokens, types, merges, pre)
        add_bos_default = pre in _LLAMA3_NAMES
    elif model == "llama":
        scores: list[float] = value("scores") or [0.0] * len(tokens)
        backend = _sentencepiece(tokens, scores, types, bool(value("add_space_prefix", True)))
        add_bos_default = True
    else:
        raise ConfigError(
            f"{path} has a {model!r} tokenizer, which skyline cannot build; supported: "
            "gpt2 (byte-level BPE) and llama (SentencePiece)"
        )

    def token(key: str) -> str | None:
        i = value(f"{key}_token_id")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    out = GGUFVocab(backend, token("bos"), token("eos"), token("unknown"), token("padding"),
                    gguf_value(reader, "tokenizer.chat_template"))
    out.end_ids = [i for k in ("eos", "eot", "eom")
                   if isinstance(i := value(f"{k}_token_id"), int) and 0 <= i < len(tokens)]
    _set_post_processor(backend, out.bos_token if value("add_bos_token", add_bos_default) else None,
                        out.eos_token if value("add_eos_token", False) else None)
    return out


def _byte_level(tokens: list[str], types: list[int], merges: list[str], pre: str) -> Backend:
    spell = bytes_to_unicode()
    alphabet = set(spell.values())
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        # A few converters store added tokens as raw text; byte-level BPE looks tokens up spelled.
        key = t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8"))
        vocab.setdefault(key, i)
    pairs = []
    for m in merges:
        cut = m.find(" ", 1)  # as llama.cpp: the first space after the first character
        if cut > 0:
            pairs.append((m[:cut], m[cut + 1 :]))
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre in _LLAMA3_NAMES))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in PRE_TOKENIZER_SPLITS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a converter mislabel: adding it would
    # grow the vocabulary past the model's (transformers skips these too).
    _add_tokens(backend, tokens, types, vocab, lambda t: set(t) <= alphabet)
    return backend


def _sentencepiece(tokens: list[str], scores: list[float], types: list[int],
                   add_space_prefix: bool) -> Backend:
    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}  # first id wins
    unk = next((tokens[i] for i, ty in enumerate(types) if ty == UNKNOWN), None)
    backend = Backend(models.BPE(
        vocab=vocab, merges=_merges_from_scores(tokens, scores, types, vocab),
        unk_token=unk, fuse_unk=True, byte_fallback=True,
    ))
    # As llama.cpp: spaces become ▁, and with add_space_prefix every text fragment (the text at
    # the start and after each special token) gets a leading ▁, even if it starts with a space.
    steps_n = [normalizers.Prepend("▁")] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps_n, normalizers.Replace(" ", "▁")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    _add_tokens(backend, tokens, types, vocab, lambda t: True)
    return backend


def _merges_from_scores(tokens: list[str], scores: list[float], types: list[int],
                        vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's highest-score-first pair merging: every split
    of a normal token into two known pieces, ordered by the token's score (then longer left,
    longer right, then vocabulary order), as transformers' generate_merges orders them."""
    found: list[tuple[float, int, int, str, str]] = []
    for t, score, ty in zip(tokens, scores, types, strict=False):
        if ty != NORMAL:
            continue
        local = [(t[:k], t[k:]) for k in range(1, len(t)) if t[:k] in vocab and t[k:] in vocab]
        local.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        found.extend((score, len(left), len(right), left, right) for left, right in local)
    found.sort(key=lambda m: (m[0], m[1], m[2]), reverse=True)  # stable: ties keep order
    return [(m[3], m[4]) for m in found]


def _add_tokens(backend: Backend, tokens: list[str], types: list[int], vocab: dict[str, int],
                spelled_ok: Callable[[str], bool]) -> None:
    # Control (and unknown) tokens are special: matched whole, skipped when decoding with
    # skip_special_tokens. User-defined ones (e.g. <think>) are matched whole but kept.
    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types, strict=False)
               if ty in (CONTROL, UNKNOWN) and spelled_ok(t)]
    if special:
        backend.add_special_tokens(special)
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types, strict=False) if ty == USER_DEFINED and t in vocab]
    if user:
        backend.add_tokens(user)


def _set_post_processor(backend: Backend, bos: str | None, eos: str | None) -> None:
    """Make encode(add_special_tokens=True) add BOS and/or EOS as the file asks."""
    if bos is None and eos is None:
        return
    special = [(t, backend.token_to_id(t)) for t in (bos, eos) if t is not None]

    def seq(x: str, type_id: int) -> str:
        return " ".join(f"{t}:{type_id}" for t in (bos, x, eos) if t is not None)

    backend.post_processor = processors.TemplateProcessing(
        single=seq("$A", 0), pair=f"{seq('$A', 0)} {seq('$B', 1)}",
        special_tokens=list(dict.fromkeys(special)),
    )
