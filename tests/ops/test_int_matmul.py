"""The Triton INT8/INT4 dequant-matmul against its PyTorch reference over a sweep of shapes
(Triton interpreter on CPU, small shapes)."""

from __future__ import annotations

import pytest
import torch

from skyline.ops.int_matmul import int_matmul_ref, int_matmul_triton
from skyline.quant.intq import quantize_groups

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def packed(n: int, k: int, bits: int, group: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    codes, scales, zeros = quantize_groups(w, bits, group)
    if bits == 4:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return [t.to(DEVICE) for t in (codes, scales, zeros)]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [16, 64])
@pytest.mark.parametrize("m,n,k", [(1, 8, 32), (5, 40, 48), (33, 72, 100), (3, 16, 128)])
def test_int_matmul_triton_matches_ref(bits, group, m, n, k):
    q, s, z = packed(n, k, bits, group, seed=m * n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ref = int_matmul_ref(x, q, s, z, bits, group)
    out = int_matmul_triton(x, q, s, z, bits, group)
    assert out.shape == (m, n)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_int_matmul_keeps_leading_dims():
    q, s, z = packed(24, 64, 4, 32, seed=0)
    x = torch.randn(2, 3, 64).to(DEVICE)
    torch.testing.assert_close(int_matmul_triton(x, q, s, z, 4, 32),
                               int_matmul_ref(x, q, s, z, 4, 32), rtol=1e-4, atol=1e-4)
