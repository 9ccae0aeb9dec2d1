"""The Triton per-token fp8 activation quantization against its reference: the same bytes and
scales. Runs on CUDA, or in Triton's interpreter on CPU (tests/conftest.py), where float8
conversion rounds only approximately: there the rows are fp8 numbers times a power of two
whose largest value is 448 times that power (x / scale needs no rounding). Rows up to
WHOLE_ROW wide are quantized in one pass, wider ones (17,000) in two."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from skyline.ops.fp8_quant import (  # noqa: E402
    FP8,
    FP8_MAX,
    quantize_rows_fp8,
    quantize_rows_fp8_ref,
    quantize_rows_fp8_triton,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(1, 16), (3, 100), (5, 1024), (2, 1500), (7, 4096), (2, 17000)] + (
    [(513, 14336), (64, 4096)] if DEV == "cuda" else [])


def exact_rows(rows: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Rows of fp8 numbers times 2**e, each holding +-448 * 2**e (so the scale is 2**e)."""
    x = (torch.randn(rows, k, generator=g) * 60).clamp(-440, 440).to(FP8).float()
    e = torch.randint(-12, 4, (rows, 1), generator=g).float()
    cols = torch.randint(0, k, (rows,), generator=g)
    x[torch.arange(rows), cols] = FP8_MAX * torch.where(cols % 2 == 0, 1.0, -1.0)
    return x * torch.exp2(e)


@pytest.mark.parametrize("rows,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("exact", [True, False])
def test_triton_matches_reference(rows, k, dtype, exact):
    if DEV == "cpu" and (not exact or dtype != torch.float32):
        pytest.skip("interpreter: fp32 values that need no fp8 rounding")
    g = torch.Generator().manual_seed(rows * k)
    x = exact_rows(rows, k, g) if exact else torch.randn(rows, k, generator=g) * 3
    x = x.to(DEV, dtype)
    x[0, :] = 0 if rows > 2 else x[0, :]  # a zero row: scale 1
    q, s = quantize_rows_fp8_triton(x)
    q_ref, s_ref = quantize_rows_fp8_ref(x)
    assert q.dtype == FP8 and q.shape == (rows, k) and s.shape == (rows, 1)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert (q.float().abs().amax(-1) <= FP8_MAX).all()


def test_strided_rows_and_the_dispatcher():
    g = torch.Generator().manual_seed(0)
    base = exact_rows(6, 64, g).to(DEV)
    x = base[::2]  # row stride 128, unit stride along K
    q, s = quantize_rows_fp8_triton(x)
    q_ref, s_ref = quantize_rows_fp8_ref(x)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    q2, s2 = quantize_rows_fp8(x)  # CPU: the reference itself; CUDA: the kernel
    assert torch.equal(q2.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s2, s_ref)
    empty_q, empty_s = quantize_rows_fp8(torch.empty(0, 64, device=DEV))
    assert empty_q.shape == (0, 64) and empty_s.shape == (0, 1)
