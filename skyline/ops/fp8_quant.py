"""Per-token FP8 (e4m3) quantization of activations for W8A8 Linears: the PyTorch reference
and, on CUDA, one Triton kernel.

Each row x [K] becomes q = round(x * (448 / amax(|x|))) in e4m3 with scale s = amax / 448 (both
1 for a zero row), so the row's largest value lands on +-448 and x ~ q * s. The reference takes
~8 kernels and three float32 copies of x; before every fp8 product of a prefill chunk or a large
decode batch that traffic cost more than the halved weight bytes saved. The kernel reads x twice
(amax, then quantize; the second pass mostly from L2) and writes one byte per element plus the
scale, rounding exactly as the reference does (IEEE division for s and 448 / amax, round to
nearest even).

W8A8 products take their activations already quantized from the kernel that makes them where
it can (RMSNorm per row; SiLU-and-mul per row and block of columns for the decode GEMV's
batches, per row above them) as `Fp8Rows`; `quantize_rows_in_registers` is those kernels'
share. The attention output before o_proj still takes this file's kernel.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from skyline.ops.pdl import pdl_wait, use_pdl
from skyline.ops.triton_utils import interpreted, tl, triton

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FLOAT_MAX = torch.finfo(torch.float32).max


def absmax_scales_ref(amax: torch.Tensor, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, multiplier) of rows or blocks with these amax values for a format whose largest
    value is qmax: amax / qmax and qmax / amax (at most FLOAT_MAX), both 1 where amax is 0."""
    # Tensor divisions: CUDA turns division by a Python scalar into a product with its
    # reciprocal, which rounds differently from the CPU's (and the kernels') IEEE division.
    full = torch.full_like(amax, qmax)
    pos = amax > 0
    scale = torch.where(pos, amax / full, torch.ones_like(amax))
    inv = torch.where(pos, full / torch.where(pos, amax, full), torch.ones_like(amax))
    return scale, inv.clamp(max=FLOAT_MAX)


def quantize_rows_fp8_ref(x: torch.Tensor, block: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] -> (e4m3 [R, K], float32 scale [R, 1]) with x ~ q * scale, |q| <= 448; with
    `block`, one scale per row and block of columns: scale [R, cdiv(K, block)]."""
    r, k = x.shape
    xf = F.pad(x.float(), (0, -k % block)).view(r, -1, block) if block else x.float()[:, None]
    scale, inv = absmax_scales_ref(xf.abs().amax(-1, keepdim=True), FP8_MAX)
    q = (xf * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    groups = xf.shape[1]
    return q.reshape(r, groups * xf.shape[2])[:, :k].contiguous(), scale.reshape(r, groups)


class Fp8Rows(NamedTuple):
    """Activations quantized for a W8A8 product: e4m3 values [R, K], float32 scales (x ~ q *
    scale, as quantize_rows_fp8_ref(x, block)): [R, 1], or with `block` one per row and block
    of columns [R, cdiv(K, block)]; the dtype the activations had, which the product returns.
    Made by the kernel that produces the activations when the Linear that consumes them asks
    for it (Linear.input_quant)."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype
    block: int = 0


def fp8_rows_ref(y: torch.Tensor, block: int = 0) -> Fp8Rows:
    """y [R, K] quantized by the reference: what a producing kernel's Fp8Rows hold."""
    q, scale = quantize_rows_fp8_ref(y, block)
    return Fp8Rows(q, scale, y.dtype, block)


def software_rounding() -> bool:
    """Whether kernels round to e4m3 in float arithmetic before converting: in Triton's
    interpreter, whose conversion carries a rounding into the exponent wrongly (7.77 -> 4)."""
    return interpreted()


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


# Rows up to this wide are read once and quantized from registers (32 elements a thread); wider
# ones are read twice in BLOCK-element steps (amax, then quantize; the second read mostly from
# L2). At a few hundred rows the two passes' serial loads, not bandwidth, set the kernel's time.
WHOLE_ROW = 16384
BLOCK = 1024  # elements of a wider row per loop iteration


def quantize_rows_fp8_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel behind quantize_rows_fp8 (any device Triton runs on): one program
    per row. x [R, K], unit stride along K."""
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    whole = triton.next_power_of_2(k)
    block = whole if whole <= WHOLE_ROW else BLOCK
    pdl = use_pdl(x.device)
    _quantize_rows_kernel[(rows,)](x, q, scale, k, x.stride(0), q.stride(0),
                                   BLOCK=block, ITERS=triton.cdiv(k, block), FP8_MAX=FP8_MAX,
                                   ROUND=software_rounding(), PDL=pdl,
                                   num_warps=max(1, min(16, block // 1024)), launch_pdl=pdl)
    return q, scale


if triton is not None:

    @triton.jit
    def round_e4m3(v):
        # v (float32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, in float32
        # arithmetic: adding and subtracting 1.5 * 2^23 * step rounds to a multiple of step,
        # the spacing of e4m3 values at v's exponent (2^(e - 3); 2^-9 below the normal
        # range). The e4m3 conversion that follows is then exact, whatever its own rounding.
        a = tl.abs(v)
        e = (a.to(tl.int32, bitcast=True) >> 23) & 0xFF
        step_e = tl.maximum(e - 3, 127 - 9)
        c = ((step_e + 23) << 23 | 0x400000).to(tl.float32, bitcast=True)
        r = (a + c) - c
        return tl.where(v < 0, -r, r)

    @triton.jit
    def absmax_scales(amax, QMAX: tl.constexpr):
        # absmax_scales_ref's (scale, multiplier): amax / QMAX and QMAX / amax (IEEE divisions,
        # the multiplier at most FLOAT_MAX), both 1 for a zero row or block
        pos = amax > 0
        safe = tl.where(pos, amax, QMAX)
        scale = tl.where(pos, tl.math.div_rn(safe, QMAX), 1.0)
        inv = tl.math.div_rn(tl.zeros_like(safe) + QMAX, safe)
        return scale, tl.where(pos, tl.minimum(inv, 3.4028234663852886e38), 1.0)

    @triton.jit
    def e4m3_values(y, inv, FP8_MAX: tl.constexpr, ROUND: tl.constexpr):
        # y * inv clamped to +-448, to be stored as e4m3 with rtne; ROUND rounds it to e4m3
        # first (software_rounding)
        v = tl.minimum(tl.maximum(y * inv, -FP8_MAX), FP8_MAX)
        if ROUND:
            v = round_e4m3(v)
        return v

    @triton.jit
    def quantize_rows_in_registers(y, FP8_MAX: tl.constexpr, ROUND: tl.constexpr):
        # y [BLOCK_M, BLOCK_N] float32, each row whole (masked columns 0) -> (e4m3_values,
        # scale [BLOCK_M])
        scale, inv = absmax_scales(tl.max(tl.abs(y), axis=1), FP8_MAX)
        return e4m3_values(y, inv[:, None], FP8_MAX, ROUND), scale

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q,
                              BLOCK: tl.constexpr, ITERS: tl.constexpr,
                              FP8_MAX: tl.constexpr, ROUND: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        x_row = x_ptr + row * stride_x
        q_row = q_ptr + row * stride_q
        if ITERS == 1:  # the whole row in registers: one read
            mask = offs < K
            x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            scale, inv = absmax_scales(tl.max(tl.abs(x), axis=0), FP8_MAX)
            tl.store(scale_ptr + row, scale)
            y = e4m3_values(x, inv, FP8_MAX, ROUND)
            tl.store(q_row + offs, y.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
                     mask=mask)
            return
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for i in range(ITERS):
            cols = i * BLOCK + offs
            x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale, inv = absmax_scales(tl.max(amax, axis=0), FP8_MAX)
        tl.store(scale_ptr + row, scale)
        for i in range(ITERS):
            cols = i * BLOCK + offs
            mask = cols < K
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            y = e4m3_values(x, inv, FP8_MAX, ROUND)
            tl.store(q_row + cols, y.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
                     mask=mask)
