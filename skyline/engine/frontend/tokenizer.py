"""The tokenizer: a `tokenizers.Tokenizer` plus what serving needs around it (BOS/EOS ids, the
tokens that end a turn, the chat template), loaded from a HF directory or a GGUF file.

Semantics follow transformers: `encode(text)` adds the special tokens the model asks for (e.g.
BOS); a rendered chat prompt already spells them, so `encode_chat` encodes it without.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend
from tokenizers import processors

from skyline.config import ConfigError
from skyline.engine.frontend.chat_template import render_chat_template

# Tokens that end an assistant turn in common chat formats. One counts as an end token of a
# model when it is in the vocabulary and its chat template writes it.
END_OF_TURN_TOKENS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>", "<|return|>", "<|call|>", "<EOT>", "<end_of_utterance>",
)


class Tokenizer:
    """Text <-> token ids, special tokens, and the chat template of one model."""

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
        extra_eos_ids: list[int] | tuple[int, ...] = (),
        name: str = "",
    ) -> None:
        self.backend = backend
        self.name = name
        self.bos_token, self.eos_token = bos_token, eos_token
        self.unk_token, self.pad_token = unk_token, pad_token
        self.chat_template = chat_template
        self.bos_token_id = self._id(bos_token)
        self.eos_token_id = self._id(eos_token)
        ends = [self.eos_token_id, *extra_eos_ids]
        for t in END_OF_TURN_TOKENS:
            if chat_template and t in chat_template:
                ends.append(self._id(t))
        self.eos_token_ids: tuple[int, ...] = tuple(
            dict.fromkeys(i for i in ends if i is not None and 0 <= i < self.vocab_size)
        )

    # ---------------------------------------------------------------------------- loading

    @classmethod
    def load(cls, path: str) -> Tokenizer:
        """The tokenizer of a HF model directory (tokenizer.json) or of a .gguf file."""
        if os.path.isdir(path):
            return cls.from_hf_dir(path)
        if os.path.isfile(path):
            if os.path.basename(path) == "tokenizer.json":
                return cls.from_hf_dir(os.path.dirname(path) or ".")
            return cls.from_gguf(path)
        raise ConfigError(
            f"tokenizer path {path} does not exist; pass a HF model directory or a .gguf file"
        )

    @classmethod
    def from_gguf(cls, path: str) -> Tokenizer:
        from skyline.engine.frontend.gguf_tokenizer import build_gguf_vocab
        from skyline.model.gguf import open_gguf

        v = build_gguf_vocab(open_gguf(path), path)
        return cls(v.backend, bos_token=v.bos_token, eos_token=v.eos_token,
                   unk_token=v.unk_token, pad_token=v.pad_token, chat_template=v.chat_template,
                   extra_eos_ids=v.end_ids, name=path)

    @classmethod
    def from_hf_dir(cls, path: str) -> Tokenizer:
        """tokenizer.json, with tokenizer_config.json (special tokens, add_bos_token, chat
        template), chat_template.jinja/.json and generation_config.json (eos ids) if present."""
        p = Path(path)
        file = p / "tokenizer.json"
        if not file.is_file():
            raise ConfigError(
                f"{path} has no tokenizer.json; skyline needs a fast tokenizer (save one with "
                "transformers' AutoTokenizer.from_pretrained(...).save_pretrained(dir))"
            )
        try:
            backend = Backend.from_file(str(file))
        except Exception as e:  # tokenizers raises plain Exception on a bad file
            raise ConfigError(f"cannot read {file} ({e}); download it again") from None
        cfg = _read_json(p / "tokenizer_config.json")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if (p / "chat_template.jinja").is_file():
            template = (p / "chat_template.jinja").read_text(encoding="utf-8")
        elif (p / "chat_template.json").is_file():
            template = _read_json(p / "chat_template.json").get("chat_template", template)
        gen = _read_json(p / "generation_config.json") or _read_json(p / "config.json")
        eos = gen.get("eos_token_id")
        extra = [e for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int)]
        bos_token, eos_token = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
        _match_add_flags(backend, bos_token, cfg.get("add_bos_token"), eos_token,
                         cfg.get("add_eos_token"))
        return cls(backend, bos_token=bos_token, eos_token=eos_token,
                   unk_token=_token_text(cfg.get("unk_token")),
                   pad_token=_token_text(cfg.get("pad_token")),
                   chat_template=template if isinstance(template, str) else None,
                   extra_eos_ids=extra, name=path)

    # ---------------------------------------------------------------------------- text <-> ids

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    # ---------------------------------------------------------------------------- chat

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for `messages`, rendered as transformers renders it; kwargs (e.g.
        enable_thinking) are passed to the template."""
        template = chat_template or self.chat_template
        if not template:
            raise ConfigError(
                f"the model {self.name or ''} has no chat template; send a plain completion "
                "prompt, or pass a chat template"
            )
        special = {k: v for k, v in (("bos_token", self.bos_token), ("eos_token", self.eos_token),
                                     ("unk_token", self.unk_token), ("pad_token", self.pad_token))
                   if v is not None}
        return render_chat_template(template, messages, add_generation_prompt=add_generation_prompt,
                                    tools=tools, special_tokens=special, **kwargs)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> list[int]:
        """Token ids of the rendered chat prompt. The template writes any BOS itself, so the
        text is encoded without adding special tokens (no doubled BOS)."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, **kwargs)
        return self.encode(text, add_special_tokens=False)

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def __repr__(self) -> str:
        return (f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, "
                f"bos={self.bos_token!r}, eos_ids={self.eos_token_ids})")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path} ({e}); download it again") from None
    return data if isinstance(data, dict) else {}


def _token_text(token: Any) -> str | None:
    # tokenizer_config.json writes special tokens as text or as a serialized AddedToken
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _match_add_flags(backend: Backend, bos: str | None, add_bos: Any, eos: str | None,
                     add_eos: Any) -> None:
    """Honor explicit add_bos_token / add_eos_token of tokenizer_config.json when tokenizer.json's
    post-processor disagrees (transformers rebuilds the post-processor from these flags)."""
    bos_id = backend.token_to_id(bos) if bos else None
    eos_id = backend.token_to_id(eos) if eos else None
    probe = backend.encode("a", add_special_tokens=True).ids
    has_bos = bos_id is not None and probe[:1] == [bos_id]
    has_eos = eos_id is not None and probe[-1:] == [eos_id]
    want_bos = has_bos if add_bos is None or bos_id is None else bool(add_bos)
    want_eos = has_eos if add_eos is None or eos_id is None else bool(add_eos)
    if (want_bos, want_eos) == (has_bos, has_eos):
        return
    ends = [(t, i) for t, i, on in ((bos, bos_id, want_bos), (eos, eos_id, want_eos)) if on]

    def seq(x: str, type_id: int) -> str:
        parts = ([bos] if want_bos else []) + [x] + ([eos] if want_eos else [])
        return " ".join(f"{t}:{type_id}" for t in parts)

    backend.post_processor = processors.TemplateProcessing(
        single=seq("$A", 0), pair=f"{seq('$A', 0)} {seq('$B', 1)}",
        special_tokens=list(dict.fromkeys(ends)),
    )
