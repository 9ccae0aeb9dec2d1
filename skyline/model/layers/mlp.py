"""Gated MLP (SwiGLU): down(silu(gate(x)) * up(x)), with gate and up as one matmul.
Tensor parallel: gate/up column-parallel, down row-parallel (one all-reduce)."""

from __future__ import annotations

import torch
from torch import nn

from skyline.model.layers.linear import Linear, MergedLinear
from skyline.ops.activation import silu_and_mul


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, parallel="row")

    def input_quant(self, x: torch.Tensor) -> str | None:
        """How the norm before it should hand it x (gate_up_proj's Linear.input_quant)."""
        return self.gate_up_proj.input_quant(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate_size]
        act = silu_and_mul(gate_up, quant=self.down_proj.input_quant(gate_up))
        return self.down_proj(act)  # [num_tokens, hidden_size]
