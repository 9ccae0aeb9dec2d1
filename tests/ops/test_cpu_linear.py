"""The oneDNN-packed CPU linear against F.linear, and the layers that use it."""

from __future__ import annotations

import pytest
import torch

from skyline.model.layers.embedding import LMHead, VocabEmbedding
from skyline.model.layers.linear import Linear, MergedLinear
from skyline.ops import cpu_linear
from skyline.quant.method import (
    PackedLinearMethod,
    UnquantizedLinearMethod,
    prepack,
)

pytestmark = pytest.mark.skipif(not cpu_linear.can_pack(torch.zeros(1, 1)),
                                reason="torch built without oneDNN")

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(96, 64), (130, 72), (7, 200), (1000, 33)])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 17, 300])
def test_packed_linear_matches_reference(dtype, n, k, rows):
    if not cpu_linear.can_pack(torch.zeros(1, 1, dtype=dtype)):
        pytest.skip(f"this CPU has no oneDNN {dtype} products")
    g = torch.Generator().manual_seed(n * 1000 + k + rows)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    x = torch.randn(rows, k, generator=g).to(dtype)
    packed = cpu_linear.pack(w)
    ref = cpu_linear.linear_ref(x.float(), w.float(), b.float())
    got = cpu_linear.packed_linear(x, packed, b)
    assert got.dtype == dtype and got.shape == (rows, n)
    torch.testing.assert_close(got.float(), ref, **TOL[dtype])
    no_bias = cpu_linear.packed_linear(x, packed).float()
    torch.testing.assert_close(no_bias, x.float() @ w.float().t(), **TOL[dtype])


def test_unpack_is_exact_and_shapes_follow_f_linear():
    w = torch.randn(48, 40)
    packed = cpu_linear.pack(w)
    assert packed.is_mkldnn and torch.equal(cpu_linear.unpack(packed), w)
    x = torch.randn(2, 3, 5, 40)  # any leading dims
    torch.testing.assert_close(cpu_linear.packed_linear(x, packed), x @ w.t())
    strided = torch.randn(6, 40)[::2]  # rows not contiguous
    torch.testing.assert_close(cpu_linear.packed_linear(strided, packed), strided @ w.t())
    empty = cpu_linear.packed_linear(torch.empty(0, 40), packed)
    assert empty.shape == (0, 48)


def test_bf16_packs_only_where_the_cpu_has_it():
    # A CPU without AVX-512 BF16 / AVX-NE-CONVERT: bf16 weights stay plain (prepack skips them)
    # rather than fail when the engine starts.
    bf16 = torch.zeros(4, 4, dtype=torch.bfloat16)
    assert cpu_linear.can_pack(bf16) == torch.ops.mkldnn._is_mkldnn_bf16_supported()


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="can_pack"):
        cpu_linear.pack(torch.zeros(4, 4, dtype=torch.float16))
    packed = cpu_linear.pack(torch.zeros(4, 8))
    with pytest.raises(ValueError, match="does not match"):
        cpu_linear.packed_linear(torch.zeros(2, 7), packed)
    with pytest.raises(ValueError, match="does not match"):
        cpu_linear.packed_linear(torch.zeros(2, 8, dtype=torch.bfloat16), packed)


def test_prepack_swaps_the_layer_and_keeps_its_product():
    layer = MergedLinear(40, [24, 24], bias=True)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    x = torch.randn(5, 40)
    want = layer(x)
    dense = layer.weight.data.clone()
    assert prepack(layer)
    assert isinstance(layer.linear_method, PackedLinearMethod)
    assert "weight" not in dict(layer.named_parameters())  # no second copy in memory
    torch.testing.assert_close(layer(x), want)
    assert torch.equal(layer.full_weight(), dense)
    assert not prepack(layer)  # already packed


def test_prepack_leaves_other_layouts_alone():
    half = Linear(16, 8)
    half.weight.data = half.weight.data.half()
    assert not prepack(half) and isinstance(half.linear_method, UnquantizedLinearMethod)


def test_lm_head_packs_a_copy_and_keeps_the_tied_embedding():
    embed = VocabEmbedding(100, 32)
    embed.weight.data.normal_()
    head = LMHead(100, 32, tie_to=embed)
    h = torch.randn(3, 32)
    want = head(h)
    assert head.prepack()
    got = head(h)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want)
    assert head.weight is embed.weight  # the embedding still reads the dense rows


def test_exact_near_max_breaks_rounding_ties_as_float32_would():
    """Logits 16.0 and 16.0625 round to the same bfloat16 value (a step is 0.125 there): the
    rounded head's argmax is the lower index; recomputed near the maximum it is float32's, and
    the recomputed entries hold float32's values."""
    torch.manual_seed(0)
    k, v = 64, 500
    x = torch.ones(3, k, dtype=torch.bfloat16)
    w = (torch.randn(v, k) * 0.02).to(torch.bfloat16)
    w[7] = 0.25  # 16.0
    w[300] = 0.25
    w[300, 0] = 0.3125  # 16.0625
    ref = x.float() @ w.float().t()
    rounded = (x @ w.t()).float()
    assert rounded[0, 7] == rounded[0, 300] and rounded[0].argmax() == 7 != ref[0].argmax()
    out = cpu_linear.exact_near_max(rounded.clone(), x, w)
    assert (out.argmax(-1) == 300).all()
    near = out != rounded
    assert near.any() and near.sum() <= 3 * 64
    torch.testing.assert_close(out[near], ref[near], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, ref, atol=0.07, rtol=0)  # the rest: within half a step


def test_exact_near_max_leaves_float32_and_degenerate_rows():
    x = torch.randn(2, 16)
    logits = torch.randn(2, 40)
    assert cpu_linear.exact_near_max(logits, x, torch.randn(40, 16)) is logits
    flat = torch.zeros(2, 40)
    w = torch.zeros(40, 16, dtype=torch.bfloat16)
    out = cpu_linear.exact_near_max(flat.clone(), x.bfloat16(), w, limit_per_row=8)
    assert torch.equal(out, flat)  # 40 equal entries per row: a zero model, left alone


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_native_near_top_is_the_reference(x_dtype):
    """csrc's near_top_ (one call) against recompute_near_top_ref (six operations): the same
    entries recomputed, to float32's sums in another order; a degenerate batch left alone."""
    from skyline.ops import cpu_ext

    if not cpu_ext.available():
        pytest.skip("skyline's CPU operations do not build here")
    torch.manual_seed(2)
    x = torch.randn(3, 96).to(x_dtype)
    w = torch.randn(700, 96).bfloat16()
    logits = (x.float() @ w.float().t()) + torch.randn(3, 700) * 0.5  # an approximate head
    for margin, rel in ((8.0, 0.0), (1e-6, 2 * torch.finfo(torch.bfloat16).eps)):
        got = logits.clone()
        torch.ops.skyline_cpu.near_top_(got, x, w, margin, rel, 1024)
        top = logits.amax(-1, keepdim=True)
        want = cpu_linear.recompute_near_top_ref(logits.clone(), x, w, top.abs() * rel + margin,
                                                 1024)
        assert torch.equal(got != logits, want != logits) and (got != logits).any()
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    flat = torch.zeros(3, 700)
    torch.ops.skyline_cpu.near_top_(flat, x, w, 8.0, 0.0, 16)
    assert not flat.any()


def test_head_on_the_cpu_answers_as_float32_at_near_ties():
    head = LMHead(500, 64)
    torch.manual_seed(1)
    w = torch.randn(500, 64) * 0.05
    w[9], w[400] = 0.25, 0.25
    w[400, 0] = 0.3125  # 16.0625 against 16.0: one bfloat16 value
    head.weight.data = w.to(torch.bfloat16)
    xb = torch.ones(1, 64, dtype=torch.bfloat16)
    assert (xb @ head.weight.data.t()).float().argmax(-1).item() == 9
    ref = (xb.float() @ head.weight.data.float().t()).argmax(-1)
    assert ref.item() == 400 and head(xb).argmax(-1).item() == 400
    if head.prepack():
        assert head(xb).argmax(-1).item() == ref.item()
