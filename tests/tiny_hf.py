"""Tiny random Hugging Face models for tests: built by the test, saved as safetensors."""

from __future__ import annotations

import torch


def save_scaled(model: torch.nn.Module, path: object) -> str:
    """Save `model` to `path` with its matrices redrawn larger than HF's init (N(0, 0.15)), so
    that greedy decoding is not one repeated token; returns the path."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.eval().save_pretrained(path, safe_serialization=True)
    return str(path)
