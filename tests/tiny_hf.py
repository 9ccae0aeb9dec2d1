"""Tiny random Hugging Face models for tests: built by the test, saved as safetensors."""

from __future__ import annotations

import random

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


def prefix_prompts(vocab: int, n: int, shared: int, tail: tuple[int, int],
                   seed: int = 0) -> list[list[int]]:
    """`n` prompts of token ids in [2, vocab - 1): each a prefix of one shared run of `shared`
    tokens (at least half of it) and a tail of its own, `tail` (min, max) tokens long."""
    rng = random.Random(seed)
    common = [rng.randrange(2, vocab - 1) for _ in range(shared)]
    return [common[: rng.randint(shared // 2, shared)]
            + [rng.randrange(2, vocab - 1) for _ in range(rng.randint(*tail))]
            for _ in range(n)]
