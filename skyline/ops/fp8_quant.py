"""Per-token FP8 (e4m3) quantization of activations for W8A8 Linears: the PyTorch reference
and, on CUDA, one Triton kernel.

Each row x [K] becomes q = round(x / s) in e4m3 with s = amax(|x|) / 448 (1 for a zero row), so
the row's largest value lands on +-448. The reference takes ~8 kernels and three float32 copies
of x; before every fp8 product of a prefill chunk or a large decode batch that traffic cost
more than the halved weight bytes saved. The kernel reads x twice (amax, then quantize; the
second pass mostly from L2) and writes one byte per element plus the scale, rounding exactly
as the reference does (IEEE division, round to nearest even).
"""

from __future__ import annotations

import torch

from skyline.ops.pdl import pdl_wait, use_pdl

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_rows_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] -> (e4m3 [R, K], float32 scale [R, 1]) with x ~ q * scale, |q| <= 448."""
    amax = x.float().abs().amax(-1, keepdim=True)
    # A tensor divisor: CUDA turns division by a Python scalar into a product with its
    # reciprocal, which rounds differently from the CPU's (and the kernel's) IEEE division.
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows_fp8_ref's contract; one Triton launch for a CUDA x [R, K]."""
    if (triton is None or not x.is_cuda or x.dim() != 2 or x.shape[0] == 0
            or x.shape[1] == 0 or x.stride(-1) != 1):
        return quantize_rows_fp8_ref(x)
    return quantize_rows_fp8_triton(x)


def fake_quantize_rows_fp8(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> float32 [..., K]: each row quantized to e4m3 (quantize_rows_fp8) and
    scaled back, the activations a W8A8 product multiplies."""
    xq, scale = quantize_rows_fp8(x.reshape(-1, x.shape[-1]))
    return (xq.float() * scale).reshape(x.shape)


BLOCK = 1024  # elements of a row per loop iteration


def quantize_rows_fp8_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel behind quantize_rows_fp8 (any device Triton runs on): one program
    per row. x [R, K], unit stride along K."""
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    block = min(BLOCK, triton.next_power_of_2(k))
    pdl = use_pdl(x.device)
    _quantize_rows_kernel[(rows,)](x, q, scale, k, x.stride(0), q.stride(0),
                                   BLOCK=block, ITERS=triton.cdiv(k, block), FP8_MAX=FP8_MAX,
                                   PDL=pdl, num_warps=4 if block >= 512 else 1, launch_pdl=pdl)
    return q, scale


try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference serves
    triton = None

if triton is not None:

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q,
                              BLOCK: tl.constexpr, ITERS: tl.constexpr,
                              FP8_MAX: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        x_row = x_ptr + row * stride_x
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for i in range(ITERS):
            cols = i * BLOCK + offs
            x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        m = tl.max(amax, axis=0)
        scale = tl.where(m > 0, tl.math.div_rn(m, FP8_MAX), 1.0)
        tl.store(scale_ptr + row, scale)
        q_row = q_ptr + row * stride_q
        for i in range(ITERS):
            cols = i * BLOCK + offs
            mask = cols < K
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
            tl.store(q_row + cols, y.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
                     mask=mask)
