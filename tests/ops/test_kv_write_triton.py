"""The Triton fp8 KV-cache write against write_kv_ref, over a sweep of shapes: the same bytes
in every slot. Runs on CUDA, or in Triton's interpreter on CPU (see tests/conftest.py).

The interpreter's float8 conversion rounds only approximately (it can lose the carry when a
value rounds up to the next power of two), so on CPU the inputs are values that need no
rounding: fp8 numbers times power-of-two scales, plus out-of-range ones that saturate. On CUDA
the same sweep also runs on arbitrary values and scales."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from skyline.ops.kv_quant import FP8_DTYPE  # noqa: E402
from skyline.ops.kv_write import write_kv_ref, write_kv_triton  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 16), (3, 32), (2, 64), (8, 128)])
@pytest.mark.parametrize("page", [4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k_scale,v_scale,exact_inputs", [
    (1.0, 1.0, True), (2**-5, 2**-8, True), (0.03, 0.004, False)])
def test_write_fp8_matches_reference(num_kv_heads, head_dim, page, dtype, k_scale, v_scale,
                                     exact_inputs):
    if DEV == "cpu" and (head_dim > 64 or dtype != torch.float32 or not exact_inputs):
        pytest.skip("interpreter: small fp32 shapes, values that need no fp8 rounding")
    g = torch.Generator().manual_seed(num_kv_heads * head_dim + page)
    num_blocks, num_tokens = 6, 13
    # k and v as strided views of one fused projection, as the model hands them over
    qkv = torch.randn(num_tokens, 4 + 2 * num_kv_heads, head_dim, generator=g) * 20
    qkv[:, :, :3] *= 100  # some values beyond the fp8 range: they must saturate
    k_raw, v_raw = qkv[:, 4 : 4 + num_kv_heads], qkv[:, 4 + num_kv_heads :]
    if exact_inputs:  # fp8 numbers (or far beyond 448) times the scale
        qkv[:, 4 : 4 + num_kv_heads] = _fp8_grid(k_raw) * k_scale
        qkv[:, 4 + num_kv_heads :] = _fp8_grid(v_raw) * v_scale
    else:
        qkv[:, 4 : 4 + num_kv_heads] *= k_scale
        qkv[:, 4 + num_kv_heads :] *= v_scale
    qkv = qkv.to(DEV, dtype)
    k, v = qkv[:, 4 : 4 + num_kv_heads], qkv[:, 4 + num_kv_heads :]
    slots = torch.randperm(num_blocks * page, generator=g)[:num_tokens].to(DEV)
    cache = torch.randn(2, num_blocks, page, num_kv_heads, head_dim, generator=g)
    cache = cache.to(DEV, FP8_DTYPE)  # stale values everywhere else must stay
    ref = cache.clone()
    write_kv_triton(k, v, cache, slots, k_scale, v_scale)
    write_kv_ref(k, v, ref, slots, k_scale, v_scale)
    assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))
    assert torch.isfinite(cache.float()).all()
    assert cache.float().abs().max() == 448.0  # saturated, not NaN


def _fp8_grid(x: torch.Tensor) -> torch.Tensor:
    """x rounded to fp8 numbers, keeping values beyond 448 (which must saturate) as they are."""
    return torch.where(x.abs() > 448, x, x.to(FP8_DTYPE).float())


def test_write_no_tokens_is_a_no_op():
    cache = torch.zeros(2, 2, 4, 1, 16, dtype=FP8_DTYPE, device=DEV)
    empty = torch.empty(0, 1, 16, device=DEV)
    write_kv_triton(empty, empty, cache, torch.empty(0, dtype=torch.int64, device=DEV), 1.0, 1.0)
    assert (cache.view(torch.uint8) == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(2, 16), (3, 32), (8, 128)])
def test_write_same_dtype_matches_reference(dtype, num_kv_heads, head_dim):
    """A cache in the model dtype: a plain scatter, no scaling or saturation (values beyond the
    fp8 range stay)."""
    if DEV == "cpu" and (dtype != torch.float32 or head_dim > 32):
        pytest.skip("interpreter: small fp32 shapes")
    g = torch.Generator().manual_seed(head_dim)
    qkv = (torch.randn(9, 2 + 2 * num_kv_heads, head_dim, generator=g) * 1000).to(DEV, dtype)
    k, v = qkv[:, 2 : 2 + num_kv_heads], qkv[:, 2 + num_kv_heads :]
    slots = torch.randperm(4 * 8, generator=g)[:9].to(DEV)
    cache = torch.randn(2, 4, 8, num_kv_heads, head_dim, generator=g).to(DEV, dtype)
    ref = cache.clone()
    write_kv_triton(k, v, cache, slots)
    write_kv_ref(k, v, ref, slots)
    assert torch.equal(cache, ref)
    assert cache.abs().max() > 448
