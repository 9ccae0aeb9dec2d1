"""Bytes of weights a model holds, whatever layout its layers serve with."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def held_bytes(modules: Iterable[nn.Module]) -> int:
    """Bytes of every tensor the modules hold directly: parameters, buffers and serving layouts
    kept as plain attributes (the int4 kernel's planes, oneDNN-packed or dequantized weights),
    each tensor once; not the attention layers' KV caches."""
    seen: dict[int, torch.Tensor] = {}

    def visit(value: object) -> None:
        if isinstance(value, torch.Tensor):
            seen[id(value)] = value
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)

    for m in modules:
        visit({k: v for k, v in vars(m).items() if k != "kv_cache"})
    return sum(t.numel() * t.element_size() for t in seen.values())
