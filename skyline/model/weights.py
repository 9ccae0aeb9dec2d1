"""Bytes of weights a model holds, whatever layout its layers serve with, and the kernels a
CPU model's decode steps read them through."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from skyline.model.layers.embedding import LMHead
from skyline.model.layers.linear import Linear


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


def cpu_kernels(model: nn.Module) -> dict[str, Any]:
    """What a CPU model's one-row decode step runs (start-up's report, benchmarks' records):
    its Linears counted by product ("bf16": skyline's bf16 kernel, "onednn": oneDNN's packed
    weight, "dense": F.linear, else the quantization method's name), the LM head's product
    (LMHead.kernel) and how the layers run ("native": the C++ decode step, "python": planned
    products called from Python, "modules": each module's forward)."""
    linears: Counter[str] = Counter()
    head = None
    for m in model.modules():
        if isinstance(m, Linear):
            method = m.linear_method
            name = getattr(method, "name", "") or type(method).__name__
            if name == "PackedLinearMethod":
                name = "bf16" if getattr(m, "bf16_weight", None) is not None else "onednn"
            linears["dense" if name == "UnquantizedLinearMethod" else name] += 1
        elif isinstance(m, LMHead):
            head = m.kernel(1)
    step = getattr(getattr(model, "model", None), "cpu_decode_step", None)
    return {"linears": dict(linears), "lm_head": head,
            "decode_step": step() if step is not None else "modules"}
