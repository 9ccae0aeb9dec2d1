"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from skyline.ops.norm import fused_add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps) over the last dim.

    Numerics match HF Llama: the normalization runs in float32, the result is cast back to
    the input dtype, and only then multiplied by the weight.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, quant: str | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [..., hidden] -> normed; with `residual`, x + residual is normed and also returned
        as the new residual: (normed, x + residual). With a residual both inputs are consumed
        (on CUDA the results are written over them, by one kernel). With `quant` (x [T, hidden])
        the normed rows come quantized for the Linear that asked (Linear.input_quant)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps, quant=quant)
        return fused_add_rms_norm(x, residual, self.weight, self.eps, quant=quant)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"

