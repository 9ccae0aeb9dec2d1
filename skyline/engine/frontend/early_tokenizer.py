"""The API process's tokenizer: loaded from the model's path, and early, in a thread while the
engine process starts, where that path is known before the engine resolves it."""

from __future__ import annotations

import concurrent.futures
import os
from typing import Any

from skyline.config import ConfigError
from skyline.engine.frontend.tokenizer import Tokenizer
from skyline.model.default import default_model_path


def load_tokenizer(path: str, load_format: str,
                   chat_template: str | None = None) -> Tokenizer | None:
    """The model's tokenizer; None for dummy weights from a bare config.json. A given
    `chat_template` replaces the model's (its end-of-turn tokens become stop tokens too)."""
    if load_format == "dummy" and not os.path.exists(os.path.join(path, "tokenizer.json")):
        return None
    tok = Tokenizer.load(path)
    if chat_template is None:
        return tok
    return Tokenizer(tok.backend, bos_token=tok.bos_token, eos_token=tok.eos_token,
                     unk_token=tok.unk_token, pad_token=tok.pad_token,
                     chat_template=chat_template, extra_eos_ids=tok.eos_token_ids, name=tok.name)


class EarlyTokenizer:
    """The tokenizer, loaded in a thread while the engine process starts, where the model's
    path is known before the engine resolves it (a directory with tokenizer.json, a GGUF file,
    the default model): what the API process would otherwise do only once the engine is up.
    `result` falls back to loading it then (the engine resolved another path, or this load
    failed: the same call then raises in the caller's thread)."""

    def __init__(self, args: Any, chat_template: str | None) -> None:
        self.chat_template = chat_template
        self.path: str | None = None
        self._future: concurrent.futures.Future[Tokenizer | None] | None = None
        model = getattr(args, "model", None)
        if model is None:
            try:
                model = default_model_path()
            except ConfigError:
                return  # the engine says so, in its own words
        if not isinstance(model, str) or not (
                model.endswith(".gguf") and os.path.isfile(model)
                or os.path.isfile(os.path.join(model, "tokenizer.json"))):
            return
        self.path = model
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="skyline-tokenizer")
        self._future = pool.submit(load_tokenizer, model, "auto", chat_template)
        pool.shutdown(wait=False)

    def result(self, path: str, load_format: str) -> Tokenizer | None:
        """The tokenizer of the model the engine serves (`path`, `load_format`)."""
        future, self._future = self._future, None
        if future is not None and path == self.path and load_format != "dummy":
            try:
                return future.result()
            except Exception:  # loaded again below: that call's error is the one raised
                pass
        return load_tokenizer(path, load_format, self.chat_template)

    def drop(self) -> None:
        if self._future is not None:
            self._future.cancel()
            self._future = None
