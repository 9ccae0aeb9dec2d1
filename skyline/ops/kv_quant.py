"""FP8 (e4m3) KV cache: quantize when K/V are written, dequantize when they are read.

A cache of dtype float8_e4m3fn holds x / scale, saturated to +-448, with one float32 scale per
layer for K and one for V. The scales are fixed for the engine's lifetime: the worker
calibrates them once, from the amax of one forward of random tokens (`scale_from_amax`),
before any CUDA graph captures them as kernel constants. Readers fold them into the attention math
(scores * k_scale, output * v_scale) instead of rescaling every element.

Caches of the model's own dtype store x unchanged (scale 1.0).
"""

from __future__ import annotations

import math

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# The calibration amax lands at FP8_MAX / SCALE_HEADROOM: room for K/V values up to 4x what
# the calibration forward saw before they saturate. Headroom costs no precision outside the
# subnormal range (e4m3 has the same 3-bit relative precision over [2**-6, 448]); only values
# below amax / 7168 lose some. On the default model, scales of 1.0 (K headroom ~20x) score the
# same as calibrated ones (bench/kv_cache_quality.py).
SCALE_HEADROOM = 4.0


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_DTYPE


def inverse_scale(scale: float) -> float:
    """1 / scale as a float32 value: writers multiply by it (PyTorch and Triton alike, so both
    round the same float32 product)."""
    return float(torch.tensor(1.0 / scale, dtype=torch.float32))


def quantize_kv(
    x: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    dtype: torch.dtype,
    scale: float,
) -> torch.Tensor:  # x / scale in `dtype`; fp8 saturates instead of overflowing to NaN
    if dtype != FP8_DTYPE:
        return (x if scale == 1.0 else x * inverse_scale(scale)).to(dtype)
    return (x.float() * inverse_scale(scale)).clamp_(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """The inverse of quantize_kv up to rounding: x * scale in `dtype`."""
    y = x.to(dtype)
    return y if scale == 1.0 else y * scale


def scale_from_amax(amax: float) -> float:
    """Per-tensor scale that maps `amax` to FP8_MAX / SCALE_HEADROOM, rounded to a float32
    value (so PyTorch and Triton use the same number); 1.0 if amax is 0 or not finite."""
    if not math.isfinite(amax) or amax <= 0:
        return 1.0
    return float(torch.tensor(amax * SCALE_HEADROOM / FP8_MAX, dtype=torch.float32))
