"""The MoE MLP through torch's grouped GEMM (ops/moe_grouped_mm.py) against the grouped-by-expert
reference: bf16 and MXFP4 experts (decoded by the Triton kernel, in its interpreter on a CPU)
with and without biases, both activations, experts with no pairs, and a partial expert map
(pairs of other ranks' experts contribute nothing). torch._grouped_mm runs on the CPU too (a
loop), so these run everywhere; on a Hopper GPU they run its CUTLASS kernel."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from skyline import envs
from skyline.ops.fp4 import dequantize_mxfp4
from skyline.ops.moe import fused_moe, fused_moe_ref
from skyline.ops.moe_grouped_mm import MIN_PAIRS, bf16_experts, fused_moe_grouped_mm, grouped_mm_ok
from tests.ops.test_fused_moe import experts, on, routing

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"),
                                reason="torch without _grouped_mm")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def b16(w):
    if w.fmt == "dense":
        w.weight = w.weight.bfloat16()
    w.bias = None if w.bias is None else w.bias.bfloat16()
    return on(w, DEV)


@pytest.mark.parametrize("t,e,k", [(1, 4, 2), (37, 8, 2), (300, 16, 4)])
@pytest.mark.parametrize("activation,bias,fmt", [("silu", False, "dense"),
                                                 ("swiglu_oai", True, "dense"),
                                                 ("swiglu_oai", True, "mxfp4")])
def test_matches_reference(t, e, k, activation, bias, fmt):
    h, i = 64, 32
    w13, w2 = (b16(w) for w in experts(e, h, i, fmt, bias, seed=t))
    weights, ids = routing(t, e, k, seed=t)
    x = (torch.randn(t, h, generator=torch.Generator().manual_seed(1)) * 0.5).bfloat16().to(DEV)
    limit = 7.0 if activation == "swiglu_oai" else None
    args = (x, w13, w2, weights.to(DEV), ids.to(DEV), activation, limit)
    want = fused_moe_ref(*args).float()
    got = fused_moe_grouped_mm(*args).float()
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


def test_idle_experts_and_expert_map():
    # 16 experts, the pairs on four of them; this rank holds the even half
    t, e, k, h, i = 64, 16, 2, 64, 32
    w13, w2 = (b16(w) for w in experts(e, h, i, "dense", True, seed=3))
    weights, _ = routing(t, e, k, seed=3)
    ids = torch.randint(0, 4, (t, k), generator=torch.Generator().manual_seed(4))
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(5)).bfloat16().to(DEV)
    expert_map = torch.full((e,), -1, dtype=torch.int32)
    expert_map[0::2] = torch.arange(e // 2, dtype=torch.int32)
    local13, local2 = (type(w)(w.weight[0::2], None, w.bias[0::2], "dense") for w in (w13, w2))
    for emap, w in ((None, (w13, w2)), (expert_map.to(DEV), (local13, local2))):
        args = (x, *w, weights.to(DEV), ids.to(DEV), "silu", None, emap)
        got = fused_moe_grouped_mm(*args).float()
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, fused_moe_ref(*args).float(), atol=3e-2, rtol=3e-2)


def test_mxfp4_decode_matches_reference():
    # 40 rows of 2880 columns (gpt-oss-20b's K, not a multiple of the kernel's 128)
    w, _ = experts(4, 2880, 32, "mxfp4", False, seed=7)
    w = on(w, DEV)
    got = bf16_experts(w, torch.float32)
    want = dequantize_mxfp4(w.weight.reshape(-1, 1440), w.scale.reshape(-1, 90))
    assert torch.equal(got.reshape(-1, 2880), want)


def test_ok_for_bf16_dense_and_mxfp4_on_hopper():
    dense = [b16(w) for w in experts(4, 64, 32, "dense", False)]
    fp4 = [on(w, DEV) for w in experts(4, 64, 32, "mxfp4", False)]
    fp8 = [on(w, DEV) for w in experts(4, 64, 32, "fp8", False)]
    x = torch.zeros(2, 64, dtype=torch.bfloat16, device=DEV)
    hopper = DEV == "cuda" and torch.cuda.get_device_capability() == (9, 0)
    assert grouped_mm_ok(x, *dense) == hopper
    assert grouped_mm_ok(x, *fp4, MIN_PAIRS["mxfp4"]) == hopper
    assert not grouped_mm_ok(x, *fp4, MIN_PAIRS["mxfp4"] - 1)
    assert not grouped_mm_ok(x.float(), *dense)
    assert not grouped_mm_ok(x, *fp8)


@pytest.mark.cuda
@pytest.mark.skipif(DEV != "cuda", reason="the dispatch needs CUDA")
@pytest.mark.parametrize("enabled", [False, True])
def test_fused_moe_takes_it_when_enabled(monkeypatch, enabled):
    from skyline.ops import moe_grouped_mm

    monkeypatch.setattr(envs, "ENV", dataclasses.replace(envs.ENV, moe_grouped_mm=enabled))
    calls = []
    real = moe_grouped_mm.fused_moe_grouped_mm
    monkeypatch.setattr(moe_grouped_mm, "fused_moe_grouped_mm",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    t, e, k, h, i = 512, 8, 2, 64, 32
    w13, w2 = (b16(w) for w in experts(e, h, i, "dense", False))
    weights, ids = routing(t, e, k, seed=9)
    x = torch.randn(t, h, device=DEV).bfloat16()
    args = (x, w13, w2, weights.to(DEV), ids.to(DEV))
    torch.testing.assert_close(fused_moe(*args).float(), fused_moe_ref(*args).float(),
                               atol=3e-2, rtol=3e-2)
    assert bool(calls) == (enabled and grouped_mm_ok(x, w13, w2, t * k))


@pytest.mark.cuda
@pytest.mark.skipif(DEV != "cuda" or torch.cuda.get_device_capability() != (9, 0),
                    reason="the CUTLASS grouped GEMM needs a Hopper GPU")
@pytest.mark.parametrize("fmt", ["dense", "mxfp4"])
def test_captured_in_a_cuda_graph(fmt):
    """Captured once, replayed on new routes: the offsets live on the device (no host sync)."""
    t, e, k, h, i = 512, 8, 4, 128, 64
    w13, w2 = (b16(w) for w in experts(e, h, i, fmt, True))
    x = torch.randn(t, h, device=DEV).bfloat16()
    weights, ids = (r.to(DEV) for r in routing(t, e, k, seed=1))
    fused_moe_grouped_mm(x, w13, w2, weights, ids, "swiglu_oai", 7.0)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_grouped_mm(x, w13, w2, weights, ids, "swiglu_oai", 7.0)
    new_w, new_ids = routing(t, e, k, seed=2)
    weights.copy_(new_w)
    ids.copy_(new_ids)
    graph.replay()
    want = fused_moe_ref(x, w13, w2, weights, ids, "swiglu_oai", 7.0).float()
    torch.testing.assert_close(out.float(), want, atol=3e-2, rtol=3e-2)
