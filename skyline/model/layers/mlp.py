"""Gated MLP (SwiGLU): down(silu(gate(x)) * up(x)), with gate and up as one matmul."""

from __future__ import annotations

import torch
from torch import nn

from skyline.model.layers.linear import Linear, MergedLinear


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up_proj(x))  # [num_tokens, hidden_size]

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The MLP after its gate/up projection: [num_tokens, 2 * intermediate_size] ->
        [num_tokens, hidden_size] (the activation fused into the down projection where it
        can be)."""
        return self.down_proj.forward_silu_mul(gate_up)
