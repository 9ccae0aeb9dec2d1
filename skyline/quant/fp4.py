"""MXFP4 and NVFP4 weight-only formats: 4-bit E2M1 elements in small blocks with a shared scale.

E2M1 codes (ops/fp4.py, which reads them back): bit 3 is the sign, bits 0-2 index the
magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6. Encoding rounds to nearest, ties to the even code
(round-half-even on the E2M1 grid), and saturates at 6. Two codes per byte, element 2j in the
low nibble.

- MXFP4 (OCP Microscaling v1.0): blocks of 32, one E8M0 scale per block (a power of two,
  2^(e - 127), e = 255 is NaN) chosen as 2^(floor(log2(amax)) - 2), 2 being E2M1's largest
  exponent; values above 6 x scale then saturate to 6, as the spec prescribes.
- NVFP4: blocks of 16, an E4M3 scale per block and one float32 scale per tensor:
  w = e2m1 * e4m3_block_scale * tensor_scale, tensor_scale = amax(|W|) / (6 * 448), so the
  largest block scale uses E4M3's full range.
"""

from __future__ import annotations

import torch

from skyline.ops import cpu_int4
from skyline.ops.block_linear import mxfp4_linear, nvfp4_linear
from skyline.ops.fp4 import decode_e2m1, dequantize_mxfp4, dequantize_nvfp4, e8m0_to_float
from skyline.ops.triton_utils import triton
from skyline.quant.base import (
    QuantLinearMethod,
    dense_linear,
    dense_weight,
    keep_dense,
    pack_nibbles,
    pad_cols,
    unpack_nibbles,
)
from skyline.quant.method import LinearLayer

__all__ = ["decode_e2m1", "dequantize_mxfp4", "dequantize_nvfp4", "e8m0_to_float", "quantize_mxfp4",
           "quantize_nvfp4"]

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring magnitudes; a tie rounds to the even code, i.e. up when the
# upper code is even.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_UP = (False, True, False, True, False, True, False)
E4M3_MAX = 448.0


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """float tensor -> uint8 E2M1 codes (0..15), round-half-even, saturating at +-6."""
    mag = x.abs().float()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for mid, up in zip(_MIDPOINTS, _TIE_UP, strict=True):
        code += (mag >= mid if up else mag > mid).to(torch.uint8)
    return code | ((x < 0).to(torch.uint8) << 3)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, K] -> (packed codes uint8 [R, Kp / 2], E8M0 scales uint8 [R, Kp / 32])."""
    rows = w.shape[0]
    wb = pad_cols(w.float(), 32).reshape(rows, -1, 32)  # [R, B, 32]
    amax = wb.abs().amax(-1)  # [R, B]
    # floor(log2(amax)) read off the float32 exponent bits, exact for every normal amax.
    exp = torch.frexp(amax)[1].to(torch.int32) - 1  # amax = m * 2^e, m in [0.5, 1)
    exp = torch.where(amax > 0, exp - 2, torch.full_like(exp, -127)).clamp(-127, 127)
    scale = torch.exp2(exp.float()).unsqueeze(-1)
    codes = encode_e2m1(wb / scale).reshape(rows, -1)
    return pack_nibbles(codes), (exp + 127).to(torch.uint8)


def quantize_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [R, K] -> (packed codes uint8 [R, Kp / 2], E4M3 block scales [R, Kp / 16],
    float32 tensor scale [1])."""
    rows = w.shape[0]
    wb = pad_cols(w.float(), 16).reshape(rows, -1, 16)  # [R, B, 16]
    amax = w.float().abs().amax()
    tensor_scale = amax / (6.0 * E4M3_MAX) if amax > 0 else torch.ones((), device=w.device)
    block = (wb.abs().amax(-1) / 6.0 / tensor_scale).clamp(max=E4M3_MAX)
    block_q = block.to(torch.float8_e4m3fn)  # round-to-nearest-even
    step = block_q.float() * tensor_scale  # [R, B]: the value of E2M1 1.0 in this block
    safe = torch.where(step > 0, step, torch.ones_like(step)).unsqueeze(-1)
    codes = torch.where(step.unsqueeze(-1) > 0, encode_e2m1(wb / safe), 0).to(torch.uint8)
    return pack_nibbles(codes.reshape(rows, -1)), block_q, tensor_scale.reshape(1).float()


class Mxfp4LinearMethod(QuantLinearMethod):
    name = "mxfp4"
    column_block = 32

    def param_specs(self, rows: int, cols: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        blocks = -(-cols // 32)
        return {"qweight": ((rows, blocks * 16), torch.uint8),
                "scales": ((rows, blocks), torch.uint8)}

    def quantize(
        self, w: torch.Tensor, act_sq: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        packed, scales = quantize_mxfp4(w)
        return {"qweight": packed, "scales": scales}

    def dequantize(self, q: dict[str, torch.Tensor], cols: int) -> torch.Tensor:
        return dequantize_mxfp4(q["qweight"], q["scales"])[:, :cols]

    # Served without a full dequantization at every call: on CUDA the packed tensors as they
    # are (4.25 bits a weight, ops/gemv_block.py, as NVFP4 below); on the CPU in bfloat16
    # torch's int4 kernel, the E2M1 codes as two planes (ops/cpu_int4.py), exact values.

    def prepack_cpu(self, layer: LinearLayer, dtype: torch.dtype) -> bool:
        """For a CPU engine in bfloat16 (loader.prepack_for_cpu): keep only the planes."""
        if dtype != torch.bfloat16 or self._cpu_planes(layer) is None:
            return False
        del layer.qweight, layer.scales
        return True

    def dequantized_weight(self, layer: LinearLayer) -> torch.Tensor:
        if not hasattr(layer, "qweight"):  # prepacked: read back from the planes
            return cpu_int4.planes_weight(layer.fp4_planes)[:, : layer.in_features]
        return super().dequantized_weight(layer)

    def apply(self, layer: LinearLayer, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and triton is not None and hasattr(layer, "qweight"):
            return mxfp4_linear(x, layer.qweight, layer.scales, layer.bias)
        if x.dtype == torch.bfloat16 and (planes := self._cpu_planes(layer)) is not None:
            return cpu_int4.planes_linear(x, planes, layer.bias)
        return super().apply(layer, x)

    def _cpu_planes(self, layer: LinearLayer) -> tuple[cpu_int4.Plane, ...] | None:
        # made at the first use, kept beside the packed tensors (None: no kernel, or a shape
        # it cannot take)
        if not hasattr(layer, "fp4_planes"):
            planes = None
            if cpu_int4.has_kernel():
                planes = cpu_int4.pack_e2m1_planes(unpack_nibbles(layer.qweight),
                                                   e8m0_to_float(layer.scales), 32)
            layer.fp4_planes = planes
        return layer.fp4_planes


class Nvfp4LinearMethod(QuantLinearMethod):
    name = "nvfp4"
    column_block = 16
    per_tensor = ("tensor_scale",)

    def param_specs(self, rows: int, cols: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        blocks = -(-cols // 16)
        return {"qweight": ((rows, blocks * 8), torch.uint8),
                "scales": ((rows, blocks), torch.float8_e4m3fn),
                "tensor_scale": ((rows,), torch.float32)}

    def quantize(
        self, w: torch.Tensor, act_sq: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        packed, scales, tensor_scale = quantize_nvfp4(w)
        return {"qweight": packed, "scales": scales, "tensor_scale": tensor_scale}

    def dequantize(self, q: dict[str, torch.Tensor], cols: int) -> torch.Tensor:
        return dequantize_nvfp4(q["qweight"], q["scales"], q["tensor_scale"])[:, :cols]

    def prepack_cpu(self, layer: LinearLayer, dtype: torch.dtype) -> bool:
        """For a CPU engine (loader.prepack_for_cpu): no CPU kernel takes 16-element blocks,
        so the layer keeps its weight dequantized once, in the engine's dtype and packed for
        oneDNN where it can be (the values every call would otherwise dequantize to; dense
        memory, dense speed)."""
        keep_dense(layer, self.dequantized_weight(layer).to(dtype),
                   ("qweight", "scales", "tensor_scale"))
        return True

    def dequantized_weight(self, layer: LinearLayer) -> torch.Tensor:
        if not hasattr(layer, "qweight"):
            return dense_weight(layer)
        return super().dequantized_weight(layer)

    # On CUDA the packed tensors are read as they are (4.5 bits a weight, ops/gemv_block.py):
    # up to 16 rows by the block GEMV, larger batches dequantized 32 MiB of rows at a time into
    # one scratch buffer shared by all layers, a dense matmul per chunk.

    def apply(self, layer: LinearLayer, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(layer, "qweight"):
            return dense_linear(layer, x)
        if x.is_cuda and triton is not None:
            return nvfp4_linear(x, layer.qweight, layer.scales, layer.tensor_scale, layer.bias)
        return super().apply(layer, x)
