"""Block-scaled FP8 products (ops/fp8_block.py) and static-scale FP8 activations
(ops/fp8_linear.py) against their references."""

from __future__ import annotations

import pytest
import torch

from skyline.ops.fp8_block import (
    dequantize_fp8_blocks,
    fp8_block_linear,
    fp8_block_linear_ref,
    fp8_block_matmul_triton,
)
from skyline.ops.fp8_linear import fp8_linear, quantize_static_fp8
from skyline.ops.fp8_quant import FP8, quantize_rows_fp8_ref
from skyline.ops.triton_utils import triton

# The Triton kernel runs compiled on a GPU, in Triton's interpreter on a CPU machine.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def block_weight(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    # clamped: values past e4m3's 448 would become NaN
    w = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(FP8)
    return w, torch.rand(n, -(-k // 128), generator=gen) / 100 + 1e-3


def test_reference_is_the_blockwise_sum():
    gen = torch.Generator().manual_seed(0)
    w, ws = block_weight(8, 300, gen)
    x = torch.randn(3, 300, generator=gen)
    xq, xs = quantize_rows_fp8_ref(x, 128)
    want = torch.zeros(3, 8, dtype=torch.float64)
    for b in range(3):  # block b: columns [128 b, 128 (b + 1))
        cols = slice(128 * b, 128 * (b + 1))
        part = xq[:, cols].double() @ w[:, cols].double().t()
        want += part * xs[:, b:b + 1].double() * ws[:, b].double()
    torch.testing.assert_close(fp8_block_linear_ref(x, w, ws).double(), want, rtol=1e-5,
                               atol=1e-5)
    assert torch.equal(dequantize_fp8_blocks(w, ws)[:, 130], w[:, 130].float() * ws[:, 1])


@pytest.mark.skipif(triton is None, reason="needs Triton (or its interpreter)")
@pytest.mark.parametrize(("m", "n", "k"), [(1, 64, 128), (5, 70, 256), (17, 64, 200)])
def test_triton_kernel_matches_reference(m, n, k):
    gen = torch.Generator().manual_seed(m + n + k)
    w, ws = (t.to(DEVICE) for t in block_weight(n, k, gen))
    x = torch.randn(m, k, generator=gen).to(DEVICE)
    xq, xs = quantize_rows_fp8_ref(x, 128)
    got = fp8_block_matmul_triton(xq, xs, w, ws, torch.float32)
    want = fp8_block_linear_ref(x, w, ws)
    if DEVICE == "cuda":  # Hopper's fp8 tensor-core sums keep fewer bits than float32
        assert ((got - want).norm() / want.norm()) < 1e-2
    else:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


def test_static_activation_scale():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 64, generator=gen) * 3
    s = torch.tensor([0.005])  # saturates |x| > 2.24 at +-448
    xq, scale = quantize_static_fp8(x, s)
    assert scale.shape == (4, 1) and torch.equal(scale, s.expand(4, 1))
    assert xq.float().abs().max() == 448
    w = (torch.randn(32, 64, generator=gen) * 50).to(FP8)
    ws = torch.rand(32, generator=gen) / 50
    want = torch.nn.functional.linear(xq.float() * s, w.float() * ws[:, None])
    torch.testing.assert_close(fp8_linear(x, w, ws, x_scale=s), want, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("m", "n", "k"), [(1, 4096, 4096), (8, 1024, 4096), (300, 6144, 4096),
                                           (5, 256, 200)])
def test_block_linear_on_cuda(m, n, k):
    gen = torch.Generator("cuda").manual_seed(0)
    # clamped: values past e4m3's 448 would become NaN
    w = (torch.randn(n, k, device="cuda", generator=gen) * 100).clamp(-448, 448).to(FP8)
    ws = torch.rand(n, -(-k // 128), device="cuda", generator=gen) / 100
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    want = fp8_block_linear_ref(x, w, ws).float()
    got = fp8_block_linear(x, w, ws).float()
    assert ((got - want).norm() / want.norm()) < 1e-2
    xq, xs = quantize_rows_fp8_ref(x, 128)
    tri = fp8_block_matmul_triton(xq, xs, w, ws, torch.bfloat16).float()
    assert ((tri - want).norm() / want.norm()) < 1e-2
