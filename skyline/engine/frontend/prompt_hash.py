"""A request's prompt as the engine will see it, reduced to the chained block hashes of its
prefix cache (cache/prefix.py): what a router (router/fleet.py) matches against the hashes
its replicas publish. Chat messages go through the model's chat template and text through
its tokenizer exactly as the server does (server/chat.py, AsyncLLM.encode).

A router only predicts with these: a request it cannot read here gets no hashes (None), and
the replica it is sent to answers it, errors included.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from skyline.cache.prefix import hash_token_blocks
from skyline.engine.create import resolve_model_path
from skyline.engine.frontend.tokenizer import Tokenizer


def _template_message(m: Any) -> dict[str, Any] | None:
    """An OpenAI chat message as chat templates read it (text parts joined, developer ->
    system), or None for one the server would refuse."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        return None
    content = m.get("content")
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict)]
        if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
            return None
        content = "".join(texts)
    elif content is not None and not isinstance(content, str):
        return None
    out: dict[str, Any] = {"role": "system" if m["role"] == "developer" else m["role"],
                           "content": content or ""}
    if m.get("name") is not None:
        out["name"] = m["name"]
    return out


class PromptHasher:
    """Hashes prompts for a model (a path, or None for the embedded default). The tokenizer
    loads in `load` (seconds for a GGUF file's vocabulary), which a router runs in the
    background while it already routes by load alone."""

    def __init__(self, model: str | None = None) -> None:
        self.path = resolve_model_path(model, "auto")  # a wrong path fails here, at once
        self.tokenizer: Tokenizer | None = None
        self.ready = False
        self._lock = threading.Lock()

    def load(self) -> None:
        with self._lock:
            if self.ready:
                return
            path = self.path
            if path.endswith(".gguf") or os.path.exists(os.path.join(path, "tokenizer.json")):
                self.tokenizer = Tokenizer.load(path)
            self.ready = True

    def token_ids(self, kind: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids for a chat or completion request body (the first prompt of
        a batch), or None."""
        self.load()
        tok = self.tokenizer
        if kind == "chat":
            msgs = body.get("messages")
            if tok is None or not tok.chat_template or not isinstance(msgs, list) or not msgs:
                return None
            messages = [_template_message(m) for m in msgs]
            if any(m is None for m in messages):
                return None
            kwargs = body.get("chat_template_kwargs") or {}
            if not isinstance(kwargs, dict):
                return None
            text = tok.apply_chat_template(
                messages, add_generation_prompt=body.get("add_generation_prompt", True) is not
                False, **kwargs)
            return tok.encode(text, add_special_tokens=False)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch is routed by its first prompt
        if isinstance(prompt, str):
            return tok.encode(prompt) if tok is not None else None
        if isinstance(prompt, list) and all(type(t) is int for t in prompt):
            return prompt
        return None

    def _hashes(self, kind: str, body: dict[str, Any],
                block_size: int) -> tuple[int, list[bytes]] | None:
        ids = self.token_ids(kind, body)
        if not ids:
            return None
        # The engine never reuses the last token's block (it needs one token to compute).
        return len(ids), hash_token_blocks(ids[: len(ids) - 1], block_size)

    def chat(self, body: dict[str, Any], block_size: int) -> tuple[int, list[bytes]] | None:
        return self._hashes("chat", body, block_size)

    def completion(self, body: dict[str, Any],
                   block_size: int) -> tuple[int, list[bytes]] | None:
        return self._hashes("completion", body, block_size)
