"""Shipped config.json files for dummy-weight runs at real scale (no checkpoint needed)."""

from __future__ import annotations

from pathlib import Path

_ROOT = Path(__file__).resolve().parent


def shipped_config_names() -> list[str]:
    """Names of the shipped configs, e.g. ["llama-3.1-8b", "qwen3-8b"]."""
    return sorted(p.parent.name for p in _ROOT.glob("*/config.json"))


def dummy_config_dir(name: str) -> str | None:
    """The folder holding the shipped config.json called `name` (e.g. "llama-3.1-8b"),
    or None when no shipped config has that name."""
    key = name.strip().lower()
    if key not in shipped_config_names():
        return None
    return str(_ROOT / key)
