"""FP8 W8A8: e4m3 weights with one float32 scale per output channel, activations quantized
per token at run time; the product is ops/fp8_linear.py's (fp8 GEMVs and `torch._scaled_mm` on
CUDA GPUs of compute capability >= 8.9, an exact float32 emulation elsewhere)."""

from __future__ import annotations

import torch

from skyline.model.layers.linear import Linear
from skyline.ops.fp8_linear import fp8_linear
from skyline.ops.fp8_quant import FP8, FP8_MAX, fake_quantize_rows_fp8, quantize_rows_fp8
from skyline.quant.base import QuantLinearMethod, dense_linear, dense_weight, keep_dense

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
        if not hasattr(layer, "weight_scale"):  # prepacked for the CPU
            return dense_linear(layer, fake_quantize_rows_fp8(x)).to(x.dtype)
        return fp8_linear(x, layer.weight, layer.weight_scale, layer.bias, GEMV_ACTIVATIONS)

    def prepack_cpu(self, layer: Linear, dtype: torch.dtype) -> bool:
        """For a CPU engine (loader.prepack_for_cpu). CPUs have no fp8 matmul units (torch's
        CPU `_scaled_mm` is slower than the float32 emulation), and the emulation dequantizes
        the weight at every call: keep it dequantized once in the engine's dtype (packed for
        oneDNN), activations still quantized per token — W8A8's values at dense speed and
        memory."""
        keep_dense(layer, self.dequantized_weight(layer).to(dtype), ("weight", "weight_scale"))
        return True

    def dequantized_weight(self, layer: Linear) -> torch.Tensor:
        if not hasattr(layer, "weight_scale"):
            return dense_weight(layer)
        return super().dequantized_weight(layer)
