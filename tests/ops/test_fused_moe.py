"""The MoE MLP (ops/moe.py): the grouped-by-expert reference against a per-token loop, the
alignment of pairs into expert blocks, and the Triton grouped GEMMs against the reference over a
sweep of shapes (decode- and prefill-sized batches), weight formats (dense, fp8 per channel and
per block, MXFP4: in the kernel's tiles, or decoded first), biases, both activations and a
partial expert map. Kernels run on CUDA, or in
Triton's interpreter on CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from skyline import envs
from skyline.ops import moe
from skyline.ops.fp4 import dequantize_mxfp4
from skyline.ops.fp8_quant import quantize_rows_fp8_ref
from skyline.ops.moe import (
    ExpertWeights,
    decoded_experts,
    fused_moe,
    fused_moe_ref,
    fused_moe_triton,
    moe_activation_ref,
    moe_align,
)
from skyline.quant.fp4 import quantize_mxfp4

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def routing(t: int, e: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weights, ids = torch.topk(torch.randn(t, e, generator=g).softmax(-1), k)
    return weights, ids


def fmt_weights(w: torch.Tensor, fmt: str, bias: torch.Tensor | None) -> ExpertWeights:
    """Stacked [E, N, K] float weights in `fmt`."""
    e, n, k = w.shape
    rows = w.reshape(e * n, k)
    if fmt == "dense":
        return ExpertWeights(w, bias=bias)
    if fmt == "fp8":  # per output channel
        q, s = quantize_rows_fp8_ref(rows)
        return ExpertWeights(q.view(e, n, k), s.view(e, n), bias, "fp8")
    if fmt == "fp8_block":  # 16 x 32 blocks (the kernel's K tile stays inside one)
        bn, bk = 16, 32
        blocks = w.reshape(e, n // bn, bn, k // bk, bk)
        amax = blocks.abs().amax((2, 4), keepdim=True).clamp(min=1e-12)
        q = (blocks / (amax / 448)).to(torch.float8_e4m3fn).reshape(e, n, k)
        return ExpertWeights(q, (amax / 448).reshape(e, n // bn, k // bk), bias, "fp8")
    codes, scales = quantize_mxfp4(rows)
    return ExpertWeights(codes.view(e, n, k // 2), scales.view(e, n, k // 32), bias, "mxfp4")


def experts(e: int, h: int, i: int, fmt: str, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w13, w2 = torch.randn(e, 2 * i, h, generator=g) * 0.2, torch.randn(e, h, i, generator=g) * 0.2
    b13 = torch.randn(e, 2 * i, generator=g) * 0.1 if bias else None
    b2 = torch.randn(e, h, generator=g) * 0.1 if bias else None
    return fmt_weights(w13, fmt, b13), fmt_weights(w2, fmt, b2)


def on(w: ExpertWeights, dev: str) -> ExpertWeights:
    mv = lambda t: None if t is None else t.to(dev)  # noqa: E731
    return ExpertWeights(w.weight.to(dev), mv(w.scale), mv(w.bias), w.fmt)


def per_token(x, w13, w2, weights, ids, activation, limit):
    """Each token, each of its experts, one at a time."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = F.linear(x[t:t + 1].double(), w13.expert(e, torch.float64),
                         None if w13.bias is None else w13.bias[e].double())
            h = moe_activation_ref(h, activation, limit)
            y = F.linear(h, w2.expert(e, torch.float64),
                         None if w2.bias is None else w2.bias[e].double())
            out[t] += float(weights[t, j]) * y[0]
    return out


@pytest.mark.parametrize("fmt", ["dense", "fp8", "fp8_block", "mxfp4"])
@pytest.mark.parametrize("activation,limit,bias", [("silu", None, False),
                                                    ("swiglu_oai", 0.7, True)])
def test_reference_matches_per_token_loop(fmt, activation, limit, bias):
    w13, w2 = experts(6, 64, 32, fmt, bias)
    weights, ids = routing(9, 6, 2, 1)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(2))
    got = fused_moe_ref(x, w13, w2, weights, ids, activation, limit)
    want = per_token(x, w13, w2, weights, ids, activation, limit)
    assert (got.double() - want).abs().max() < 1e-5


@pytest.mark.parametrize("t,e,k,block_m", [(1, 8, 2, 16), (5, 4, 4, 16), (40, 8, 2, 16),
                                           (13, 16, 3, 4)])
@pytest.mark.parametrize("partial", [False, True])
def test_align_covers_each_pair_once(t, e, k, block_m, partial):
    _, ids = routing(t, e, k, t)
    expert_map = None
    if partial:  # this rank holds experts 1, 3, 5, ... as local 0, 1, 2, ...
        expert_map = torch.full((e,), -1, dtype=torch.int32)
        expert_map[1::2] = torch.arange(e // 2, dtype=torch.int32)
    sorted_ids, block_experts = moe_align(ids, e // 2 if partial else e, block_m, expert_map)
    local = ids.flatten() if expert_map is None else expert_map.long()[ids.flatten()]
    blocks = sorted_ids.view(-1, block_m)
    assert blocks.shape[0] == block_experts.shape[0]
    seen = []
    for b, ex in zip(blocks.tolist(), block_experts.tolist(), strict=True):
        pairs = [p for p in b if p < t * k]
        if ex < 0:
            assert not pairs
            continue
        assert pairs and all(local[p] == ex for p in pairs)  # one expert per block
        seen += pairs
    assert sorted(seen) == [p for p in range(t * k) if local[p] >= 0]
    # experts ascend block by block; a block of padding only ends the list
    used = [x for x in block_experts.tolist() if x >= 0]
    assert used == sorted(used) and block_experts.tolist()[len(used):] == [-1] * (
        len(block_experts) - len(used))


CONFIGS = {
    "decode": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=1),
    "prefill": dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=1),
}


@pytest.mark.parametrize("fmt", ["dense", "fp8", "fp8_block", "mxfp4"])
@pytest.mark.parametrize("t,e,k,h,i,config", [(1, 8, 2, 64, 32, "decode"),
                                              (3, 4, 4, 96, 64, "decode"),
                                              (37, 6, 2, 64, 96, "prefill")])
@pytest.mark.parametrize("activation,bias", [("silu", False), ("swiglu_oai", True)])
@pytest.mark.parametrize("decode", [False, True])
def test_triton_matches_reference(fmt, t, e, k, h, i, config, activation, bias, decode):
    """Each format's tiles decoded in the kernel, and (`decode`) MXFP4 experts decoded to
    the input's dtype first, then the dense kernel (other formats ignore it)."""
    if decode and fmt != "mxfp4":
        pytest.skip("only MXFP4 experts are decoded first")
    w13, w2 = experts(e, h, i, fmt, bias, seed=t)
    weights, ids = routing(t, e, k, t + 1)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(t + 2))
    want = fused_moe_ref(x, w13, w2, weights, ids, activation, 0.7)
    got = fused_moe_triton(x.to(DEV), on(w13, DEV), on(w2, DEV), weights.to(DEV), ids.to(DEV),
                           activation, 0.7, config=CONFIGS[config], decode=decode)
    assert torch.isfinite(got).all()
    assert (got.cpu() - want).norm() / want.norm() < 1e-5


@pytest.mark.parametrize("block", [(32, 128, 4), (64, 256, 8)])
def test_mxfp4_decode_matches_reference(block):
    """The decoding kernel bit-exact against its reference, at gpt-oss-20b's K (2,880: not a
    multiple of the kernel's 128 or 256 columns)."""
    w, _ = experts(4, 2880, 32, "mxfp4", False, seed=7)
    got = decoded_experts(on(w, DEV), torch.float32, block)
    want = dequantize_mxfp4(w.weight.reshape(-1, 1440), w.scale.reshape(-1, 90))
    assert got.fmt == "dense" and got.bias is w.bias
    assert torch.equal(got.weight.reshape(-1, 2880).cpu(), want)


@pytest.mark.parametrize("setting,pairs,decoded", [(-1, 62, False), (-1, 64, True),
                                                   (0, 64, False), (32, 32, True)])
def test_decoded_from_the_threshold(monkeypatch, setting, pairs, decoded):
    """MXFP4 experts are decoded first from DECODE_PAIRS pairs (64 here; SKYLINE_MOE_DECODE_PAIRS
    moves it, 0: never)."""
    monkeypatch.setattr(moe, "DECODE_PAIRS", 64)
    monkeypatch.setattr(envs, "ENV", dataclasses.replace(envs.ENV, moe_decode_pairs=setting))
    calls = []
    real = moe.decoded_experts
    monkeypatch.setattr(moe, "decoded_experts", lambda *a: calls.append(1) or real(*a))
    t, e, k = pairs // 2, 4, 2
    w13, w2 = experts(e, 64, 32, "mxfp4", False)
    weights, ids = routing(t, e, k, 3)
    x = torch.randn(t, 64, generator=torch.Generator().manual_seed(4))
    got = fused_moe_triton(x.to(DEV), on(w13, DEV), on(w2, DEV), weights.to(DEV), ids.to(DEV),
                           config=CONFIGS["prefill"])
    assert len(calls) == (2 if decoded else 0)
    want = fused_moe_ref(x, w13, w2, weights, ids)
    assert (got.cpu() - want).norm() / want.norm() < 1e-5


@pytest.mark.parametrize("fmt,decode", [("dense", None), ("mxfp4", False), ("mxfp4", True)])
def test_expert_map_halves_sum_to_the_whole(fmt, decode):
    """Two ranks of 4 experts each: the sum of their outputs is the 8-expert MoE's (MXFP4
    experts decoded in the kernel's tiles, and first)."""
    w13, w2 = experts(8, 64, 32, fmt, bias=True)
    weights, ids = routing(11, 8, 2, 5)
    x = torch.randn(11, 64, generator=torch.Generator().manual_seed(6))
    whole = fused_moe_ref(x, w13, w2, weights, ids)
    total = torch.zeros_like(whole)
    for first in (0, 4):
        expert_map = torch.full((8,), -1, dtype=torch.int32)
        expert_map[first:first + 4] = torch.arange(4, dtype=torch.int32)
        part = [ExpertWeights(w.weight[first:first + 4], None if w.scale is None else
                              w.scale[first:first + 4], w.bias[first:first + 4], w.fmt)
                for w in (w13, w2)]
        ref = fused_moe_ref(x, *part, weights, ids, expert_map=expert_map)
        got = fused_moe_triton(x.to(DEV), on(part[0], DEV), on(part[1], DEV), weights.to(DEV),
                               ids.to(DEV), expert_map=expert_map.to(DEV),
                               config=CONFIGS["decode"], decode=decode)
        assert (got.cpu() - ref).abs().max() < 1e-5
        total += ref
    assert (total - whole).abs().max() < 1e-5


def test_empty_batch_and_bad_activation():
    w13, w2 = experts(4, 64, 32, "dense", bias=False)
    x = torch.empty(0, 64)
    assert fused_moe(x, w13, w2, torch.empty(0, 2), torch.empty(0, 2, dtype=torch.long)).shape \
        == (0, 64)
    with pytest.raises(ValueError, match="activation"):
        fused_moe(torch.randn(1, 64), w13, w2, *routing(1, 4, 2, 0), activation="gelu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["dense", "fp8", "mxfp4"])
@pytest.mark.parametrize("t", [1, 8, 300])
def test_bf16_model_shapes(fmt, t):
    """Qwen3-30B-A3B's expert shapes (128 experts, 2048 -> 768, top 8) in bf16, default
    configurations."""
    w13, w2 = experts(128, 2048, 768, fmt, bias=False)
    weights, ids = routing(t, 128, 8, t)
    x = torch.randn(t, 2048, generator=torch.Generator().manual_seed(t))
    bf = lambda w: ExpertWeights(  # noqa: E731
        w.weight.bfloat16() if w.fmt == "dense" else w.weight, w.scale, None, w.fmt)
    want = fused_moe_ref(x.bfloat16(), bf(w13), bf(w2), weights, ids).float()
    got = fused_moe(x.bfloat16().cuda(), on(bf(w13), "cuda"), on(bf(w2), "cuda"),
                    weights.cuda(), ids.cuda()).float().cpu()
    assert (got - want).norm() / want.norm() < 2e-2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t", [5, 300])
@pytest.mark.parametrize("decode", [False, True])
def test_mxfp4_gpt_oss_shapes(t, decode):
    """gpt-oss-20b's expert shapes (32 experts, 2880 -> 2880, top 4; K not a multiple of 64)
    in MXFP4 with a bf16 input, with the tuned H200 table's largest tile, decoded in the
    kernel and first."""
    w13, w2 = experts(32, 2880, 2880, "mxfp4", bias=True)
    weights, ids = routing(t, 32, 4, t)
    x = torch.randn(t, 2880, generator=torch.Generator().manual_seed(t)).bfloat16()
    b16 = lambda w: ExpertWeights(w.weight, w.scale, w.bias.bfloat16(), w.fmt)  # noqa: E731
    want = fused_moe_ref(x, b16(w13), b16(w2), weights, ids, "swiglu_oai", 7.0).float()
    config = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3)
    got = fused_moe_triton(x.cuda(), on(b16(w13), "cuda"), on(b16(w2), "cuda"),
                           weights.cuda(), ids.cuda(), "swiglu_oai", 7.0,
                           config=config, decode=decode).float().cpu()
    assert (got - want).norm() / want.norm() < 2e-2
