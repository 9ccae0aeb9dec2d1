"""The greedy argmax kernel against torch.argmax: first index on ties, ragged vocabularies,
rows of -inf, bf16 and float32 (Triton's interpreter on CPU, the GPU where there is one)."""

from __future__ import annotations

import pytest
import torch

from skyline.ops import argmax as ops

pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows,vocab", [(1, 1), (1, 1000), (3, 4096), (2, 4097), (5, 49152),
                                        (1, 128256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch(rows, vocab, dtype):
    gen = torch.Generator().manual_seed(rows * vocab)
    x = torch.randn(rows, vocab, generator=gen).to(dtype)
    if vocab > 8:  # ties: the first of equal maxima wins, also across tiles and lanes
        x[0, vocab // 3] = x[0, vocab - 1] = x[0, 5] = 50.0
    if vocab > 8192:  # equal maxima in the same lane of two tiles
        x[-1, 7] = x[-1, 7 + 4096] = 60.0
    x = x.to(DEV)
    assert torch.equal(ops.argmax_triton(x), ops.argmax_ref(x))
    assert torch.equal(ops.argmax(x), ops.argmax_ref(x))


def test_special_rows():
    x = torch.full((3, 5000), float("-inf"))
    x[1, 4999] = -1e30
    x[2, 17] = float("inf")
    x[2, 4000] = float("inf")
    x = x.to(DEV)
    assert ops.argmax_triton(x).tolist() == [0, 4999, 17] == ops.argmax_ref(x).tolist()


def test_strided_rows():
    x = torch.randn(4, 3000, generator=torch.Generator().manual_seed(1)).to(DEV)[:, :2000]
    assert torch.equal(ops.argmax_triton(x), ops.argmax_ref(x))
