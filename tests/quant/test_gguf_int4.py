"""GGUF group types on the CPU's int4 kernel: codes, scales and offsets reproduce the blocks
exactly; bfloat16 matmuls through torch's int4 kernel (one plane for 4-bit codes, two for 5- to
8-bit ones) match the dequantized weights; types of 16-element groups become dense bfloat16
once; float32 keeps the exact dequantize-and-matmul path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from skyline.bench.gguf_blocks import random_blocks
from skyline.ops import cpu_int4
from skyline.ops.dequant import dequantize_ref, int4_groups
from skyline.quant.gguf import GGUFLinearMethod

blocks = random_blocks  # (qtype, rows, cols, seed): scales in [-0.05, 0.05]


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K], ids=lambda q: q.name)
def test_int4_groups_reproduce_the_blocks_exactly(qtype):
    data = blocks(qtype, 5, 512)
    codes, scale, offset = int4_groups(data, qtype)
    assert codes.shape == (5, 512) and int(codes.max()) <= 15
    assert scale.shape == offset.shape == (5, 16)
    w = codes.float() * scale.repeat_interleave(32, 1) + offset.repeat_interleave(32, 1)
    assert torch.equal(w, dequantize_ref(data, qtype))


def test_int4_groups_rejects_other_types():
    with pytest.raises(ValueError, match="not a 4-bit group type"):
        int4_groups(blocks(Q.Q6_K, 1, 256), Q.Q6_K)


class _Layer(torch.nn.Module):
    """What GGUFLinearMethod needs of a Linear after loading: runs of raw blocks."""

    def __init__(self, runs: list[tuple[Q, torch.Tensor]]) -> None:
        super().__init__()
        self.gguf_types = [int(q) for q, _ in runs]
        for i, (_, data) in enumerate(runs):
            self.register_buffer(f"gguf_w{i}", data)
        self.bias = None


@pytest.mark.skipif(not cpu_int4.has_kernel(), reason="torch lacks the CPU int4 kernel")
def test_bf16_matmul_on_the_int4_kernel_matches_the_dequantized_weights():
    # a merged projection of two runs of different 4-bit types, as qkv can be
    layer = _Layer([(Q.Q4_1, blocks(Q.Q4_1, 48, 512, 1)), (Q.Q4_K, blocks(Q.Q4_K, 16, 512, 2))])
    method = GGUFLinearMethod()
    w = method.dequantized_weight(layer)  # [64, 512] float32, exact
    x = torch.randn(3, 512)
    y = method.apply(layer, x.to(torch.bfloat16))
    assert layer.gguf_int4 is not None and y.dtype == torch.bfloat16 and y.shape == (3, 64)
    ref = x.to(torch.bfloat16).float() @ w.T
    err = (y.float() - ref).abs().max() / ref.abs().max()
    assert err < 2e-2  # bf16 scales and accumulation of bf16 inputs
    # a wrong kernel convention (zero point, nibble order) is far off
    assert (y.float() - x.float() @ w.flip(0).T).abs().max() / ref.abs().max() > 0.3
    # the raw blocks are gone: the layer holds the int4 layout alone (as small as the file)
    assert not [n for n, _ in layer.named_buffers() if n.startswith("gguf_w")]
    # the weights read back from the kernel: the blocks' values within the rounding of its
    # bf16 scales and zero points
    w_back = method.dequantized_weight(layer)
    assert w_back.shape == w.shape
    assert (w_back - w).abs().max() / w.abs().max() < 1e-2
    y_back = x.to(torch.bfloat16).float() @ w_back.T
    assert (y_back - y.float()).abs().max() / ref.abs().max() < 2e-2
    # other input dtypes run the same kernel through bfloat16
    y32 = method.apply(layer, x)
    assert y32.dtype == torch.float32
    torch.testing.assert_close(y32, y.float())


@pytest.mark.skipif(not cpu_int4.has_kernel(), reason="torch lacks the CPU int4 kernel")
@pytest.mark.parametrize("runs", [[Q.Q8_0], [Q.Q5_0], [Q.Q5_1], [Q.Q5_K], [Q.Q4_K, Q.Q5_K]],
                         ids=lambda r: "+".join(q.name for q in r))
def test_wider_codes_run_as_two_int4_planes(runs):
    """5- to 8-bit codes: low and high nibbles as two int4 planes whose weights add up to the
    blocks' (within the bf16 rounding of scales and zero points), 10 bits a weight."""
    layer = _Layer([(q, blocks(q, 32, 512, 10 + i)) for i, q in enumerate(runs)])
    method = GGUFLinearMethod()
    w = method.dequantized_weight(layer)
    x = torch.randn(5, 512)
    y = method.apply(layer, x.to(torch.bfloat16))
    assert len(layer.gguf_int4) == 2 and not hasattr(layer, "gguf_w0")
    ref = x.to(torch.bfloat16).float() @ w.T
    assert (y.float() - ref).abs().max() / ref.abs().max() < 2e-2
    w_back = method.dequantized_weight(layer)
    # per weight: within bf16 rounding of the scale (2^-9 of the largest code's weight)
    assert (w_back - w).abs().max() / w.abs().max() < 1e-2
    packed_bytes = sum(t.numel() * t.element_size() for p in layer.gguf_int4 for t in p)
    # two planes of 4-bit codes, each with a bf16 scale and zero per 32 weights
    assert packed_bytes * 8 / w.numel() == 10


@pytest.mark.skipif(not cpu_int4.has_kernel(), reason="torch lacks the CPU int4 kernel")
def test_one_plane_setting_keeps_wider_codes_dense(monkeypatch):
    # SKYLINE_GGUF_CPU_PLANES=1: 5- to 8-bit codes stay dense bf16 (batched decode speed over
    # memory); 4-bit codes still run the kernel
    import skyline.quant.gguf as gguf_method

    monkeypatch.setattr(gguf_method, "MAX_CPU_PLANES", 1)
    method = GGUFLinearMethod()
    wide = _Layer([(Q.Q8_0, blocks(Q.Q8_0, 16, 256, 20))])
    narrow = _Layer([(Q.Q4_1, blocks(Q.Q4_1, 16, 256, 21))])
    odd = _Layer([(Q.Q4_1, blocks(Q.Q4_1, 8, 256, 22))])  # the kernel packs rows in sixteens
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    method.apply(wide, x)
    method.apply(narrow, x)
    method.apply(odd, x)
    assert wide.gguf_int4 is None and wide.gguf_dense.dtype == torch.bfloat16
    assert narrow.gguf_int4 is not None and len(narrow.gguf_int4) == 1
    assert odd.gguf_int4 is None and odd.gguf_dense.dtype == torch.bfloat16


def test_float32_before_any_bfloat16_call_keeps_the_exact_path():
    layer = _Layer([(Q.Q4_1, blocks(Q.Q4_1, 8, 256, 5))])
    method = GGUFLinearMethod()
    x = torch.randn(2, 256)
    torch.testing.assert_close(method.apply(layer, x),
                               F.linear(x, method.dequantized_weight(layer)))
    assert not hasattr(layer, "gguf_int4") and hasattr(layer, "gguf_w0")


def test_other_types_are_dequantized_once_to_bfloat16():
    """A layer that is not all 4-bit group types (here Q4_1 rows merged with Q6_K rows, as a
    Q4_K_M file's qkv can be) becomes dense bfloat16 at its first bfloat16 call, not
    dequantized at every call; float32 inputs before that keep the exact path."""
    layer = _Layer([(Q.Q4_1, blocks(Q.Q4_1, 8, 256, 3)), (Q.Q6_K, blocks(Q.Q6_K, 8, 256, 4))])
    method = GGUFLinearMethod()
    w = method.dequantized_weight(layer)  # exact, from the blocks
    x32 = torch.randn(2, 256)
    torch.testing.assert_close(method.apply(layer, x32), F.linear(x32, w))
    x = x32.to(torch.bfloat16)
    y = method.apply(layer, x)
    assert layer.gguf_int4 is None and layer.gguf_dense.dtype == torch.bfloat16
    assert not hasattr(layer, "gguf_w0") and not hasattr(layer, "gguf_w1")  # dropped
    torch.testing.assert_close(y, F.linear(x, w.to(torch.bfloat16)))
    torch.testing.assert_close(method.dequantized_weight(layer), w.to(torch.bfloat16).float())
