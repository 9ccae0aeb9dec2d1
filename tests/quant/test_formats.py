"""Encodings against hand-computed values and round trips; each method's matmul against its
dequantized weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from skyline.config import QuantConfig
from skyline.model.layers.linear import Linear, MergedLinear
from skyline.quant import make_linear_method
from skyline.quant.fp4 import (
    decode_e2m1,
    dequantize_mxfp4,
    dequantize_nvfp4,
    encode_e2m1,
    quantize_mxfp4,
    quantize_nvfp4,
)
from skyline.quant.fp8 import quantize_rows_fp8
from skyline.quant.intq import quantize_groups


def test_e2m1_hand_computed():
    x = torch.tensor([0.0, 0.25, 0.3, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 7.0, 100.0,
                      -6.0, -0.75, -2.5])
    # ties go to the even code: 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2, 2.5->2, 3.5->4, 5->4
    want = [0, 0, 1, 2, 2, 4, 4, 6, 6, 7, 7, 7, 8 | 7, 8 | 2, 8 | 4]
    assert encode_e2m1(x).tolist() == want
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0, -1.5, -2.0, -3.0,
                         -4.0, -6.0])
    assert torch.equal(decode_e2m1(encode_e2m1(grid)), grid)  # every E2M1 value round-trips


def test_mxfp4_hand_computed():
    w = torch.zeros(1, 32)
    w[0, :4] = torch.tensor([100.0, -20.0, 7.0, 1.0])
    packed, scales = quantize_mxfp4(w)
    # amax 100: floor(log2 100) = 6, scale 2^(6-2) = 16 -> E8M0 code 127 + 4
    assert scales.tolist() == [[131]]
    # 100/16 = 6.25 -> 6 (96); -20/16 = -1.25 -> tie to -1.0 (-16); 7/16 = 0.4375 -> 0.5 (8);
    # 1/16 -> 0
    got = dequantize_mxfp4(packed, scales)[0, :4].tolist()
    assert got == [96.0, -16.0, 8.0, 0.0]
    assert packed[0, 0].item() == (7 | ((8 | 2) << 4))  # low nibble first
    zero_packed, zero_scales = quantize_mxfp4(torch.zeros(2, 32))
    assert zero_scales.tolist() == [[0], [0]] and not zero_packed.any()


def test_nvfp4_hand_computed():
    w = torch.zeros(2, 16)
    w[0, 0] = 6.0 * 448.0  # tensor amax -> tensor scale exactly 1
    w[1, :3] = torch.tensor([3.0, 1.5, -0.4])
    packed, scales, tensor_scale = quantize_nvfp4(w)
    assert tensor_scale.tolist() == [1.0]
    # row 0: block scale 448; row 1: amax 3 -> block scale 0.5 (exact in E4M3)
    assert scales.float().tolist() == [[448.0], [0.5]]
    deq = dequantize_nvfp4(packed, scales, tensor_scale)
    assert deq[0, 0].item() == 2688.0
    assert deq[1, :3].tolist() == [3.0, 1.5, -0.5]  # -0.4 / 0.5 = -0.8 -> -1.0 code


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_fp4_requantize_is_identity(fmt):
    w = torch.randn(8, 80, generator=torch.Generator().manual_seed(0))
    if fmt == "mxfp4":
        once = dequantize_mxfp4(*quantize_mxfp4(w))[:, :80]
        twice = dequantize_mxfp4(*quantize_mxfp4(once))[:, :80]
    else:
        once = dequantize_nvfp4(*quantize_nvfp4(w))[:, :80]
        twice = dequantize_nvfp4(*quantize_nvfp4(once))[:, :80]
    assert torch.equal(once, twice)  # a decoded tensor is a fixed point
    # MXFP4 saturates values in (6, 8) x scale to 6: errors reach a quarter of the block amax
    assert (once - w).abs().max() <= w.abs().max() / 4


@pytest.mark.parametrize("bits", [4, 8])
def test_int_groups_error_bound(bits):
    w = torch.randn(16, 200, generator=torch.Generator().manual_seed(1))
    codes, scales, zeros = quantize_groups(w, bits, 64)
    assert codes.shape == (16, 256) and scales.shape == zeros.shape == (16, 4)
    assert int(codes.max()) <= 2**bits - 1
    deq = ((codes.float().reshape(16, 4, 64) - zeros.float()[..., None]) * scales[..., None])
    err = (deq.reshape(16, 256)[:, :200] - w).abs().reshape(16, -1)
    assert (err <= scales.repeat_interleave(64, 1)[:, :200] * 0.5 + 1e-6).all()
    assert (deq.reshape(16, 256)[:, 200:] == 0).all()  # padding decodes to exactly 0


def test_int4_clip_search_lowers_weighted_error():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(32, 128, generator=g)
    w[:, 5] *= 8  # outlier weights on channel 5, whose input is nearly silent
    act_sq = torch.ones(128)
    act_sq[5] = 1e-4

    def weighted_err(imp):
        c, s, z = quantize_groups(w, 4, 128, imp)
        deq = (c.float() - z.float()) * s
        return ((deq - w).square() * act_sq).sum()

    assert weighted_err(act_sq) < 0.8 * weighted_err(None)


def test_fp8_rows():
    x = torch.tensor([[448.0 * 2, -1.0, 0.0], [0.0, 0.0, 0.0]])
    q, scale = quantize_rows_fp8(x)
    assert scale.flatten().tolist() == [2.0, 1.0]
    assert q.float().tolist() == [[448.0, -0.5, 0.0], [0.0, 0.0, 0.0]]


@pytest.mark.parametrize("method", ["fp8", "int8", "int4", "mxfp4", "nvfp4"])
def test_method_matmul_matches_dequantized_reference(method):
    torch.manual_seed(3)
    layer = MergedLinear(96, [24, 40], bias=True)
    w = torch.randn(64, 96)
    layer.weight.data.copy_(w)
    layer.bias.data.normal_()
    m = make_linear_method(QuantConfig(method=method, group_size=32))
    layer.linear_method = m
    m.process_weights_after_loading(layer)
    x = torch.randn(5, 96)
    wq = m.dequantized_weight(layer)
    assert wq.shape == (64, 96)
    if method == "fp8":  # activations are quantized too: emulate them here
        xq, xs = quantize_rows_fp8(x)
        ref = F.linear(xq.float() * xs, wq, layer.bias)
    else:
        ref = F.linear(x, wq, layer.bias)
    torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-5)
    rel = ((wq - w).norm() / w.norm()).item()
    assert rel < {"fp8": 0.05, "int8": 0.01, "int4": 0.15, "mxfp4": 0.2, "nvfp4": 0.15}[method]


def test_nvfp4_keeps_one_tensor_scale_per_shard():
    layer = MergedLinear(32, [16, 16])
    w = torch.randn(32, 32)
    w[16:] *= 100  # shard 1 has a much larger range
    layer.weight.data.copy_(w)
    m = make_linear_method(QuantConfig(method="nvfp4"))
    layer.linear_method = m
    m.process_weights_after_loading(layer)
    ts = layer.tensor_scale
    assert ts[:16].unique().numel() == 1 and ts[16:].unique().numel() == 1
    assert ts[16] > 50 * ts[0]


def test_plain_linear_unchanged_without_quant():
    assert make_linear_method(QuantConfig()) is None
    assert isinstance(Linear(4, 4).weight, torch.nn.Parameter)
