"""MXFP4 layers on CUDA read their packed tensors as stored (ops/gemv_block.py, whose kernels
tests/ops/test_gemv_block.py checks in Triton's interpreter): the block GEMV up to 8 rows (x
rounded to int8 per 32 columns up to 4), chunks dequantized through the scratch buffer above."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from skyline.config import QuantConfig
from skyline.model.layers.linear import Linear
from skyline.quant.fp4 import Mxfp4LinearMethod

pytest.importorskip("triton")


def mxfp4_layer(n: int, k: int, seed: int = 0) -> Linear:
    method = Mxfp4LinearMethod(QuantConfig(method="mxfp4"))
    layer = Linear(k, n, linear_method=method)
    g = torch.Generator().manual_seed(seed)
    layer.weight.data.copy_(torch.randn(n, k, generator=g) * 0.05)
    method.process_weights_after_loading(layer)
    return layer


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 5, 40])  # both GEMV modes, and the chunks above 8 rows
def test_cuda_apply_matches_the_dense_weights(rows):
    layer = mxfp4_layer(256, 512).cuda()
    want = layer.linear_method.dequantized_weight(layer)
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    y = layer(x)
    assert layer.qweight.dtype == torch.uint8  # kept as stored: no other copy is made
    torch.testing.assert_close(y.float(), F.linear(x.float(), want), rtol=2e-2, atol=2e-2)
