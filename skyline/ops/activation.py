"""SiLU-and-mul, the SwiGLU gate, and gpt-oss's clamped SwiGLU (the MoE's grouped path): PyTorch
references and Triton kernels (CUDA). With
`quant="fp8"` the result comes quantized for a W8A8 Linear (ops/fp8_quant.py's Fp8Rows): for
the decode-sized batches of the fp8 GEMV with one scale per row and FP8_BLOCK columns, so the
programs of a row stay independent; for larger ones with one scale per row, as
`torch._scaled_mm` takes them, one program per row holding it whole; with
`quant="int8"` rounded for the W4A8 GEMV (ops/gemv_int_a8.py's Int8Chunks, 32 columns a scale),
each program rounding the values it writes in the model dtype."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from skyline import envs
from skyline.ops.fp8_quant import (
    FP8,
    FP8_MAX,
    WHOLE_ROW,
    Fp8Rows,
    fp8_rows_ref,
    quantize_rows_fp8_triton,
    software_rounding,
)
from skyline.ops.gemv import MAX_ROWS
from skyline.ops.gemv_int_a8 import CHUNK, INT8_MAX, Int8Chunks, int8_chunks_ref
from skyline.ops.pdl import pdl_wait, use_pdl
from skyline.ops.triton_utils import tl, triton
from skyline.ops.tuning import dtype_name, get_config, token_bucket


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] (gate then up) -> silu(gate) * up [..., d]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


SWIGLU_ALPHA = 1.702  # gpt-oss's sigmoid sharpness


def swiglu_oai_ref(x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """[..., 2 * d] (gate then up) -> [..., d], gpt-oss's: gate clamped above and up on both
    sides at `limit`, then gate * sigmoid(1.702 gate) * (up + 1), each op rounded to x's
    dtype."""
    gate, up = x.chunk(2, dim=-1)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return gate * torch.sigmoid(gate * SWIGLU_ALPHA) * (up + 1)


def swiglu_oai(x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """swiglu_oai_ref's contract and roundings; on CUDA one Triton launch for x
    [num_tokens, 2 * d] where the reference takes seven, each reading and writing the whole
    [num_tokens, d] (SKYLINE_UNFUSE=silu: the reference)."""
    if not (x.is_cuda and triton is not None and x.dim() == 2 and x.stride(-1) == 1
            and x.shape[0] > 0 and x.shape[1] % 2 == 0) or "silu" in envs.ENV.unfuse:
        return swiglu_oai_ref(x, limit)
    return swiglu_oai_triton(x, limit)


def swiglu_oai_triton(x: torch.Tensor, limit: float | None = None,
                      block: int = 1024) -> torch.Tensor:
    """The Triton kernel behind swiglu_oai (any device Triton runs on): one program per
    (token, `block` columns)."""
    num_tokens, d = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, d, dtype=x.dtype, device=x.device)
    pdl = use_pdl(x.device)
    _swiglu_oai_kernel[(num_tokens, triton.cdiv(d, block))](
        x, out, d, x.stride(0), out.stride(0), LIMIT=float(limit or 0.0),
        HAS_LIMIT=limit is not None, ALPHA=SWIGLU_ALPHA, BLOCK=block, PDL=pdl, num_warps=4,
        launch_pdl=pdl,
    )
    return out


def silu_and_mul(x: torch.Tensor, config: dict[str, Any] | None = None,
                 quant: str | None = None) -> torch.Tensor | Fp8Rows | Int8Chunks:
    """silu_and_mul_ref's contract; on CUDA one Triton launch for x [num_tokens, 2 * d]. With
    `quant` the result comes quantized: "fp8" as Fp8Rows with one scale per row and FP8_BLOCK
    columns up to MAX_ROWS rows (fp8_block's), one per row above, "int8" as Int8Chunks (except
    under SKYLINE_UNFUSE=silu, which returns it plain)."""
    if not (x.is_cuda and triton is not None and x.dim() == 2 and x.stride(-1) == 1
            and x.shape[0] > 0 and x.shape[1] % 2 == 0):
        y = silu_and_mul_ref(x)
        if quant is None:
            return y
        return fp8_rows_ref(y, fp8_block(y.shape[0])) if quant == "fp8" else int8_chunks_ref(y)
    if "silu" in envs.ENV.unfuse:
        # the modular form (to measure the fusion): torch's SiLU, then its multiply; the
        # Linear this feeds quantizes the plain result itself
        return silu_and_mul_ref(x)
    if quant == "fp8":
        return silu_and_mul_fp8_triton(x)
    if quant == "int8":
        return silu_and_mul_int8_triton(x)
    return silu_and_mul_triton(x, config)


def silu_and_mul_triton(
    x: torch.Tensor,  # [num_tokens, 2 * d], last dim contiguous
    config: dict[str, Any] | None = None,  # None: tuned or DEFAULT_CONFIG
) -> torch.Tensor:  # [num_tokens, d]
    """The Triton kernel behind silu_and_mul (any device Triton runs on)."""
    num_tokens, d = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, d, dtype=x.dtype, device=x.device)
    if config is None:
        config = _config(d, x.dtype, token_bucket(num_tokens))
    block = config["BLOCK"]
    pdl = use_pdl(x.device)
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(d, block))](
        x, out, d, x.stride(0), out.stride(0), BLOCK=block, PDL=pdl,
        num_warps=config["num_warps"], launch_pdl=pdl,
    )
    return out


# Columns per activation scale of the fp8 result of a decode-sized batch: one program each (14
# per token for Llama-3 8B's 14,336); a multiple of every fp8 GEMV tile's BLOCK_K
# (fp8_gemv_a8's x_scale_block).
FP8_BLOCK = 1024


def fp8_block(num_tokens: int) -> int:
    """Columns per scale of the fp8 result of num_tokens rows: FP8_BLOCK for the fp8 GEMV's
    batches (at most MAX_ROWS rows), else 0 (one scale per row: torch._scaled_mm's)."""
    return FP8_BLOCK if num_tokens <= MAX_ROWS else 0


def silu_and_mul_fp8_triton(x: torch.Tensor) -> Fp8Rows:
    """silu_and_mul_triton's result quantized with one scale per row and fp8_block columns (the
    bytes quantize_rows_fp8_ref(result, block) makes of it), one program per block; rows
    wider than WHOLE_ROW with one scale per row take the plain kernel and a quantizing one."""
    num_tokens, d = x.shape[0], x.shape[1] // 2
    per_block = fp8_block(num_tokens)
    block = per_block or triton.next_power_of_2(d)
    if block > WHOLE_ROW:
        q, scale = quantize_rows_fp8_triton(silu_and_mul_triton(x))
        return Fp8Rows(q, scale, x.dtype)
    blocks = triton.cdiv(d, block)
    q = torch.empty(num_tokens, d, dtype=FP8, device=x.device)
    scale = torch.empty(num_tokens, blocks, dtype=torch.float32, device=x.device)
    pdl = use_pdl(x.device)
    _silu_and_mul_fp8_kernel[(num_tokens, blocks)](
        x, q, scale, d, x.stride(0), q.stride(0), BLOCK=block, FP8_MAX=FP8_MAX,
        ROUND_E4M3=software_rounding(), PDL=pdl, num_warps=max(4, min(16, block // 1024)),
        launch_pdl=pdl,
    )
    return Fp8Rows(q, scale, x.dtype, per_block)


def silu_and_mul_int8_triton(x: torch.Tensor) -> Int8Chunks:
    """silu_and_mul_triton's result rounded to Int8Chunks (int8_chunks_ref's values), one
    program per FP8_BLOCK columns (32 chunks)."""
    num_tokens, d = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, d, dtype=x.dtype, device=x.device)
    chunks = Int8Chunks.empty(num_tokens, d, x.dtype, x.device)
    pdl = use_pdl(x.device)
    _silu_and_mul_int8_kernel[(num_tokens, triton.cdiv(d, FP8_BLOCK))](
        x, out, chunks.words, chunks.floats, num_tokens, d, triton.cdiv(d, CHUNK), x.stride(0),
        out.stride(0), BLOCK=FP8_BLOCK, INT8_MAX=INT8_MAX, PDL=pdl, num_warps=4, launch_pdl=pdl,
    )
    return chunks


DEFAULT_CONFIG: dict[str, Any] = {"BLOCK": 1024, "num_warps": 4}


def config_key(d: int, dtype: torch.dtype, num_tokens: int) -> str:
    """Tuning-table key (kernel "silu_and_mul"): output width, dtype, tokens."""
    return f"d{d}:{dtype_name(dtype)}:t{token_bucket(num_tokens)}"


@functools.cache
def _config(d: int, dtype: torch.dtype, bucket: int) -> dict[str, Any]:
    return get_config("silu_and_mul", config_key(d, dtype, bucket), DEFAULT_CONFIG)



if triton is not None:
    from skyline.ops.fp8_quant import quantize_rows_in_registers
    from skyline.ops.gemv_int_a8_triton import round_row_to_words

    @triton.jit
    def _silu_and_mul_tile(x_row, cols, d, dtype: tl.constexpr):
        # silu(gate) * up over `cols` of one row, float32 (0 past d), rounded as the reference:
        # silu's result cast to the dtype before the multiply, the product cast again.
        mask = cols < d
        gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_row + d + cols, mask=mask, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        return (act * up).to(dtype).to(tl.float32)

    @triton.jit
    def _silu_and_mul_fp8_kernel(x_ptr, q_ptr, scale_ptr, d, stride_x, stride_q,
                                 BLOCK: tl.constexpr, FP8_MAX: tl.constexpr,
                                 ROUND_E4M3: tl.constexpr, PDL: tl.constexpr):
        # One program per (token, BLOCK columns), each with its own scale.
        pdl_wait(PDL)
        tok = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1)
        cols = blk * BLOCK + tl.arange(0, BLOCK)
        y = _silu_and_mul_tile(x_ptr + tok * stride_x, cols, d, x_ptr.dtype.element_ty)
        q, scale = quantize_rows_in_registers(y[None, :], FP8_MAX, ROUND_E4M3)
        tl.store(q_ptr + tok * stride_q + cols[None, :],
                 q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
                 mask=(cols < d)[None, :])
        tl.store(scale_ptr + tok * tl.num_programs(1) + blk + tl.arange(0, 1), scale)

    @triton.jit
    def _silu_and_mul_int8_kernel(x_ptr, out_ptr, words_ptr, floats_ptr, num_tokens, d, kc,
                                  stride_x, stride_o, BLOCK: tl.constexpr,
                                  INT8_MAX: tl.constexpr, PDL: tl.constexpr):
        # One program per (token, BLOCK columns): the result stored in the dtype and rounded,
        # BLOCK / 32 chunks (ops/gemv_int_a8_triton.round_row_to_words).
        pdl_wait(PDL)
        tok = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        o_row = out_ptr + tok.to(tl.int64) * stride_o
        y = _silu_and_mul_tile(x_ptr + tok.to(tl.int64) * stride_x, cols, d,
                               out_ptr.dtype.element_ty)
        tl.store(o_row + cols, y.to(out_ptr.dtype.element_ty), mask=cols < d)
        round_row_to_words(y, words_ptr, floats_ptr, tok, num_tokens, kc,
                           tl.program_id(1) * (BLOCK // 32), BLOCK // 32, INT8_MAX)

    @triton.jit
    def _swiglu_oai_kernel(x_ptr, out_ptr, d, stride_x, stride_o, LIMIT: tl.constexpr,
                           HAS_LIMIT: tl.constexpr, ALPHA: tl.constexpr, BLOCK: tl.constexpr,
                           PDL: tl.constexpr):
        # One program per (token, BLOCK columns); every op rounded to the dtype as the
        # reference's torch ops round them.
        pdl_wait(PDL)
        tok = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < d
        dtype = out_ptr.dtype.element_ty
        x_row = x_ptr + tok * stride_x
        gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_row + d + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_LIMIT:
            gate = tl.minimum(gate, LIMIT).to(dtype).to(tl.float32)
            up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT).to(dtype).to(tl.float32)
        z = (gate * ALPHA).to(dtype).to(tl.float32)
        sig = (1.0 / (1.0 + tl.exp(-z))).to(dtype).to(tl.float32)
        glu = (gate * sig).to(dtype).to(tl.float32)
        y = glu * (up + 1.0).to(dtype).to(tl.float32)
        tl.store(out_ptr + tok * stride_o + cols, y.to(dtype), mask=mask)

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_x, stride_o, BLOCK: tl.constexpr,
                             PDL: tl.constexpr):
        # One program per (token, BLOCK columns).
        pdl_wait(PDL)
        tok = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        y = _silu_and_mul_tile(x_ptr + tok * stride_x, cols, d, out_ptr.dtype.element_ty)
        tl.store(out_ptr + tok * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=cols < d)
