"""Offline tools above the engine: they use its public API only (`LLM`, `LLM.query` for what
they ask of the loaded model, the engine's cost estimates), never its objects.

Their built-in data: calibration.txt (public domain, see its header), the text that
calibrates and scores quantization by default; prompts.jsonl, instruction prompts (chat
questions, writing and code-editing tasks) that an EAGLE head trains on and that the model
answers to write its own calibration text.
"""

from __future__ import annotations

from pathlib import Path

BUILTIN_TEXT = Path(__file__).parent / "calibration.txt"
BUILTIN_PROMPTS = str(Path(__file__).parent / "prompts.jsonl")


def builtin_text() -> str:
    return BUILTIN_TEXT.read_text(encoding="utf-8")
