"""bfloat16 products on the CPU for decode-sized batches, on the weight as loaded ([N, K],
row-major, no packing).

oneDNN's product on a packed bf16 weight (ops/cpu_linear.py) reads a one-row product's weight at
0.6-0.85 of the read rate measured beside it, least on short rows (the default model's 576);
this kernel at ~1.0 (bench/cpu_bf16_speed.py). Each output row is a float32 sum over k in a
fixed order (AVX-512 BF16 `vdpbf16ps` 32 elements a step, else AVX2 FMAs or scalar), each weight
load serves every row of the batch, and a row's result is the same whatever batch it came in.
Batches beyond the CPU plan's `bf16_rows` take oneDNN's products, whose per-row cost falls with
the rows where this kernel's does not (it is bound by `vdpbf16ps` from ~4 rows). Where oneDNN
packs no bfloat16 (AVX2) a layer holds the plain weight alone, and ATen's bfloat16 product on
it is a loop 4-8x slower than its float32 GEMM; `dense_linear` takes `bf16_wide_mm` there
instead: float32 GEMMs over the weight converted a slab of rows at a time (each slab still in
cache when the GEMM reads it), at 0.67-1.13x the time of a float32 weight's GEMM and 4.8-6.1x
faster than ATen's bfloat16 product at 256 rows (bench/cpu_bf16_speed.py on an AMD EPYC).

The C++ is csrc/cpu_bf16.cpp, built for this machine by ops/cpu_ext.py; where it does not
build, `available()` is False and callers keep oneDNN's product.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from skyline.ops import cpu_ext, cpu_linear


def bf16_mm_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The reference: x [M, K] times weight [N, K] transposed, float32 sums, bfloat16 out."""
    return (x.float() @ weight.float().T).to(torch.bfloat16)


def available() -> bool:
    """Whether the kernel is built (or builds now) for this machine."""
    return cpu_ext.available()


def isa() -> str:
    """The path this build runs: "avx512_bf16", "avx2" or "scalar"."""
    return str(torch.ops.skyline_cpu.bf16_isa())


def bf16_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] bfloat16 times weight [N, K] bfloat16 transposed -> [..., N] bfloat16."""
    return _by_rows(torch.ops.skyline_cpu.bf16_mm, x, weight)


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                ) -> torch.Tensor:
    """bf16_mm plus `bias` (added to the bfloat16 product, as intdot_linear's)."""
    y = bf16_mm(x, weight)
    return y if bias is None else y + bias


def bf16_wide_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] times weight [N, K] bfloat16 transposed -> [..., N] in x's dtype, for batches
    of many rows: float32 sums (bf16_mm_ref's, in a GEMM's order), one rounding."""
    return _by_rows(torch.ops.skyline_cpu.bf16_wide_mm, x, weight)


def _by_rows(op: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`op` (x [M, K], weight [N, K]) -> [M, N] on x's leading dimensions flattened."""
    if not cpu_ext.available():
        raise RuntimeError("skyline's CPU operations are not built here (ops/cpu_ext.py); "
                           "check cpu_bf16.available() first")
    lead = x.shape[:-1]
    y = op(x.reshape(lead.numel(), x.shape[-1]).contiguous(), weight)
    return y.view(*lead, weight.shape[0])


@functools.lru_cache(maxsize=1)
def native_gemm() -> bool:
    """Whether this CPU multiplies bfloat16 matrices natively (oneDNN packs bfloat16 weights:
    AVX-512 BF16 or AMX, or its AVX-512 emulation); without it ATen's product is a slow loop."""
    return cpu_linear.can_pack(torch.zeros(1, 1, dtype=torch.bfloat16))


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """F.linear on a plain weight; a bfloat16 one on a CPU without a bfloat16 GEMM takes
    bf16_wide_mm (`bias` added to its result, as bf16_linear's)."""
    if (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and not native_gemm()
            and available()):
        y = bf16_wide_mm(x, weight)
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)
