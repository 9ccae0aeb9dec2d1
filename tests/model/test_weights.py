"""held_bytes counts what a model's layers hold in whatever serving layout, each tensor once,
without the KV cache."""

from __future__ import annotations

import torch
from torch import nn

from skyline.model.weights import held_bytes


def test_counts_parameters_buffers_and_layouts_once():
    a, b = nn.Linear(8, 4, bias=False), nn.Linear(8, 4, bias=False)
    b.weight = a.weight  # tied: counted once
    a.register_buffer("scale", torch.zeros(4))  # 16 bytes
    plane = torch.zeros(4, 2, dtype=torch.uint8)  # 8 bytes
    a.planes = ((plane, torch.zeros(2, dtype=torch.bfloat16)),)  # + 4 bytes
    b.planes = ((plane, torch.zeros(1, dtype=torch.bfloat16)),)  # the same plane; + 2 bytes
    a.kv_cache = torch.zeros(1000)  # not a weight
    assert held_bytes([a, b]) == 8 * 4 * 4 + 16 + 8 + 4 + 2
