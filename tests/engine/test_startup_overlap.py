"""The API process loads the tokenizer while the engine process starts (where the model's path is
known before the engine resolves it), not after: start-up to /health is shorter by the load."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from skyline.bench.smoke import tiny_model
from skyline.engine.args import EngineArgs
from skyline.engine.frontend import early_tokenizer
from skyline.engine.frontend.async_llm import AsyncLLM


class _Engine:
    def __init__(self, info: dict[str, Any]) -> None:
        self.info, self.dead, self.num_restarts = info, None, 0

    def shutdown(self, timeout: float = 0.0) -> None:
        pass


def _info(path: str) -> dict[str, Any]:
    return {"model_name": "tiny", "model_path": path, "load_format": "safetensors",
            "max_model_len": 256, "vocab_size": 512, "max_num_seqs": 8, "eos_token_ids": [2],
            "startup": {"spawn": 0.5, "load_weights": 1.0}}


@pytest.fixture
def loads(monkeypatch):
    """The tokenizer loads (their paths), and an event set at the first."""
    seen: list[str] = []
    started = threading.Event()
    load = early_tokenizer.load_tokenizer

    def counted(path: str, *args: Any) -> Any:
        seen.append(path)
        started.set()
        return load(path, *args)

    monkeypatch.setattr(early_tokenizer, "load_tokenizer", counted)
    return seen, started


def test_tokenizer_loads_while_the_engine_starts(loads, tmp_path):
    seen, started = loads
    path = tiny_model(str(tmp_path))
    during: list[bool] = []

    def link(**callbacks: Any) -> _Engine:
        during.append(started.wait(10))  # the engine "starts" until the load has begun
        return _Engine(_info(path))

    llm = AsyncLLM(EngineArgs(model=path), link=link)
    assert during == [True]
    assert seen == [path]  # loaded once, early
    assert llm.tokenizer is not None and llm.tokenizer.vocab_size == 512
    phases = llm.startup.seconds
    assert list(phases)[:2] == ["spawn", "load_weights"]
    assert {"engine_process_other", "tokenizer"} <= set(phases)


def test_tokenizer_of_another_path_loads_after(loads, tmp_path):
    seen, _ = loads
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    asked = tiny_model(str(tmp_path / "a"))
    served = tiny_model(str(tmp_path / "b"))  # e.g. the engine resolved another path
    llm = AsyncLLM(EngineArgs(model=asked), link=lambda **cb: _Engine(_info(served)))
    assert seen[-1] == served and llm.tokenizer is not None
