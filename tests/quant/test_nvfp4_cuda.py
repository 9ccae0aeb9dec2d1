"""NVFP4 served on CUDA from its packed tensors (4.5 bits a weight): the block GEMV for decode
batches and the dequantize-into-scratch path above, against the layer's dequantized weight and
F.linear; the kernels in Triton's interpreter here, the layer's CUDA path on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from skyline.config import QuantConfig
from skyline.model.layers.linear import Linear
from skyline.ops.block_linear import nvfp4_linear
from skyline.ops.gemv_block import nvfp4_gemv, rounded_x_ref
from skyline.quant.fp4 import Nvfp4LinearMethod

pytest.importorskip("triton")


def nvfp4_layer(n: int, k: int, shards: int = 1, seed: int = 0) -> Linear:
    method = Nvfp4LinearMethod(QuantConfig(method="nvfp4"))
    layer = Linear(k, n, linear_method=method)
    g = torch.Generator().manual_seed(seed)
    # rows of different magnitude per shard: a merged layer's tensor scale differs by row
    w = torch.randn(n, k, generator=g) * 0.05
    w[: n // 2] *= 4
    layer.weight.data.copy_(w)
    if shards == 2:
        layer.shards = {0: (0, n // 2), 1: (n // 2, n - n // 2)}
    method.process_weights_after_loading(layer)
    return layer


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the kernels in the interpreter on a CPU layer; a GPU runs the next")
@pytest.mark.parametrize("shards", [1, 2])
@pytest.mark.parametrize("rows", [1, 2, 3, 8])
def test_kernels_on_the_layer_tensors_match_the_dequantized_weight(rows, shards):
    layer = nvfp4_layer(48, 100, shards)
    assert len(set(layer.tensor_scale.tolist())) == shards
    w = layer.linear_method.dequantized_weight(layer)
    x = torch.randn(rows, 100, generator=torch.Generator().manual_seed(rows))
    want = F.linear(x, w)
    args = (layer.qweight, layer.scales, layer.tensor_scale)
    # up to 4 rows the GEMV's default is its integer mode, which rounds x to int8 first
    x_seen = rounded_x_ref(x) if rows <= 4 else x
    torch.testing.assert_close(nvfp4_gemv(x, *args), F.linear(x_seen, w), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(nvfp4_linear(x, *args), want, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_cuda_apply_reads_the_packed_tensors(rows):
    layer = nvfp4_layer(256, 512, shards=2).cuda()
    want = layer.linear_method.dequantized_weight(layer)
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    before = torch.cuda.memory_allocated()
    y = layer(x)
    assert hasattr(layer, "qweight")  # nothing repacked or dequantized and kept
    if rows <= 8:  # the GEMV allocates its output and nothing the size of the weight
        assert torch.cuda.memory_allocated() - before < 256 * 512
    # above 8 rows the weight is dequantized to bfloat16 and multiplied there: compare with
    # the bf16-rounded weight, within a bf16 GEMM's rounding (K = 512); up to 4 rows the GEMV
    # rounds x to int8 first
    x_seen = rounded_x_ref(x) if rows <= 4 else x.float()
    ref = F.linear(x_seen, want if rows <= 8 else want.bfloat16().float())
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2 if rows <= 8 else 4e-2)
