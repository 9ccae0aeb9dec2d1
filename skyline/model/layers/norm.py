"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from skyline.ops.norm import fused_add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps) over the last dim.

    Numerics match HF Llama: the normalization runs in float32, the result is cast back to
    the input dtype, and only then multiplied by the weight.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, feeds: Any = None) -> None:
        """`feeds`: the Linear that takes this norm's output, if any; the norm then hands it
        the rows quantized as it takes them (Linear.input_quant)."""
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        # The consumer's question, not the consumer: a module attribute would register it
        # twice in the module tree.
        self._input_quant = feeds.input_quant if feeds is not None else None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [..., hidden] -> normed; with `residual`, x + residual is normed and also returned
        as the new residual: (normed, x + residual). With a residual both inputs are consumed
        (on CUDA the results are written over them, by one kernel). The normed rows come
        quantized where the Linear this norm feeds takes them so."""
        quant = self._input_quant(x) if self._input_quant is not None else None
        if residual is None:
            return rms_norm(x, self.weight, self.eps, quant=quant)
        return fused_add_rms_norm(x, residual, self.weight, self.eps, quant=quant)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"

