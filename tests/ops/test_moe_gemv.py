"""The MoE decode GEMVs (ops/moe_gemv.py) against ops/moe.py's reference: every weight format
(dense, fp8 per channel and per block, MXFP4 in the float and the integer mode), both
activations with biases, an expert map with experts of other ranks, and 1..MAX_TOKENS tokens.
Kernels run on CUDA, or in Triton's interpreter on the CPU (tiny shapes: the interpreter runs
each program in Python)."""

from __future__ import annotations

import functools

import pytest
import torch
from test_fused_moe import DEV, experts, on, routing

from skyline.ops import moe_gemv
from skyline.ops.moe import ExpertWeights, fused_moe, fused_moe_ref
from skyline.ops.moe_gemv import A8_MAX_TOKENS, MAX_TOKENS, fused_moe_gemv, gemv_ok
from skyline.ops.tuning import dtype_name

# BLOCK_K 32 over K 64 or 48 (masked tail): two K tiles; BLOCK_N below N: several N tiles
SMALL = (dict(BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=1),
         dict(BLOCK_N=8, BLOCK_K=32, num_warps=4, num_stages=1))


def run(x, w13, w2, weights, ids, activation="silu", limit=None, expert_map=None,
        configs=SMALL):
    mv = (lambda t: None if t is None else t.to(DEV))  # noqa: E731
    return fused_moe_gemv(x.to(DEV), on(w13, DEV), on(w2, DEV), weights.to(DEV), ids.to(DEV),
                          activation, limit, mv(expert_map), configs).cpu()


@pytest.mark.parametrize("fmt", ["dense", "fp8", "fp8_block", "mxfp4"])
@pytest.mark.parametrize("activation,limit,bias", [("silu", None, False),
                                                    ("swiglu_oai", 0.7, True)])
@pytest.mark.parametrize("t", [1, 3])
def test_matches_reference(fmt, activation, limit, bias, t):
    w13, w2 = experts(6, 64, 32, fmt, bias, seed=t)
    weights, ids = routing(t, 6, 2, t + 1)
    x = torch.randn(t, 64, generator=torch.Generator().manual_seed(t))
    want = fused_moe_ref(x, w13, w2, weights, ids, activation, limit)
    # the K loop unrolled at one token, a loop at three
    configs = tuple(c | {"UNROLL": t == 1} for c in SMALL)
    got = run(x, w13, w2, weights, ids, activation, limit, configs=configs)
    assert torch.isfinite(got).all()
    assert (got - want).norm() / want.norm() < 1e-5


@pytest.mark.parametrize("t", range(1, MAX_TOKENS + 1))
def test_every_token_count_with_a_partial_expert_map(t, monkeypatch):
    """This rank holds experts 1, 3, 5 of 6 (local 0, 1, 2): the other pairs add nothing, and
    h's rows they leave unwritten (NaN here) never reach the output. Top-3, K = 48 (a masked
    K tail), dense for most counts and MXFP4 for some."""
    fmt = "mxfp4" if t in (2, 7) else "dense"
    h = 64 if fmt == "mxfp4" else 48
    w13, w2 = experts(6, h, 32, fmt, bias=True, seed=t)
    expert_map = torch.full((6,), -1, dtype=torch.int32)
    expert_map[1::2] = torch.arange(3, dtype=torch.int32)
    part = [ExpertWeights(w.weight[1::2], None if w.scale is None else w.scale[1::2],
                          w.bias[1::2], w.fmt) for w in (w13, w2)]
    weights, ids = routing(t, 6, 3, 10 + t)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(t))
    want = fused_moe_ref(x, *part, weights, ids, "swiglu_oai", 0.7, expert_map)
    real_empty = torch.empty  # the kernel's buffers start as NaN: unwritten rows stay unread
    monkeypatch.setattr(moe_gemv.torch, "empty",
                        lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    got = run(x, *part, weights, ids, "swiglu_oai", 0.7, expert_map)
    monkeypatch.undo()
    assert (got - want).abs().max() < 1e-5


@pytest.mark.parametrize("activation,limit,bias,t,block_k", [("silu", None, False, 1, 64),
                                                              ("swiglu_oai", 0.7, True, 3, 128)])
def test_integer_mode_matches_the_rounding_reference(activation, limit, bias, t, block_k):
    """MXFP4 with fp16 activations in the integer mode (x and h rounded to int8 per 32 columns,
    `dp4a`): against the reference that rounds them the same way; K 96 (tiles of 64 and 128:
    a masked tail), BLOCK_N below N, and a rank holding half of the experts (the other pairs
    read nothing and add nothing)."""
    w13, w2 = experts(6, 96, 64, "mxfp4", bias, seed=t)
    expert_map = torch.full((6,), -1, dtype=torch.int32)
    expert_map[::2] = torch.arange(3, dtype=torch.int32)
    part = [ExpertWeights(w.weight[::2], w.scale[::2],
                          None if w.bias is None else w.bias[::2], w.fmt) for w in (w13, w2)]
    weights, ids = routing(t, 6, 3, 20 + t)
    x = torch.randn(t, 96, generator=torch.Generator().manual_seed(t)).half()
    a8 = dict(A8=True, BLOCK_K=block_k, num_warps=1, num_stages=1)
    configs = (a8 | {"BLOCK_N": 16}, a8 | {"BLOCK_N": 32})  # few programs: the interpreter
    for emap, ws in ((None, (w13, w2)), (expert_map, part)):
        want = fused_moe_ref(x, *ws, weights, ids, activation, limit, emap, a8=True)
        plain = fused_moe_ref(x.float(), *ws, weights, ids, activation, limit, emap)
        got = run(x, *ws, weights, ids, activation, limit, emap, configs)
        assert got.dtype == want.dtype == torch.float16 and torch.isfinite(got).all()
        got, want = got.float(), want.float()
        err = ((got - want).norm() / want.norm()).item()
        assert err < 2e-3, err
        # the rounding is visible: the reference without it is further away
        assert ((got - plain).norm() / plain.norm()).item() > 2 * err
    with pytest.raises(ValueError, match="integer mode"):
        run(x.float(), w13, w2, weights, ids, configs=configs)  # float32 activations


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_default_configs_and_dispatch(fmt):
    """The default (untuned) configurations at a shape whose K the tile does not divide (K 96:
    a tile of 128, its last quarter masked; for MXFP4 a masked scale group), and fused_moe's
    dispatch: this path for 1..MAX_TOKENS tokens on a device Triton runs on."""
    w13, w2 = experts(4, 96, 48 if fmt == "fp8" else 64, fmt, bias=False)
    weights, ids = routing(2, 4, 2, 3)
    x = torch.randn(2, 96, generator=torch.Generator().manual_seed(3))
    want = fused_moe_ref(x, w13, w2, weights, ids)
    got = run(x, w13, w2, weights, ids, configs=None)
    assert (got - want).norm() / want.norm() < 1e-5
    assert gemv_ok(x, w13, w2) and not gemv_ok(torch.randn(MAX_TOKENS + 1, 96), w13, w2)
    # MXFP4's integer mode (16-bit activations) keeps this path to A8_MAX_TOKENS
    wide = A8_MAX_TOKENS if fmt == "mxfp4" else MAX_TOKENS
    assert gemv_ok(torch.randn(wide, 96).half(), w13, w2)
    assert not gemv_ok(torch.randn(wide + 1, 96).half(), w13, w2)
    with pytest.raises(ValueError, match="1..8 tokens"):
        fused_moe_gemv(torch.randn(9, 96), w13, w2, *routing(9, 4, 2, 0))
    if fmt == "fp8":  # 32-row scale blocks: the up rows (from row 48) would split one
        assert not gemv_ok(x, ExpertWeights(w13.weight, torch.ones(4, 3, 3), None, "fp8"), w2)
        strided = ExpertWeights(w2.weight.transpose(1, 2).contiguous().transpose(1, 2),
                                w2.scale, None, "fp8")
        assert not gemv_ok(x, w13, strided)  # rows not contiguous along K: the grouped path


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["dense", "fp8", "mxfp4"])
@pytest.mark.parametrize("t", [1, 2, 5, 8, 24])  # 24: MXFP4's integer-mode GEMVs, else grouped
def test_model_shapes_cuda(fmt, t):
    """Qwen3-30B-A3B's experts (128, 2048 -> 768, top 8) and gpt-oss-20b's (32, 2880 -> 2880,
    top 4, swiglu with biases) in bf16 through fused_moe's dispatch, default configs."""
    for e, hid, inter, k, act, bias in ((128, 2048, 768, 8, "silu", False),
                                        (32, 2880, 2880, 4, "swiglu_oai", True)):
        w13, w2 = experts(e, hid, inter, fmt, bias)
        weights, ids = routing(t, e, k, t)
        x = torch.randn(t, hid, generator=torch.Generator().manual_seed(t)).bfloat16()
        bf = lambda w: ExpertWeights(  # noqa: E731
            w.weight.bfloat16() if w.fmt == "dense" else w.weight, w.scale,
            None if w.bias is None else w.bias.bfloat16(), w.fmt)
        limit = 7.0 if act == "swiglu_oai" else None
        want = fused_moe_ref(x, bf(w13), bf(w2), weights, ids, act, limit).float()
        got = fused_moe(x.cuda(), on(bf(w13), "cuda"), on(bf(w2), "cuda"), weights.cuda(),
                        ids.cuda(), act, limit).float().cpu()
        assert (got - want).norm() / want.norm() < 2e-2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_capture():
    """Captured into a CUDA graph and replayed on new routing: no host sync inside."""
    w13, w2 = (on(w, "cuda") for w in experts(16, 256, 128, "dense", bias=False))
    weights, ids = (a.cuda() for a in routing(1, 16, 4, 0))
    x = torch.randn(1, 256, device="cuda")
    fused_moe(x, w13, w2, weights, ids)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids)
    new_w, new_ids = routing(1, 16, 4, 1)
    weights.copy_(new_w)
    ids.copy_(new_ids)
    x.normal_()
    graph.replay()
    want = fused_moe_ref(x.cpu(), on(w13, "cpu"), on(w2, "cpu"), new_w, new_ids)
    assert (out.cpu() - want).norm() / want.norm() < 1e-4


def test_a_token_count_without_an_entry_takes_the_nearest_fewer_tuned(monkeypatch):
    """A program's work is the same at any token count: t8 without an entry takes t4's, else
    t1's; a shape with none keeps the default; an entry of the other mode (A8: MXFP4's
    integer mode, the default for 16-bit activations) is passed over."""
    bf, f32 = dtype_name(torch.bfloat16), dtype_name(torch.float32)
    stored = {f"n64:k32:mxfp4:{bf}:t1": {"A8": True, "BLOCK_N": 8},
              f"n64:k32:mxfp4:{bf}:t4": {"A8": True, "BLOCK_N": 32},
              f"n64:k32:mxfp4:{f32}:t1": {"A8": True, "BLOCK_N": 2},
              f"n64:k32:mxfp4:{f32}:t2": {"BLOCK_N": 64}}
    monkeypatch.setattr(moe_gemv, "get_config",
                        lambda kernel, key, default: {**default, **stored.get(key, {})})
    moe_gemv._config.cache_clear()
    try:
        up = functools.partial(moe_gemv._config, "moe_gemv_up", 64, 32, "mxfp4", torch.bfloat16)
        assert up(1)["BLOCK_N"] == 8 and up(2)["BLOCK_N"] == 8
        assert up(4)["BLOCK_N"] == 32 and up(8)["BLOCK_N"] == 32 and up(8)["A8"]
        assert up(8)["num_warps"] == moe_gemv.default_config("moe_gemv_up", 8, 32,
                                                              "mxfp4")["num_warps"]
        other = moe_gemv._config("moe_gemv_up", 128, 32, "mxfp4", torch.bfloat16, 8)
        assert other == moe_gemv.default_config("moe_gemv_up", 8, 32, "mxfp4")
        fp32 = functools.partial(moe_gemv._config, "moe_gemv_up", 64, 32, "mxfp4",
                                 torch.float32)
        assert fp32(1) == moe_gemv.default_config("moe_gemv_up", 1, 32, "mxfp4", torch.float32)
        assert not fp32(1)["A8"] and fp32(2)["BLOCK_N"] == 64 and fp32(8)["BLOCK_N"] == 64
    finally:
        moe_gemv._config.cache_clear()
