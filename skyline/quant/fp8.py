"""FP8 W8A8: e4m3 weights with one float32 scale per output channel, activations quantized
per token at run time; the product is ops/fp8_linear.py's (fp8 GEMVs and `torch._scaled_mm` on
CUDA GPUs of compute capability >= 8.9, an exact float32 emulation elsewhere)."""

from __future__ import annotations

import torch

from skyline.ops.fp8_linear import fp8_gemv_takes_rows, fp8_linear
from skyline.ops.fp8_quant import (
    FP8,
    FP8_MAX,
    Fp8Rows,
    fake_quantize_rows_fp8,
    quantize_rows_fp8,
)
from skyline.quant.base import QuantLinearMethod, dense_linear, dense_weight, keep_dense
from skyline.quant.method import LinearLayer

__all__ = ["FP8", "FP8_MAX", "Fp8LinearMethod", "quantize_rows_fp8"]

# Decode-sized batches (<= 8 rows) on the GPU run an fp8 x fp8 tensor-core GEMV: x comes
# quantized per row from the kernel that makes it (RMSNorm before qkv and gate/up, SiLU-and-mul
# before down: Linear.input_quant), and the GEMV quantizes any other x itself per row and K
# tile (finer-scaled than the per-token activations of the _scaled_mm path for larger batches).


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

    def apply(self, layer: LinearLayer, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        if not hasattr(layer, "weight_scale"):  # prepacked for the CPU
            return dense_linear(layer, fake_quantize_rows_fp8(x)).to(x.dtype)
        return fp8_linear(x, layer.weight, layer.weight_scale, layer.bias)

    def input_quant(self, layer: LinearLayer, x: torch.Tensor) -> str | None:
        """"fp8" where x, about to be made by a norm or activation kernel, should come quantized
        per row (Fp8Rows) for this layer's GEMV."""
        wants = hasattr(layer, "weight_scale") and fp8_gemv_takes_rows(x)
        return "fp8" if wants else None

    def prepack_cpu(self, layer: LinearLayer, dtype: torch.dtype) -> bool:
        """For a CPU engine (loader.prepack_for_cpu). CPUs have no fp8 matmul units (torch's
        CPU `_scaled_mm` is slower than the float32 emulation), and the emulation dequantizes
        the weight at every call: keep it dequantized once in the engine's dtype (packed for
        oneDNN), activations still quantized per token — W8A8's values at dense speed and
        memory."""
        keep_dense(layer, self.dequantized_weight(layer).to(dtype), ("weight", "weight_scale"))
        return True

    def dequantized_weight(self, layer: LinearLayer) -> torch.Tensor:
        if not hasattr(layer, "weight_scale"):
            return dense_weight(layer)
        return super().dequantized_weight(layer)
