"""RMSNorm, plain and fused with the residual add before it: PyTorch references and one Triton
kernel for both (CUDA), which also norms each head of q/k (rows = tokens x heads, strided).

Numerics follow HF Llama: the add stays in the model dtype, the normalization runs in float32,
its result is cast back to the model dtype, and only then multiplied by the weight.

With `quant="fp8"` the normed rows come out quantized for a W8A8 Linear (ops/fp8_quant.py's
Fp8Rows: e4m3 with one scale per row, the bytes quantize_rows_fp8 makes of the unquantized
result), which saves the fp8 GEMV quantizing them itself; with `quant="int8"` rounded for the
W4A8 GEMV (ops/gemv_int_a8.py's Int8Chunks, from the rows in the model dtype, which the same
program writes first), which saves its rounding launch.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from skyline import envs
from skyline.ops.fp8_quant import FP8, FP8_MAX, Fp8Rows, fp8_rows_ref, software_rounding
from skyline.ops.gemv_int_a8 import CHUNK, INT8_MAX, Int8Chunks, int8_chunks_ref
from skyline.ops.pdl import pdl_wait, use_pdl
from skyline.ops.triton_utils import tl, triton
from skyline.ops.tuning import dtype_name, get_config, token_bucket


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d] -> weight * x / sqrt(mean(x^2) + eps), as a new tensor."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor,  # [num_tokens, d]
    residual: torch.Tensor,  # [num_tokens, d]
    weight: torch.Tensor,  # [d]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), as new tensors."""
    # The add stays in the model dtype, as HF's `residual + hidden_states` does.
    x = x + residual
    return rms_norm_ref(x, weight, eps), x


# CPU forwards of at most this many rows take rms_norm_cpu: a decode step is bound by the
# operations Python dispatches, and the trick below doubles the bytes it reads.
CPU_FEW_ROWS = 64


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm_ref's contract in three operations instead of seven: LayerNorm (one fused CPU
    kernel) of [x, -x] has mean 0 and variance mean(x^2), so its first half is x / sqrt(mean(x^2)
    + eps), computed in float32 and rounded to x's dtype once, as the reference; the weight
    multiplies that rounded result, as the reference's."""
    d = x.shape[-1]
    normed = F.layer_norm(torch.cat((x, -x), -1), (2 * d,), eps=eps)
    return normed[..., :d] * weight


def quantized_ref(y: torch.Tensor, quant: str | None) -> torch.Tensor | Fp8Rows | Int8Chunks:
    """y as a producing kernel hands it to a Linear that asked for `quant` (None: as it is)."""
    if quant is None:
        return y
    return fp8_rows_ref(y) if quant == "fp8" else int8_chunks_ref(y)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             config: dict[str, Any] | None = None, quant: str | None = None
             ) -> torch.Tensor | Fp8Rows | Int8Chunks:
    """rms_norm_ref's contract; on CUDA one Triton launch. x may be a strided view [T, d] or
    [T, heads, d] (e.g. the q part of a qkv projection): each row of d is normed. With `quant`
    (x [T, d], weight in x's dtype) the result comes quantized: "fp8" per row, as Fp8Rows;
    "int8" per 32 columns, as Int8Chunks."""
    if quant is not None:
        if _use_triton(x) and x.dim() == 2 and weight.dtype == x.dtype:
            return rms_norm_triton(x, weight, eps, config, quant=quant)
        return quantized_ref(rms_norm_ref(x, weight, eps), quant)
    if not _use_triton(x) or x.dim() not in (2, 3):
        if _few_cpu_rows(x):
            return rms_norm_cpu(x, weight, eps)
        return rms_norm_ref(x, weight, eps)
    return rms_norm_triton(x, weight, eps, config)


def fused_add_rms_norm(
    x: torch.Tensor,  # [num_tokens, d]
    residual: torch.Tensor,  # [num_tokens, d]
    weight: torch.Tensor,  # [d]
    eps: float,
    config: dict[str, Any] | None = None,
    quant: str | None = None,
) -> tuple[torch.Tensor | Fp8Rows | Int8Chunks, torch.Tensor]:
    """fused_add_rms_norm_ref's contract. Both inputs are consumed: on CUDA one Triton launch
    writes x + residual over `residual` and the normed sum over `x`, and returns them. With
    `quant` the normed sum comes quantized, as rms_norm's (with "fp8" x is left unwritten)."""
    if quant is None and _few_cpu_rows(x):  # (checked first: a CPU decode step is bound by
        # what Python dispatches)
        residual = x + residual  # the add stays in the model dtype, as the reference's
        return rms_norm_cpu(residual, weight, eps), residual
    same = (x.shape == residual.shape and x.dtype == residual.dtype == weight.dtype
            and residual.stride(-1) == 1)
    if not (_use_triton(x) and same and x.dim() == 2):
        normed, residual = fused_add_rms_norm_ref(x, residual, weight, eps)
        return quantized_ref(normed, quant), residual
    if "norm" in envs.ENV.unfuse:
        return fused_add_rms_norm_unfused(x, residual, weight, eps, quant)
    return fused_add_rms_norm_triton(x, residual, weight, eps, config, quant)


def fused_add_rms_norm_unfused(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    quant: str | None = None,
) -> tuple[torch.Tensor | Fp8Rows | Int8Chunks, torch.Tensor]:
    """The modular form of fused_add_rms_norm_triton (SKYLINE_UNFUSE=norm, to measure the
    fusion): torch's add, then the plain RMSNorm kernel (quantizing as asked); two launches,
    new tensors. The add rounds to the model dtype once, as the fused kernel's."""
    residual = x + residual
    return rms_norm_triton(residual, weight, eps, quant=quant), residual


def _few_cpu_rows(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dim() == 2 and x.shape[0] <= CPU_FEW_ROWS


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and triton is not None and x.stride(-1) == 1 and x.numel() > 0


def rms_norm_triton(
    x: torch.Tensor,  # [T, d] or [T, heads, d], last dim contiguous
    weight: torch.Tensor,  # [d]
    eps: float,
    config: dict[str, Any] | None = None,  # None: tuned or default_config
    quant: str | None = None,  # x [T, d] and weight of one dtype: "fp8" / "int8"
) -> torch.Tensor | Fp8Rows | Int8Chunks:  # contiguous, x's shape
    """The Triton kernel behind rms_norm (any device Triton runs on)."""
    if quant == "fp8":
        return _launch_fp8(x, None, weight, eps, config)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if quant == "int8":
        return _launch_int8(x, None, weight, out, eps, config)
    _launch(x, None, weight, out, eps, config)
    return out


def fused_add_rms_norm_triton(
    x: torch.Tensor,  # [T, d], last dim contiguous
    residual: torch.Tensor,  # [T, d], last dim contiguous, x's dtype
    weight: torch.Tensor,  # [d], x's dtype
    eps: float,
    config: dict[str, Any] | None = None,
    quant: str | None = None,
) -> tuple[torch.Tensor | Fp8Rows | Int8Chunks, torch.Tensor]:
    """The Triton kernel behind fused_add_rms_norm: writes x + residual over residual and the
    normed sum over x (with `quant` "fp8", returns it as Fp8Rows and leaves x unwritten; with
    "int8", also rounds it to Int8Chunks, which it returns); returns (x, residual)."""
    if quant == "fp8":
        return _launch_fp8(x, residual, weight, eps, config), residual
    if quant == "int8":
        return _launch_int8(x, residual, weight, x, eps, config), residual
    _launch(x, residual, weight, x, eps, config)
    return x, residual


def default_config(d: int, num_rows: int) -> dict[str, Any]:
    """Heuristic launch configuration when no tuned one is stored: one row of d per program
    (several short rows per program when there are many), warps by row length."""
    block_n = 1 << (d - 1).bit_length()  # the next power of two
    block_m = 1 if block_n >= 1024 or num_rows < 4096 else max(1, 2048 // block_n)
    return {"BLOCK_M": block_m, "num_warps": max(1, min(16, block_m * block_n // 512))}


def config_key(d: int, dtype: torch.dtype, num_rows: int) -> str:
    """Tuning-table key (kernels "rms_norm", "fused_add_rms_norm"): row length, dtype, rows."""
    return f"d{d}:{dtype_name(dtype)}:t{token_bucket(num_rows)}"


@functools.cache
def _config(kernel: str, d: int, dtype: torch.dtype, bucket: int) -> dict[str, Any]:
    return get_config(kernel, config_key(d, dtype, bucket), default_config(d, bucket))


def _launch_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float, config: dict[str, Any] | None) -> Fp8Rows:
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    scale = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    _launch(x, residual, weight, q, eps, config, scale)
    return Fp8Rows(q, scale, x.dtype)


def _launch_int8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 out: torch.Tensor, eps: float, config: dict[str, Any] | None) -> Int8Chunks:
    t, d = x.shape
    chunks = Int8Chunks.empty(t, d, out.dtype, x.device)
    config = config or _config("rms_norm" if residual is None else "fused_add_rms_norm", d,
                               x.dtype, token_bucket(t))
    _launch(x, residual, weight, out, eps, {**config, "BLOCK_M": 1}, int8=chunks)
    return chunks


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            out: torch.Tensor, eps: float, config: dict[str, Any] | None,
            scale: torch.Tensor | None = None,
            int8: Int8Chunks | None = None) -> None:
    # x/out [T, d] or [T, H, d], residual [T, d]: rows are (token, head) pairs
    x3, out3 = (x, out) if x.dim() == 3 else (x.unsqueeze(1), out.unsqueeze(1))
    num_tokens, num_heads, d = x3.shape
    num_rows = num_tokens * num_heads
    if config is None:
        kernel = "rms_norm" if residual is None else "fused_add_rms_norm"
        config = _config(kernel, d, x.dtype, token_bucket(num_rows))
    res = x if residual is None else residual  # unused when HAS_RESIDUAL is False
    pdl = use_pdl(x.device)
    _rms_norm_kernel[(triton.cdiv(num_rows, config["BLOCK_M"]),)](
        x3, res, weight, out3, eps, num_rows, num_heads, d,
        x3.stride(0), x3.stride(1), res.stride(0), out3.stride(0), out3.stride(1),
        HAS_RESIDUAL=residual is not None, BLOCK_M=config["BLOCK_M"],
        BLOCK_N=max(triton.next_power_of_2(d), CHUNK if int8 else 1), PDL=pdl,
        num_warps=config["num_warps"], scale_ptr=scale, FP8_OUT=scale is not None,
        FP8_MAX=FP8_MAX, ROUND_E4M3=software_rounding(), words_ptr=int8 and int8.words,
        floats_ptr=int8 and int8.floats, INT8_OUT=int8 is not None, INT8_MAX=INT8_MAX,
        launch_pdl=pdl,
    )



if triton is not None:
    from skyline.ops.fp8_quant import quantize_rows_in_registers
    from skyline.ops.gemv_int_a8_triton import round_row_to_words

    @triton.jit(do_not_specialize=["num_rows"])
    def _rms_norm_kernel(
        x_ptr, res_ptr, w_ptr, out_ptr, eps, num_rows, num_heads, d,
        stride_xt, stride_xh, stride_rt, stride_ot, stride_oh,
        HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        PDL: tl.constexpr, scale_ptr=None, FP8_OUT: tl.constexpr = False,
        FP8_MAX: tl.constexpr = 448.0, ROUND_E4M3: tl.constexpr = False,
        words_ptr=None, floats_ptr=None, INT8_OUT: tl.constexpr = False,
        INT8_MAX: tl.constexpr = 127.0,
    ):
        # One program per BLOCK_M rows; a row is one (token, head) of d values, wholly in
        # registers. With a residual (heads == 1): residual <- x + residual, then the sum is
        # normed. Every row is loaded before it is stored, so out may alias x. FP8_OUT
        # (heads == 1): out is e4m3, each row's result in x's dtype quantized with its scale.
        # INT8_OUT (heads == 1, BLOCK_M == 1): the row as stored also rounded to int8 words
        # (ops/gemv_int_a8_triton.round_row_to_words).
        pdl_wait(PDL)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        row_ok = rows < num_rows
        mask = row_ok[:, None] & (cols < d)[None, :]
        tok = (rows // num_heads).to(tl.int64)
        head = rows % num_heads
        x_off = tok * stride_xt + head * stride_xh
        x = tl.load(x_ptr + x_off[:, None] + cols[None, :], mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r_ptrs = res_ptr + (tok * stride_rt)[:, None] + cols[None, :]
            r = tl.load(r_ptrs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(r_ptrs, x, mask=mask)
        h = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(h * h, axis=1) / d + eps)  # [BLOCK_M]
        normed = (h * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < d, other=0.0).to(tl.float32)
        o_off = tok * stride_ot + head * stride_oh
        if FP8_OUT:
            y = (normed * w[None, :]).to(x_ptr.dtype.element_ty).to(tl.float32)
            q, scale = quantize_rows_in_registers(y, FP8_MAX, ROUND_E4M3)
            tl.store(out_ptr + o_off[:, None] + cols[None, :],
                     q.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
            tl.store(scale_ptr + rows, scale, mask=row_ok)
        else:
            y = (normed * w[None, :]).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + o_off[:, None] + cols[None, :], y, mask=mask)
            if INT8_OUT:  # the row as stored, rounded in registers (BLOCK_N >= 32)
                round_row_to_words(tl.reshape(y.to(tl.float32), (BLOCK_N,)), words_ptr,
                                   floats_ptr, tl.program_id(0), num_rows, tl.cdiv(d, 32), 0,
                                   BLOCK_N // 32, INT8_MAX)
