"""FP8 W8A8: e4m3 weights with one float32 scale per output channel, activations quantized
per token at run time. CUDA GPUs of compute capability >= 8.9 multiply with
`torch._scaled_mm`; elsewhere an exact emulation dequantizes both sides and multiplies in
float32 (the same values _scaled_mm multiplies, accumulated in a different order)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from skyline.model.layers.linear import Linear
from skyline.ops.fp8_quant import FP8, FP8_MAX, quantize_rows_fp8
from skyline.ops.gemv_quant import fp8_gemv, fp8_gemv_a8, quant_gemv_ok
from skyline.quant.base import QuantLinearMethod

__all__ = ["FP8", "FP8_MAX", "Fp8LinearMethod", "quantize_rows_fp8"]

# Decode-sized batches (<= 8 rows) on the GPU: "a8" runs the fp8 x fp8 tensor-core GEMV, which
# quantizes x itself per row and K tile (W8A8, finer-scaled than the per-token activations of
# the _scaled_mm path for larger batches); "a8q" quantizes x per row with its own kernel first
# (a faster GEMV, one more launch per Linear); "w8a16" streams the fp8 weights against
# unquantized activations, converting every weight. BENCHMARKS.md compares the three.
GEMV_ACTIVATIONS = "a8"


@functools.lru_cache(maxsize=16)
def _has_fp8_units(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _scaled_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    if not x.is_cuda or not _has_fp8_units(x.device):
        return False
    return x.dtype == torch.bfloat16 and w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0


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
        w, w_scale = layer.weight, layer.weight_scale
        lead = x.shape[:-1]
        if quant_gemv_ok(x) and _has_fp8_units(x.device):
            # Decode-sized batches: a GEMV streaming the fp8 weight bytes.
            if GEMV_ACTIVATIONS == "w8a16":
                return fp8_gemv(x, w, w_scale, layer.bias)
            if GEMV_ACTIVATIONS == "a8q":
                xq, x_scale = quantize_rows_fp8(x.reshape(-1, x.shape[-1]))
                y = fp8_gemv_a8(xq, x_scale, w, w_scale, layer.bias, x.dtype)
                return y.reshape(*lead, -1)
            return fp8_gemv_a8(x, None, w, w_scale, layer.bias, x.dtype)
        x2 = x.reshape(-1, x.shape[-1])  # [M, K]
        xq, x_scale = quantize_rows_fp8(x2)  # dynamic per-token scales
        if _scaled_mm_ok(x2, w):
            # Row-wise scales: x_scale [M, 1], w_scale [1, N]; w.t() is column-major as required.
            y = torch._scaled_mm(xq, w.t(), scale_a=x_scale, scale_b=w_scale.unsqueeze(0),
                                 out_dtype=x.dtype)
            if layer.bias is not None:
                y = y + layer.bias
            return y.reshape(*lead, -1)
        xd = xq.float() * x_scale
        wd = w.float() * w_scale.unsqueeze(-1)
        y = F.linear(xd, wd).to(x.dtype)
        if layer.bias is not None:
            y = y + layer.bias
        return y.reshape(*lead, -1)
