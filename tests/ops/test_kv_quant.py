"""The fp8 KV cache's write/read round trip: quantize_kv / dequantize_kv, write_kv_ref into a
float8_e4m3fn cache, saturation, and scales from an amax."""

from __future__ import annotations

import math

import pytest
import torch

from skyline.ops.kv_quant import (
    FP8_DTYPE,
    FP8_MAX,
    SCALE_HEADROOM,
    dequantize_kv,
    quantize_kv,
    scale_from_amax,
)
from skyline.ops.kv_write import write_kv_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 300.0])
def test_round_trip_relative_error(dtype, magnitude):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 4, 32, generator=g) * magnitude).to(dtype)
    scale = scale_from_amax(x.abs().max().item())
    q = quantize_kv(x, FP8_DTYPE, scale)
    assert q.dtype == FP8_DTYPE
    y = dequantize_kv(q, torch.float32, scale)
    # e4m3 keeps 3 mantissa bits: rounding error at most 2**-4 relative for normal values;
    # values that land in the subnormal range (below 2**-6) lose at most half of 2**-9.
    bound = 2**-4 * x.float().abs() + scale * 2**-10
    assert ((y - x.float()).abs() <= bound * 1.0001).all()
    # and the scale matters: without it the same data saturates or underflows
    if magnitude != 1.0:
        z = dequantize_kv(quantize_kv(x, FP8_DTYPE, 1.0), torch.float32, 1.0)
        assert ((z - x.float()).abs() > bound * 1.0001).any()


def test_out_of_range_saturates_instead_of_nan():
    x = torch.tensor([1e6, -1e6, 449.0, 10.0, float("inf")])
    y = quantize_kv(x, FP8_DTYPE, 1.0).float()
    assert y.tolist() == [FP8_MAX, -FP8_MAX, FP8_MAX, 10.0, FP8_MAX]
    y = quantize_kv(x, FP8_DTYPE, 0.5).float()
    assert y[3].item() == 20.0 and torch.isfinite(y).all()


def test_model_dtype_cache_stores_values_unchanged():
    x = torch.randn(5, 2, 8)
    assert torch.equal(quantize_kv(x, torch.float32, 1.0), x)
    assert torch.equal(dequantize_kv(x, torch.float32, 1.0), x)


def test_scale_from_amax():
    s = scale_from_amax(10.0)
    assert s == pytest.approx(10.0 * SCALE_HEADROOM / FP8_MAX, rel=1e-7)
    assert s == float(torch.tensor(s, dtype=torch.float32))  # a float32 value
    assert scale_from_amax(0.0) == 1.0
    assert scale_from_amax(math.nan) == 1.0 and scale_from_amax(math.inf) == 1.0


@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.05, 0.002)])
def test_write_kv_triton_cache_round_trip(k_scale, v_scale):
    g = torch.Generator().manual_seed(1)
    cache = torch.zeros(2, 3, 4, 2, 8, dtype=FP8_DTYPE)
    k = torch.randn(5, 2, 8, generator=g) * 4
    v = torch.randn(5, 2, 8, generator=g) * 0.1
    slots = torch.tensor([11, 0, 5, 6, 3])
    write_kv_ref(k, v, cache, slots, k_scale, v_scale)
    written = set(slots.tolist())
    for s in range(12):
        kc, vc = cache[0, s // 4, s % 4], cache[1, s // 4, s % 4]
        if s not in written:  # untouched slots keep their bytes
            assert (kc.view(torch.uint8) == 0).all() and (vc.view(torch.uint8) == 0).all()
    for i, s in enumerate(slots.tolist()):
        kc, vc = cache[0, s // 4, s % 4], cache[1, s // 4, s % 4]
        # exactly the bytes quantize_kv makes, and within fp8 rounding of the input
        assert torch.equal(kc.view(torch.uint8),
                           quantize_kv(k[i], FP8_DTYPE, k_scale).view(torch.uint8))
        assert torch.equal(vc.view(torch.uint8),
                           quantize_kv(v[i], FP8_DTYPE, v_scale).view(torch.uint8))
        for x, c, sc in ((k[i], kc, k_scale), (v[i], vc, v_scale)):
            err = (dequantize_kv(c, torch.float32, sc) - x).abs()
            assert (err <= 2**-4 * x.abs() + sc * 2**-10).all()
