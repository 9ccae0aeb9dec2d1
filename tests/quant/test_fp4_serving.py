"""MXFP4 served without dequantizing per call: on CUDA as the INT8 kernels' layout (codes
128 + 2v, zero point 128, half the block scale), exact against the format's decoder and run by
the INT8 GEMV (Triton's interpreter here, the GPU where there is one)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from skyline.config import QuantConfig
from skyline.model.layers.linear import Linear
from skyline.ops.gemv_quant import int_gemv
from skyline.ops.int_matmul import dequantize_int_ref
from skyline.quant.fp4 import Mxfp4LinearMethod

pytest.importorskip("triton")


def mxfp4_layer(n: int, k: int, seed: int = 0) -> Linear:
    method = Mxfp4LinearMethod(QuantConfig(method="mxfp4"))
    layer = Linear(k, n, linear_method=method)
    g = torch.Generator().manual_seed(seed)
    layer.weight.data.copy_(torch.randn(n, k, generator=g) * 0.05)
    method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("n,k", [(48, 64), (32, 100)])  # K past the last whole block too
def test_int8_layout_is_the_format_exactly(n, k):
    layer = mxfp4_layer(n, k)
    method = layer.linear_method
    want = method.dequantized_weight(layer)
    q, s, z = method._int8_layout(layer)
    assert q.dtype == torch.uint8 and q.shape == (n, 32 * s.shape[1])
    assert torch.equal(dequantize_int_ref(q, s, z, 8, 32)[:, :k], want)
    assert not hasattr(layer, "qweight")  # the packed tensors are replaced
    assert torch.equal(method.dequantized_weight(layer), want)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
    # the kernel the CUDA path runs for decode batches (Triton's interpreter on CPU machines)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    y = int_gemv(x.to(dev), q.to(dev), s.to(dev), z.to(dev), 8, 32).cpu()
    torch.testing.assert_close(y, x @ want.T, rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 5, 40])  # the GEMV, and the dequant-matmul above 8 rows
def test_cuda_apply_matches_the_dense_weights(rows):
    layer = mxfp4_layer(256, 512).cuda()
    want = layer.linear_method.dequantized_weight(layer)
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    y = layer(x)
    assert not hasattr(layer, "qweight")
    torch.testing.assert_close(y.float(), F.linear(x.float(), want), rtol=2e-2, atol=2e-2)
