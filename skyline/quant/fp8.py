"""FP8 W8A8: e4m3 weights with one float32 scale per output channel, activations quantized
per token at run time; the product is ops/fp8_linear.py's (fp8 GEMVs and `torch._scaled_mm` on
CUDA GPUs of compute capability >= 8.9, an exact float32 emulation elsewhere).

Checkpoints of other tools (quant/external/) bring two variants: weight scales per block of
rows and 128 columns, held per row and column block [rows, cdiv(cols, 128)] with activations
quantized per token and 128 columns (ops/fp8_block.py); and a static input scale the tool
calibrated, which quantizes every token's activations (the largest of a merged layer's
projections, as each of them must saturate no later than its own did)."""

from __future__ import annotations

import torch

from skyline.ops.fp8_block import BLOCK, dequantize_fp8_blocks, fp8_block_linear
from skyline.ops.fp8_linear import fp8_linear, fp8_takes_rows, quantize_static_fp8
from skyline.ops.fp8_quant import (
    FP8,
    FP8_MAX,
    Fp8Rows,
    fake_quantize_rows_fp8,
    quantize_rows_fp8,
    quantize_rows_fp8_ref,
)
from skyline.quant.base import (
    QuantLinearMethod,
    dense_linear,
    dense_weight,
    keep_dense,
    shard_rows_loader,
)
from skyline.quant.method import LinearLayer

__all__ = ["FP8", "FP8_MAX", "Fp8LinearMethod", "quantize_rows_fp8"]

# Decode-sized batches (<= 8 rows) on the GPU run an fp8 x fp8 tensor-core GEMV, larger ones
# torch._scaled_mm: x comes quantized per row from the kernel that makes it (RMSNorm before qkv
# and gate/up, SiLU-and-mul before down: Linear.input_quant); the GEMV quantizes any other x
# itself per row and K tile (finer-scaled than the per-token activations of _scaled_mm), the
# _scaled_mm path by a launch of its own (the attention output before o_proj).


class Fp8LinearMethod(QuantLinearMethod):
    name = "fp8"
    coarse = ("weight_scale",)

    def param_specs(self, rows: int, cols: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        scale = (rows, -(-cols // BLOCK)) if self._blocks() else (rows,)
        return {"weight": ((rows, cols), FP8), "weight_scale": (scale, torch.float32)}

    def load_specs(self, layer: LinearLayer) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        if self.layout is None or not self.layout.static_input:
            return {}
        return {"input_scale": ((layer.out_features,), torch.float32)}

    def loader(self, layer: LinearLayer, name: str):
        if name == "input_scale":  # one per projection, kept per row until loading is done
            return shard_rows_loader(layer)
        return super().loader(layer, name)

    def block_rows(self) -> int:
        return self.layout.weight_block[0] if self._blocks() else 1

    def _blocks(self) -> bool:
        return self.layout is not None and self.layout.weight_block is not None

    def finish_prequantized(self, layer: LinearLayer) -> None:
        if "input_scale" in layer._parameters:
            scale = layer.input_scale.data.max().reshape(1)
            del layer.input_scale
            layer.input_scale = scale

    def quantize(
        self, w: torch.Tensor, act_sq: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        q, scale = quantize_rows_fp8(w)
        return {"weight": q, "weight_scale": scale.reshape(-1)}

    def dequantize(self, q: dict[str, torch.Tensor], cols: int) -> torch.Tensor:
        if q["weight_scale"].dim() == 2:
            return dequantize_fp8_blocks(q["weight"], q["weight_scale"])
        return q["weight"].float() * q["weight_scale"].unsqueeze(-1)

    def apply(self, layer: LinearLayer, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        static = getattr(layer, "input_scale", None)
        if not hasattr(layer, "weight_scale"):  # prepacked for the CPU
            return dense_linear(layer, self._fake_quantize(x, static)).to(x.dtype)
        if layer.weight_scale.dim() == 2:
            return fp8_block_linear(x, layer.weight, layer.weight_scale, layer.bias)
        return fp8_linear(x, layer.weight, layer.weight_scale, layer.bias, x_scale=static)

    def _fake_quantize(self, x: torch.Tensor, static: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] -> float32: the activations this layer's product multiplies."""
        if static is None and not self._blocks():
            return fake_quantize_rows_fp8(x)
        x2 = x.reshape(-1, x.shape[-1])
        if static is not None:
            xq, scale = quantize_static_fp8(x2, static)
            return (xq.float() * scale).reshape(x.shape)
        xq, scale = quantize_rows_fp8_ref(x2, BLOCK)
        return (xq.float() * scale.repeat_interleave(BLOCK, dim=1)[:, : x.shape[-1]]
                ).reshape(x.shape)

    def input_quant(self, layer: LinearLayer, x: torch.Tensor) -> str | None:
        """"fp8" where x, about to be made by a norm or activation kernel, should come quantized
        per row (Fp8Rows) for this layer's GEMV or torch._scaled_mm (per-token activations and
        per-row weight scales only)."""
        wants = (hasattr(layer, "weight_scale") and layer.weight_scale.dim() == 1
                 and getattr(layer, "input_scale", None) is None
                 and fp8_takes_rows(x, layer.weight))
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
