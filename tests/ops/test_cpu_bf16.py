"""ops/cpu_bf16.py's kernel against its reference: bfloat16 products with float32 sums, each
row's result independent of the batch it came in, odd shapes, bad input refused; the wide
product (float32 GEMMs over slabs of the converted weight) and where dense_linear takes it."""

from __future__ import annotations

import pytest
import torch

from skyline.ops import cpu_bf16

needs_kernel = pytest.mark.skipif(not cpu_bf16.available(),
                                  reason="skyline's CPU operations do not build here")


def _close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Within float32 sums in another order, then one rounding to bfloat16 each."""
    ref = cpu_bf16.bf16_mm_ref(x, w).float()
    bound = x.float().abs() @ w.float().abs().T
    err = (y.float() - ref).abs()
    assert (err <= 2**-7 * ref.abs() + 1e-5 * bound).all(), float((err - 2**-7 * ref.abs()).max())


@needs_kernel
@pytest.mark.parametrize("m,k,n", [(1, 576, 1536), (2, 4096, 64), (3, 96, 37), (8, 577, 33),
                                   (13, 31, 7), (20, 160, 100), (1, 1, 5), (9, 64, 1)])
def test_matches_the_reference(m: int, k: int, n: int) -> None:
    g = torch.Generator().manual_seed(m * k + n)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    y = cpu_bf16.bf16_mm(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    _close(y, x, w)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_does_not_depend_on_its_batch(threads: int) -> None:
    """Every row's sum is the same computation in a batch of 1..19 rows (passes of 8, 4, 2, 1)
    and at any thread count: greedy decoding cannot change with the batch."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(19, 608, generator=g).bfloat16()
    w = torch.randn(203, 608, generator=g).bfloat16()
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([cpu_bf16.bf16_mm(x[i:i + 1], w) for i in range(19)])
        for m in (2, 3, 4, 5, 8, 11, 16, 19):
            assert torch.equal(cpu_bf16.bf16_mm(x[:m], w), alone[:m]), m
    finally:
        torch.set_num_threads(prev)


@needs_kernel
def test_leading_dims_and_empty_inputs() -> None:
    w = torch.randn(6, 32).bfloat16()
    x = torch.randn(2, 3, 32).bfloat16()
    assert torch.equal(cpu_bf16.bf16_mm(x, w), cpu_bf16.bf16_mm(x.reshape(6, 32), w).view(2, 3, 6))
    assert cpu_bf16.bf16_mm(torch.empty(0, 32, dtype=torch.bfloat16), w).shape == (0, 6)
    z = cpu_bf16.bf16_mm(torch.ones(2, 0, dtype=torch.bfloat16), torch.ones(3, 0).bfloat16())
    assert torch.equal(z, torch.zeros(2, 3, dtype=torch.bfloat16))


@needs_kernel
def test_bad_input_is_refused() -> None:
    w = torch.randn(4, 32).bfloat16()
    with pytest.raises(RuntimeError, match="x must be a contiguous bfloat16"):
        cpu_bf16.bf16_mm(torch.randn(1, 32), w)
    with pytest.raises(RuntimeError, match="weight must be a contiguous bfloat16 \\[N, K\\]"):
        cpu_bf16.bf16_mm(torch.randn(1, 32).bfloat16(), torch.randn(4, 16).bfloat16())
    with pytest.raises(RuntimeError, match="weight must be a contiguous bfloat16"):
        cpu_bf16.bf16_mm(torch.randn(1, 32).bfloat16(), w.T.contiguous().T)


@needs_kernel
@pytest.mark.parametrize("m,k,n", [(37, 4096, 600), (9, 576, 1728), (64, 14336, 80), (3, 5, 2)])
def test_the_wide_product_matches_the_reference(m: int, k: int, n: int) -> None:
    """Slabs of 256 rows at k = 4,096 (3 of them here, the last short), 73 at 14,336, one at
    576: every column of the result is the reference's, rounded once."""
    g = torch.Generator().manual_seed(m + k + n)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    y = cpu_bf16.bf16_wide_mm(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    _close(y, x, w)
    # float32 activations: float32 out, the same sums before the rounding
    yf = cpu_bf16.bf16_wide_mm(x.float(), w)
    assert yf.dtype == torch.float32
    assert torch.equal(yf.bfloat16(), y)
    assert cpu_bf16.bf16_wide_mm(x.view(1, m, k), w).shape == (1, m, n)
    assert cpu_bf16.bf16_wide_mm(x[:0], w).shape == (0, n)


@needs_kernel
def test_dense_linear_takes_the_wide_product_where_there_is_no_bfloat16_gemm(monkeypatch):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(20, 96, generator=g).bfloat16()
    w = torch.randn(40, 96, generator=g).bfloat16()
    b = torch.randn(40, generator=g).bfloat16()
    monkeypatch.setattr(cpu_bf16, "native_gemm", lambda: False)
    assert torch.equal(cpu_bf16.dense_linear(x, w, b), cpu_bf16.bf16_wide_mm(x, w) + b)
    # a float32 weight, and a CPU with a bfloat16 GEMM: F.linear
    wf = w.float()
    xf = x.float()
    assert torch.equal(cpu_bf16.dense_linear(xf, wf), torch.nn.functional.linear(xf, wf))
    monkeypatch.setattr(cpu_bf16, "native_gemm", lambda: True)
    assert torch.equal(cpu_bf16.dense_linear(x, w, b), torch.nn.functional.linear(x, w, b))


@needs_kernel
def test_the_wide_product_runs_in_and_out_of_inference_mode() -> None:
    """Its slab buffer outlives a call: made in an engine's inference mode, written outside."""
    x, w = torch.randn(5, 64).bfloat16(), torch.randn(48, 64).bfloat16()
    with torch.inference_mode():
        inside = cpu_bf16.bf16_wide_mm(x, w)
    assert torch.equal(cpu_bf16.bf16_wide_mm(x, w), inside)
    with torch.inference_mode():
        assert torch.equal(cpu_bf16.bf16_wide_mm(x, w), inside)
