"""FP8 W8A8: e4m3 weights with one float32 scale per output channel, activations quantized
per token at run time; the product is ops/fp8_linear.py's (fp8 GEMVs and `torch._scaled_mm` on
CUDA GPUs of compute capability >= 8.9, an exact float32 emulation elsewhere)."""

from __future__ import annotations

import torch

from skyline.model.layers.linear import Linear
from skyline.ops.fp8_linear import fp8_linear
from skyline.ops.fp8_quant import FP8, FP8_MAX, quantize_rows_fp8
from skyline.quant.base import QuantLinearMethod

__all__ = ["FP8", "FP8_MAX", "Fp8LinearMethod", "quantize_rows_fp8"]

# Decode-sized batches (<= 8 rows) on the GPU: "a8" runs the fp8 x fp8 tensor-core GEMV, which
# quantizes x itself per row and K tile (W8A8, finer-scaled than the per-token activations of
# the _scaled_mm path for larger batches); "a8q" quantizes x per row with its own kernel first
# (a faster GEMV, one more launch per Linear); "w8a16" streams the fp8 weights against
# unquantized activations, converting every weight. BENCHMARKS.md compares the three.
GEMV_ACTIVATIONS = "a8"


class Fp8LinearMethod(QuantLinearMethod):
    name = "fp8"

    def param_specs(self, rows: int, cols: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"weight": ((rows, cols), FP8), "weight_scale": ((rows,), torch.float32)}

    def quantize(
        self, w: torch.Tensor, act_sq: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        q, scale = quantize_rows_fp8(w)
        return {"weight": q, "weight_scale": scale.reshape(-1)}

    def dequantize(self, q: dict[str, torch.Tensor], cols: int) -> torch.Tensor:
        return q["weight"].float() * q["weight_scale"].unsqueeze(-1)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, layer.weight, layer.weight_scale, layer.bias, GEMV_ACTIVATIONS)
