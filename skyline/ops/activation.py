"""SiLU-and-mul, the SwiGLU gate: PyTorch reference and a Triton kernel (CUDA)."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from skyline.ops.pdl import pdl_wait, use_pdl
from skyline.ops.tuning import dtype_name, get_config, token_bucket


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] (gate then up) -> silu(gate) * up [..., d]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor, config: dict[str, Any] | None = None) -> torch.Tensor:
    """silu_and_mul_ref's contract; on CUDA one Triton launch for x [num_tokens, 2 * d]."""
    if not (x.is_cuda and triton is not None and x.dim() == 2 and x.stride(-1) == 1
            and x.shape[0] > 0 and x.shape[1] % 2 == 0):
        return silu_and_mul_ref(x)
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


DEFAULT_CONFIG: dict[str, Any] = {"BLOCK": 1024, "num_warps": 4}


def config_key(d: int, dtype: torch.dtype, num_tokens: int) -> str:
    """Tuning-table key (kernel "silu_and_mul"): output width, dtype, tokens."""
    return f"d{d}:{dtype_name(dtype)}:t{token_bucket(num_tokens)}"


@functools.cache
def _config(d: int, dtype: torch.dtype, bucket: int) -> dict[str, Any]:
    return get_config("silu_and_mul", config_key(d, dtype, bucket), DEFAULT_CONFIG)


try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference above serves
    triton = None

if triton is not None:

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_x, stride_o, BLOCK: tl.constexpr,
                             PDL: tl.constexpr):
        # One program per (token, BLOCK columns). Rounded as the reference: silu's result is
        # cast to the dtype before the multiply.
        pdl_wait(PDL)
        tok = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < d
        gate = tl.load(x_ptr + tok * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + tok * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        tl.store(out_ptr + tok * stride_o + cols, (act * up).to(dtype), mask=mask)
