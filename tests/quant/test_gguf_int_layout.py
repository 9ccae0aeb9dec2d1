"""GGUF blocks in the group-wise integer layout the GPU kernels read (skyline/quant/gguf.py's
CUDA path): every block type of integer codes reproduces `dequantize_ref` exactly as codes,
scales and offsets; a layer's runs (mixed types, mixed group sizes, zero-scale groups) become
one layout with the same weights; the INT4/INT8 GEMV and the matmul over that layout (float32
zeros) match the dense weights. Kernels run in Triton's interpreter on CPU, on CUDA on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from skyline.bench.gguf_blocks import random_blocks
from skyline.ops.dequant import AFFINE_GROUP, affine_groups, dequantize_ref
from skyline.ops.gemv_quant import int_gemv
from skyline.quant.gguf import GGUFLinearMethod, _cuda_ready, _int_apply, int_layout

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
def blocks(qtype: Q, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return random_blocks(qtype, rows, cols, seed + int(qtype))


class _Layer(torch.nn.Module):
    """What GGUFLinearMethod needs of a Linear after loading: runs of raw blocks."""

    def __init__(self, runs: list[tuple[Q, torch.Tensor]], bias: bool = False) -> None:
        super().__init__()
        self.gguf_types = [int(q) for q, _ in runs]
        for i, (_, data) in enumerate(runs):
            self.register_buffer(f"gguf_w{i}", data.to(DEV))
        self.in_features = runs[0][1].shape[1] // GGML_QUANT_SIZES[runs[0][0]][1] \
            * GGML_QUANT_SIZES[runs[0][0]][0]
        rows = sum(d.shape[0] for _, d in runs)
        self.bias = torch.randn(rows, device=DEV) if bias else None

    def dense(self) -> torch.Tensor:
        return torch.cat([dequantize_ref(getattr(self, f"gguf_w{i}"), q)
                          for i, q in enumerate(self.gguf_types)])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_affine_groups_reproduce_the_blocks_exactly(qtype):
    data = blocks(qtype, 3, 512)
    codes, scale, offset, group = affine_groups(data, qtype)
    assert group == AFFINE_GROUP[int(qtype)] and codes.shape == (3, 512)
    assert scale.shape == offset.shape == (3, 512 // group)
    w = codes.float() * scale.repeat_interleave(group, 1) + offset.repeat_interleave(group, 1)
    assert torch.equal(w, dequantize_ref(data, qtype))


def test_affine_groups_rejects_float_types():
    with pytest.raises(ValueError, match="not a block type of integer codes"):
        affine_groups(torch.zeros(1, 512, dtype=torch.uint8), Q.F16)


@pytest.mark.parametrize("runs,bits,group", [
    ([Q.Q4_K], 4, 32), ([Q.Q4_0, Q.Q4_1], 4, 32), ([Q.Q8_0], 8, 32), ([Q.Q6_K], 8, 16),
    ([Q.Q4_K, Q.Q6_K, Q.Q4_K], 8, 16), ([Q.Q5_K, Q.Q3_K], 8, 16), ([Q.Q5_0, Q.Q2_K], 8, 16)],
    ids=str)
def test_layer_runs_become_one_layout_with_the_same_weights(runs, bits, group):
    layer = _Layer([(q, blocks(q, 3 + i, 256, seed=i)) for i, q in enumerate(runs)])
    qweight, scales, zeros, got_bits, got_group = int_layout(layer)
    assert (got_bits, got_group) == (bits, group)
    assert zeros.dtype == torch.float32 and scales.shape == zeros.shape
    from skyline.ops.int_matmul import dequantize_int_ref
    w = dequantize_int_ref(qweight, scales, zeros, bits, group)
    torch.testing.assert_close(w, layer.dense(), rtol=1e-6, atol=1e-7)


def test_zero_scale_groups_keep_their_constant():
    # A Q4_1 block with d = 0 is the constant m whatever its codes: (q - z) * s cannot say that
    # with s = 0, so such groups become codes 0, scale 1, zero -m.
    data = blocks(Q.Q4_1, 2, 64)
    b = data.view(-1, 20)
    b[0, 0:2] = torch.tensor([0.0], dtype=torch.float16).view(torch.uint8)
    b[0, 2:4] = torch.tensor([0.375], dtype=torch.float16).view(torch.uint8)
    layer = _Layer([(Q.Q4_1, data)])
    assert torch.all(layer.dense()[0, :32] == 0.375)
    from skyline.ops.int_matmul import dequantize_int_ref
    w = dequantize_int_ref(*int_layout(layer))
    torch.testing.assert_close(w, layer.dense(), rtol=1e-6, atol=1e-7)


def test_float_types_have_no_integer_layout():
    w = torch.randn(4, 64).half()
    layer = _Layer([(Q.Q4_0, blocks(Q.Q4_0, 2, 64))])
    layer.gguf_types.append(int(Q.F16))
    layer.register_buffer("gguf_w1", w.view(torch.uint8).to(DEV))
    assert int_layout(layer) is None


@pytest.mark.parametrize("runs", [[Q.Q4_K], [Q.Q4_K, Q.Q3_K], [Q.Q8_0]], ids=str)
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_layer_on_the_integer_kernels_matches_the_dense_weights(runs, rows):
    # The CUDA form of a layer: built once (raw blocks dropped), then the GEMV (decode-sized
    # batches on a GPU) or the matmul; on CPU the kernels run in Triton's interpreter.
    dtype = torch.float16 if DEV == "cuda" else torch.float32
    layer = _Layer([(q, blocks(q, 5 + i, 256, seed=7 + i)) for i, q in enumerate(runs)],
                   bias=True)
    dense = layer.dense()
    assert _cuda_ready(layer, dtype) and not hasattr(layer, "gguf_w0")
    x = torch.randn(rows, 256, device=DEV).to(dtype)
    want = F.linear(x.float(), dense, layer.bias)
    got = _int_apply(layer, x)
    # 16-bit activations on a GPU: weights rounded to them tile by tile in the matmul
    torch.testing.assert_close(got.float(), want, rtol=2e-3,
                               atol=2e-3 * want.abs().max().item())
    w = GGUFLinearMethod().dequantized_weight(layer)
    torch.testing.assert_close(w, dense, rtol=1e-6, atol=1e-7)
    if rows <= 8:  # the GEMV itself, float32 zeros, tensor-core and FMA tiles
        args = (layer.gguf_qweight, layer.gguf_scales, layer.gguf_zeros,
                *layer.gguf_bits_group)
        for dot in (False, True):
            cfg = {"BLOCK_N": 16, "BLOCK_K": 16 if args[-1] == 16 else 32, "SPLIT_K": 2,
                   "USE_DOT": dot, "num_warps": 4, "num_stages": 1}
            if dot and args[-2] == 4:
                cfg["BLOCK_K"] = 32
            xh = x.half()  # the GEMV takes 16-bit activations
            y = int_gemv(xh, *args, bias=None, config=cfg)
            ref = F.linear(xh.float(), dense)
            torch.testing.assert_close(y.float(), ref, rtol=2e-3,
                                       atol=2e-3 * ref.abs().max().item())
