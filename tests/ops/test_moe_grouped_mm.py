"""The MoE MLP through torch's grouped GEMM (ops/moe_grouped_mm.py) against the grouped-by-expert
reference: bf16 experts with and without biases, both activations, experts with no pairs, and a
partial expert map (pairs of other ranks' experts contribute nothing). torch._grouped_mm runs on
the CPU too (a loop), so these run everywhere; on a Hopper GPU they run its CUTLASS kernel."""

from __future__ import annotations

import pytest
import torch

from skyline.ops.moe import fused_moe, fused_moe_ref
from skyline.ops.moe_grouped_mm import fused_moe_grouped_mm, grouped_mm_ok
from tests.ops.test_fused_moe import experts, on, routing

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"),
                                reason="torch without _grouped_mm")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def b16(w):
    w.weight = w.weight.bfloat16()
    w.bias = None if w.bias is None else w.bias.bfloat16()
    return on(w, DEV)


@pytest.mark.parametrize("t,e,k", [(1, 4, 2), (37, 8, 2), (300, 16, 4)])
@pytest.mark.parametrize("activation,bias", [("silu", False), ("swiglu_oai", True)])
def test_matches_reference(t, e, k, activation, bias):
    h, i = 64, 32
    w13, w2 = (b16(w) for w in experts(e, h, i, "dense", bias, seed=t))
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


def test_ok_only_for_bf16_dense_on_hopper():
    w13, w2 = (b16(w) for w in experts(4, 64, 32, "dense", False))
    x = torch.zeros(2, 64, dtype=torch.bfloat16, device=DEV)
    hopper = DEV == "cuda" and torch.cuda.get_device_capability() == (9, 0)
    assert grouped_mm_ok(x, w13, w2) == hopper
    assert not grouped_mm_ok(x.float(), w13, w2)
    fp4 = experts(4, 64, 32, "mxfp4", False)
    assert not grouped_mm_ok(x, *(on(w, DEV) for w in fp4))


@pytest.mark.skipif(DEV != "cuda", reason="the dispatch needs CUDA")
def test_fused_moe_takes_it_at_prefill_sizes():
    t, e, k, h, i = 512, 8, 2, 64, 32
    w13, w2 = (b16(w) for w in experts(e, h, i, "dense", False))
    weights, ids = routing(t, e, k, seed=9)
    x = torch.randn(t, h, device=DEV).bfloat16()
    args = (x, w13, w2, weights.to(DEV), ids.to(DEV))
    torch.testing.assert_close(fused_moe(*args).float(), fused_moe_ref(*args).float(),
                               atol=3e-2, rtol=3e-2)
