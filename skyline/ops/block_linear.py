"""Linear layers over block-scaled weights on CUDA (NVFP4, MXFP4, GGUF Q6_K / Q5_K, as
gemv_block.py reads them): F.linear's contract at any batch.

- Up to LINEAR_ROWS rows (FP4 16, GGUF 8): gemv_block's GEMV, the stored bits read once.
- Past them the scratch path: `nvfp4_dequantize` / `mxfp4_dequantize` / `gguf_dequantize`
  write up to SCRATCH_BYTES of whole rows of float weights at a time into one scratch buffer per
  device and dtype, reused by every layer, and each chunk is one matmul: no allocation the size
  of a weight per call, 32 MiB of memory in all.

The limits are measured (H200, bench/kernels/gemv_fp4_gguf_speed.py --rows 16 32 64): the FP4
GEMV's tensor-core tiles won 1.05-1.5x over the scratch path at 16 rows and lost at 64; GGUF's
lost past 8. The dequantizers' references are ops/fp4.py's and ops/dequant.py's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from skyline.ops import gemv_block_triton as kernels
from skyline.ops.gemv import MAX_ROWS, _cdiv
from skyline.ops.gemv_block import (
    GGUF_FORMATS,
    MXFP4,
    NVFP4,
    Q5_K,
    Q6_K,
    SUPER,
    block_gemv_ok,
    check_mxfp4,
    gguf_format,
    gguf_gemv,
    mxfp4_gemv,
    nvfp4_gemv,
)
from skyline.ops.triton_utils import triton

LINEAR_ROWS = {NVFP4: 16, MXFP4: 16, Q6_K: MAX_ROWS, Q5_K: MAX_ROWS}


def nvfp4_dequantize(qweight: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor,
                     out: torch.Tensor) -> torch.Tensor:
    """NVFP4 weights into out [N, K] (any float dtype, unit stride along K): dequantize_nvfp4's
    values (rounded to out's dtype)."""
    return _dequantize(NVFP4, qweight.contiguous(), qweight, scales.contiguous(),
                       tensor_scale.reshape(-1).float().contiguous(), out)


def mxfp4_dequantize(qweight: torch.Tensor, scales: torch.Tensor, out: torch.Tensor
                     ) -> torch.Tensor:
    """MXFP4 weights into out [N, K] (any float dtype, unit stride along K): dequantize_mxfp4's
    values (rounded to out's dtype; an E8M0 scale of 0 reads 0, not 2^-127)."""
    check_mxfp4(qweight, scales, out.shape[1], "mxfp4_dequantize")
    scales = scales.contiguous()
    return _dequantize(MXFP4, qweight.contiguous(), qweight, scales, scales, out)


def gguf_dequantize(data: torch.Tensor, qtype: int, out: torch.Tensor) -> torch.Tensor:
    """A Q6_K / Q5_K tensor's raw blocks into out [N, K] (unit stride along K): dequantize_ref's
    values (rounded to out's dtype)."""
    fmt = gguf_format(data, qtype, out.shape[1])
    data = data.contiguous()
    return _dequantize(fmt, data, data.view(torch.float16), data, data, out)


def _dequantize(fmt: int, w: torch.Tensor, h: torch.Tensor, scales: torch.Tensor,
                tensor_scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    if triton is None:
        raise RuntimeError("the block dequantizer needs triton; use the references")
    n, k = out.shape
    if out.stride(1) != 1 or w.shape[0] != n:
        raise ValueError(f"block dequantize: out {tuple(out.shape)} against {w.shape[0]} rows")
    block_n = 16
    kernels.dequant_block_kernel[(_cdiv(n, block_n), _cdiv(k, SUPER))](
        w, h, scales, tensor_scale, out, n, k, w.stride(0), scales.stride(0), out.stride(0),
        FORMAT=fmt, BLOCK_N=block_n, BLOCK_K=SUPER, num_warps=4,
    )
    return out


# Larger batches dequantize at most this many bytes of weights at a time (whole rows) into the
# scratch buffer, then multiply: the buffer stays small (and may still sit in L2 when the matmul
# reads it) however large the layer (an LM head of 128k rows would take 1 GB in bf16).
SCRATCH_BYTES = 32 << 20
_SCRATCH: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def scratch_weight(n: int, k: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A [n, k] buffer of `dtype` shared by every layer on `device` (one stream runs them one
    after another), grown to the largest request. Grown only outside a CUDA-graph capture: a
    capture that asks for more than the eager runs did gets a buffer of its own."""
    key = (device, dtype)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < n * k:
        fresh = torch.empty(n * k, dtype=dtype, device=device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return fresh.view(n, k)
        buf = _SCRATCH[key] = fresh
    return buf[: n * k].view(n, k)


def chunked_linear(x: torch.Tensor, n: int, bias: torch.Tensor | None,
                    dequantize: Callable[[int, int, torch.Tensor], torch.Tensor],
                    chunk_bytes: int) -> torch.Tensor:
    """F.linear over a weight [n, K] that `dequantize(start, stop, out)` writes row by row into
    out [stop - start, K]: chunks of whole rows of at most chunk_bytes in x's dtype (and at
    least 16 rows), each through the scratch buffer and one matmul."""
    k = x.shape[-1]
    step = max(16, chunk_bytes // max(1, k * x.element_size()) // 16 * 16)
    if step >= n:
        w = dequantize(0, n, scratch_weight(n, k, x.dtype, x.device))
        return F.linear(x, w, bias)
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    for start in range(0, n, step):
        stop = min(n, start + step)
        w = dequantize(start, stop, scratch_weight(stop - start, k, x.dtype, x.device))
        y[..., start:stop] = F.linear(x, w, None if bias is None else bias[start:stop])
    return y


def nvfp4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 tensor_scale: torch.Tensor, bias: torch.Tensor | None = None,
                 chunk_bytes: int = SCRATCH_BYTES) -> torch.Tensor:
    """F.linear's contract over NVFP4 weights on CUDA: block_gemv up to LINEAR_ROWS rows,
    else the weights dequantized chunk by chunk into the scratch buffer, each chunk one
    matmul."""
    if block_gemv_ok(x, LINEAR_ROWS[NVFP4]):
        return nvfp4_gemv(x, qweight, scales, tensor_scale, bias)
    ts = tensor_scale.reshape(-1)

    def dequantize(start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        return nvfp4_dequantize(qweight[start:stop], scales[start:stop], ts[start:stop], out)

    return chunked_linear(x, qweight.shape[0], bias, dequantize, chunk_bytes)


def mxfp4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None, chunk_bytes: int = SCRATCH_BYTES
                 ) -> torch.Tensor:
    """F.linear's contract over MXFP4 weights on CUDA, as nvfp4_linear."""
    if block_gemv_ok(x, LINEAR_ROWS[MXFP4]):
        return mxfp4_gemv(x, qweight, scales, bias)

    def dequantize(start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        return mxfp4_dequantize(qweight[start:stop], scales[start:stop], out)

    return chunked_linear(x, qweight.shape[0], bias, dequantize, chunk_bytes)


def gguf_linear(x: torch.Tensor, data: torch.Tensor, qtype: int,
                bias: torch.Tensor | None = None, chunk_bytes: int = SCRATCH_BYTES
                ) -> torch.Tensor:
    """F.linear's contract over Q6_K / Q5_K raw blocks on CUDA, as nvfp4_linear."""
    if block_gemv_ok(x, LINEAR_ROWS[GGUF_FORMATS.get(int(qtype), Q6_K)]):
        return gguf_gemv(x, data, qtype, bias)

    def dequantize(start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        return gguf_dequantize(data[start:stop], qtype, out)

    return chunked_linear(x, data.shape[0], bias, dequantize, chunk_bytes)
