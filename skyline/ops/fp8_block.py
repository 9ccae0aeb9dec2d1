"""FP8 W8A8 with block-scaled weights (DeepSeek-V3's layout, compressed-tensors' FP8_BLOCK):
e4m3 weight [N, K] with one float32 scale per row and 128 columns, w_scale [N, cdiv(K, 128)]
(a checkpoint's 128 x 128 blocks repeated per row, so the shards of a merged projection need
not start on a block), activations quantized per token and 128 columns:

    y[m, n] = sum_b x_scale[m, b] * w_scale[n, b] * sum_{k in block b} xq[m, k] * wq[n, k]

- `fp8_block_linear_ref`: the reference, both sides dequantized and one float32 matmul (the
  CPU's path: its values, accumulated in another order).
- CUDA: `torch.nn.functional.scaled_mm` with 1x128 block scales on both sides (cuBLAS, where
  this PyTorch and GPU take them: K a multiple of 128, checked once per device against the
  reference), else `fp8_block_matmul_triton`, one tensor-core dot per 128-column block scaled
  in the accumulator.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from skyline.ops.fp8_quant import quantize_rows_fp8_ref
from skyline.ops.triton_utils import interpreted, tl, triton

log = logging.getLogger(__name__)

BLOCK = 128  # columns per scale, on both sides


def fp8_block_linear_ref(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype; w e4m3 [N, K], w_scale float32 [N, cdiv(K, 128)]."""
    k = x.shape[-1]
    xq, x_scale = quantize_rows_fp8_ref(x.reshape(-1, k), BLOCK)
    xd = xq.float() * x_scale.repeat_interleave(BLOCK, dim=1)[:, :k]
    y = F.linear(xd, dequantize_fp8_blocks(w, w_scale))
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], -1)


def dequantize_fp8_blocks(w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] weight of e4m3 w [N, K] with scales [N, cdiv(K, 128)]."""
    return w.float() * w_scale.float().repeat_interleave(BLOCK, dim=1)[:, : w.shape[1]]


def fp8_block_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp8_block_linear_ref's contract on whatever the device offers (module docstring)."""
    if not x.is_cuda or triton is None:
        return fp8_block_linear_ref(x, w, w_scale, bias)
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    xq, x_scale = quantize_rows_fp8_ref(x2, BLOCK)
    if (x2.shape[0] >= CUBLAS_MIN_ROWS and k % BLOCK == 0 and x.dtype == torch.bfloat16
            and _cublas_blocks_ok(x.device)):
        y = _cublas_block_mm(xq, x_scale, w, w_scale, x.dtype)
    else:
        y = fp8_block_matmul_triton(xq, x_scale, w, w_scale, x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], -1)


# cuBLAS refuses block scales for a single row (CUBLAS_STATUS_NOT_SUPPORTED, H200, torch 2.11);
# _cublas_blocks_ok checks 32 rows, and few rows are a GEMV the Triton kernel serves well.
CUBLAS_MIN_ROWS = 32


def _cublas_block_mm(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor,
                     w_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # cuBLAS takes both scale tensors outer-dim major: stride 1 along M (or N), and stride M
    # (or N) along K, also where M is 1 (where .t().contiguous().t() would keep stride K)
    recipe = F.ScalingType.BlockWise1x128
    return F.scaled_mm(xq, w.t(), _outer_major(x_scale), recipe,
                       _outer_major(w_scale.float()), recipe, output_dtype=dtype)


def _outer_major(scale: torch.Tensor) -> torch.Tensor:
    """`scale` [rows, blocks] copied with strides (1, rows)."""
    rows, blocks = scale.shape
    out = torch.empty_strided((rows, blocks), (1, rows), dtype=scale.dtype, device=scale.device)
    return out.copy_(scale)


@functools.lru_cache(maxsize=8)
def _cublas_blocks_ok(device: torch.device) -> bool:
    """Whether this PyTorch runs 1x128 x 1x128 block-scaled fp8 products on `device`, and
    agrees with the reference there (once per device, at the first product: before any CUDA
    graph is captured, as the runner warms up eagerly)."""
    if not hasattr(F, "scaled_mm") or torch.cuda.get_device_capability(device) < (9, 0):
        return False
    gen = torch.Generator(device).manual_seed(0)
    x = torch.randn(32, 256, device=device, generator=gen).bfloat16()
    w = (torch.randn(256, 256, device=device, generator=gen) * 64).to(torch.float8_e4m3fn)
    w_scale = torch.rand(256, 2, device=device, generator=gen) / 64
    xq, x_scale = quantize_rows_fp8_ref(x, BLOCK)
    try:
        got = _cublas_block_mm(xq, x_scale, w, w_scale, torch.bfloat16).float()
    except (RuntimeError, TypeError, ValueError, AttributeError) as e:
        log.info("fp8 block scales run on the Triton kernel: torch's scaled_mm refused (%s)", e)
        return False
    want = fp8_block_linear_ref(x, w, w_scale).float()
    ok = bool(((got - want).norm() / want.norm()) < 1e-2)
    if not ok:
        log.warning("torch's block-scaled scaled_mm disagrees with the reference; fp8 block "
                    "scales run on the Triton kernel")
    return ok


if triton is not None:

    @triton.jit
    def _fp8_block_kernel(
        x_ptr, sx_ptr, w_ptr, sw_ptr, y_ptr, M, N, K,
        stride_xm, stride_sxm, stride_wn, stride_swn, stride_ym,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        FP8_DOT: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        n_mask = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k0 = 0
        b = 0
        while k0 < K:  # a while loop: the interpreter cannot run range() to a runtime bound
            k = k0 + offs_k
            k_mask = k < K
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK] e4m3
            w = tl.load(w_ptr + offs_n[None, :] * stride_wn + k[:, None],
                        mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BK, BN] e4m3
            sx = tl.load(sx_ptr + offs_m * stride_sxm + b, mask=m_mask, other=0.0)
            sw = tl.load(sw_ptr + offs_n * stride_swn + b, mask=n_mask, other=0.0)
            if FP8_DOT:  # e4m3 x e4m3 on the tensor cores, float32 accumulation
                part = tl.dot(x, w)
            else:  # the interpreter: the same products in float32
                part = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            acc += part * sx[:, None] * sw[None, :]
            k0 += BLOCK_K
            b += 1
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def fp8_block_matmul_triton(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor,
                            w_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """e4m3 xq [M, K] with float32 x_scale [M, cdiv(K, 128)] times w [N, K]^T with w_scale
    [N, cdiv(K, 128)] -> [M, N] in out_dtype. Block sizes are untuned."""
    m, k = xq.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    w_scale = w_scale.float()
    block_m = 16 if m <= 16 else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, 64))
    _fp8_block_kernel[grid](
        xq, x_scale, w, w_scale, y, m, n, k,
        xq.stride(0), x_scale.stride(0), w.stride(0), w_scale.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=BLOCK, FP8_DOT=not interpreted(),
    )
    return y
