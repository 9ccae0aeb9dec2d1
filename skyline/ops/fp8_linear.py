"""The FP8 W8A8 product y = x W^T (+ b) for e4m3 weights with one float32 scale per output
row, on whatever the device offers: the fp8 GEMVs of ops/gemv_quant.py for decode-sized batches
on GPUs with fp8 units, `torch._scaled_mm` (activations quantized per token) above that, and
elsewhere an exact emulation (both sides dequantized, multiplied in float32: the values
_scaled_mm multiplies, accumulated in another order). Shared by the fp8 Linear
(quant/fp8.py) and the fp8 LM head (model/layers/embedding.py). Activations are quantized per
token, or (checkpoints calibrated so, `x_scale`) with one static scale for every token."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from skyline.ops.fp8_quant import FP8, FP8_MAX, Fp8Rows, quantize_rows_fp8
from skyline.ops.gemv import MAX_ROWS
from skyline.ops.gemv_quant import fp8_gemv_a8, quant_gemv_ok


@functools.lru_cache(maxsize=16)
def has_fp8_units(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 9)


def scaled_mm_ok(device: torch.device, dtype: torch.dtype, w: torch.Tensor) -> bool:
    """Whether torch._scaled_mm multiplies activations of this device and dtype by the e4m3
    weight w."""
    if device.type != "cuda" or not has_fp8_units(device):
        return False
    return dtype == torch.bfloat16 and w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0


def fp8_gemv_takes_rows(x: torch.Tensor) -> bool:
    """Whether fp8_linear would run x through a decode-sized fp8 x fp8 GEMV, which can take it
    already quantized per row (Fp8Rows)."""
    return quant_gemv_ok(x) and x.dim() == 2 and has_fp8_units(x.device)


def fp8_takes_rows(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether fp8_linear takes x [M, K] (about to be made by a norm or activation kernel)
    quantized per row as Fp8Rows: for the decode-sized fp8 GEMV, or for torch._scaled_mm
    above (one scale per row, as quantize_rows_fp8 would make them)."""
    return x.dim() == 2 and (fp8_gemv_takes_rows(x) or scaled_mm_ok(x.device, x.dtype, w))


def quantize_static_fp8(x: torch.Tensor, x_scale: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scale [M, 1]) with one stored scale x_scale [1] for
    every row: x / x_scale, saturated at +-448."""
    xq = (x.float() / x_scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return xq, x_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()


def fp8_linear(x: torch.Tensor | Fp8Rows, w: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None = None, rows_first: bool = False,
               x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype. Decode-sized batches run the fp8 x fp8 GEMV, x
    quantized in the kernel per row and K tile, or (`rows_first`) per row by a launch of its
    own first. x may come quantized per row already (Fp8Rows [M, K], from a producer that
    fp8_takes_rows allowed: per row and block up to MAX_ROWS rows, per row above). With
    `x_scale` [1], x is quantized with that static scale."""
    if isinstance(x, Fp8Rows):
        if x.q.shape[0] <= MAX_ROWS:
            return fp8_gemv_a8(x.q, x.scale, w, w_scale, bias, x.dtype, x_scale_block=x.block)
        assert not x.block, "more than MAX_ROWS rows come with one scale per row"
        return _rows_product(x.q, x.scale, w, w_scale, bias, x.dtype)
    lead = x.shape[:-1]
    gemv = quant_gemv_ok(x) and has_fp8_units(x.device)
    if gemv and x_scale is None:
        if rows_first:
            xq, x_scale = quantize_rows_fp8(x.reshape(-1, x.shape[-1]))
            return fp8_gemv_a8(xq, x_scale, w, w_scale, bias, x.dtype).reshape(*lead, -1)
        return fp8_gemv_a8(x, None, w, w_scale, bias, x.dtype)
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    if x_scale is None:
        xq, x_scale = quantize_rows_fp8(x2)  # dynamic per-token scales
    else:
        xq, x_scale = quantize_static_fp8(x2, x_scale)
        if gemv:
            return fp8_gemv_a8(xq, x_scale, w, w_scale, bias, x.dtype).reshape(*lead, -1)
    y = _rows_product(xq, x_scale, w, w_scale, bias, x.dtype)
    return y.reshape(*lead, -1)


def _rows_product(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor,
                  w_scale: torch.Tensor, bias: torch.Tensor | None,
                  dtype: torch.dtype) -> torch.Tensor:
    """e4m3 xq [M, K] with float32 scales x_scale [M, 1] times e4m3 w [N, K] with w_scale [N]
    -> [M, N] in `dtype`: torch._scaled_mm where it runs, else the float32 emulation."""
    if scaled_mm_ok(xq.device, dtype, w):
        # Row-wise scales: x_scale [M, 1], w_scale [1, N]; w.t() is column-major as required.
        y = torch._scaled_mm(xq, w.t(), scale_a=x_scale, scale_b=w_scale.unsqueeze(0),
                             out_dtype=dtype)
    else:
        y = F.linear(xq.float() * x_scale, w.float() * w_scale.unsqueeze(-1)).to(dtype)
    if bias is not None:
        y = y + bias
    return y
