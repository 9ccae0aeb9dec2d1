"""The Triton alignment of the MoE's pairs into expert blocks (ops/moe_align.py) against its
PyTorch reference, which it must reproduce exactly (the same pair in every slot): token counts
from decode to prefill sizes, expert counts not powers of two, block sizes, a partial expert map
and experts no pair routes to; several chunks and scan tiles with small CHUNK / SCAN_TILE; the
grouped path with these kernels and the SwiGLU one. Runs on CUDA, or in Triton's interpreter on
CPU, where the kernels are also compiled for sm_90."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from skyline.ops import moe_align as align  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def ids_for(t: int, e: int, k: int, seed: int, skew: bool = False) -> torch.Tensor:
    """[t, k] distinct experts a token; `skew`: half the experts get no pair."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(t, e, generator=g)
    if skew:
        scores[:, e // 2:] -= 2.0
    return torch.topk(scores, k).indices.to(DEV)


def same(ids: torch.Tensor, e: int, block_m: int, expert_map: torch.Tensor | None = None):
    want = align.moe_align_ref(ids, e, block_m, expert_map)
    got = align.moe_align_triton(ids, e, block_m, expert_map)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype == torch.int32 and g.shape == w.shape
        assert torch.equal(g.cpu(), w.cpu())


@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (9, 128, 8), (37, 32, 4), (300, 6, 2),
                                   (64, 129, 8)])
@pytest.mark.parametrize("block_m", [16, 64, 24])
def test_matches_reference(t, e, k, block_m):
    same(ids_for(t, e, k, t + e), e, block_m)


@pytest.mark.parametrize("skew", [False, True])
def test_partial_map_and_idle_experts(skew):
    e = 16  # this rank holds experts 1, 3, 5, ... as local 0, 1, 2, ...
    expert_map = torch.full((e,), -1, dtype=torch.int32)
    expert_map[1::2] = torch.arange(e // 2, dtype=torch.int32)
    ids = ids_for(50, e, 3, 7, skew)
    same(ids, e // 2, 16, expert_map.to(DEV))
    same(ids, e, 16)


def test_many_chunks_and_scan_tiles(monkeypatch):
    # 16-pair chunks scanned two at a time: 1,200 pairs span 75 chunks and 38 tiles
    monkeypatch.setattr(align, "CHUNK", 16)
    monkeypatch.setattr(align, "SCAN_TILE", 2)
    monkeypatch.setattr(align, "BLOCK_B", 4)
    same(ids_for(150, 40, 8, 3), 40, 32)
    same(ids_for(150, 40, 8, 4, skew=True), 40, 16)


def test_dispatch(monkeypatch):
    """The kernels on CUDA, the reference elsewhere and under SKYLINE_UNFUSE=moe_align."""
    import dataclasses

    from skyline import envs

    calls = []
    real = align.moe_align_triton
    monkeypatch.setattr(align, "moe_align_triton", lambda *a: calls.append(1) or real(*a))
    ids = ids_for(5, 8, 2, 1)
    want = align.moe_align_ref(ids, 8, 16)
    for g, w in zip(align.moe_align(ids, 8, 16), want, strict=True):
        assert torch.equal(g, w)
    assert len(calls) == (DEV == "cuda")
    monkeypatch.setattr(envs, "ENV", dataclasses.replace(envs.ENV,
                                                         unfuse=frozenset({"moe_align"})))
    align.moe_align(ids, 8, 16)
    assert len(calls) == (DEV == "cuda")


@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
@pytest.mark.parametrize("partial", [False, True])
def test_grouped_path_with_its_kernels(monkeypatch, activation, partial):
    """fused_moe_triton as CUDA runs it (the alignment and activation kernels, which the CPU's
    dispatch leaves to the references) against the reference, with a partial expert map."""
    from skyline.ops import activation as act
    from skyline.ops import moe
    from tests.ops.test_fused_moe import CONFIGS, experts, on, routing

    monkeypatch.setattr(moe, "moe_align", align.moe_align_triton)
    monkeypatch.setattr(moe, "silu_and_mul", act.silu_and_mul_triton)
    monkeypatch.setattr(moe, "swiglu_oai", act.swiglu_oai_triton)
    e = 8
    w13, w2 = experts(e, 64, 32, "dense", bias=activation == "swiglu_oai")
    weights, ids = routing(21, e, 2, 9)
    x = torch.randn(21, 64, generator=torch.Generator().manual_seed(10))
    expert_map = None
    if partial:  # experts 0-3 here, 4-7 elsewhere: only their pairs count
        expert_map = torch.tensor([0, 1, 2, 3, -1, -1, -1, -1], dtype=torch.int32)
        w13, w2 = (moe.ExpertWeights(w.weight[:4], None, None if w.bias is None else w.bias[:4])
                   for w in (w13, w2))
    want = moe.fused_moe_ref(x, w13, w2, weights, ids, activation, 0.7, expert_map)
    got = moe.fused_moe_triton(x.to(DEV), on(w13, DEV), on(w2, DEV), weights.to(DEV),
                               ids.to(DEV), activation, 0.7,
                               None if expert_map is None else expert_map.to(DEV),
                               config=CONFIGS["prefill"])
    assert (got.cpu() - want).norm() / want.norm() < 1e-5


_COMPILE = """
from skyline.bench.ptx import compile_for_sm90
from skyline.ops import activation as act
from skyline.ops import moe_align as m
i32 = lambda *names: {n: "i32" for n in names}  # noqa: E731
ptr = lambda t, *names: {n: "*" + t for n in names}  # noqa: E731
for kernel, sig, const, warps in [
    (m._counts_kernel, ptr("i64", "ids_ptr") | ptr("i32", "map_ptr", "counts_ptr")
     | i32("num_pairs", "E"), {"HAS_MAP": True, "CHUNK": 128, "E_PAD": 256}, 4),
    (m._offsets_kernel, ptr("i32", "counts_ptr", "offsets_ptr", "totals_ptr")
     | i32("chunks", "E"), {"TILE": 256}, 4),
    (m._blocks_kernel, ptr("i32", "totals_ptr", "starts_ptr", "block_experts_ptr",
                           "sorted_ids_ptr") | i32("blocks", "num_pairs", "E", "block_m"),
     {"E_PAD": 64, "BLOCK_B": 64, "BM_PAD": 32}, 4),
    (m._scatter_kernel, ptr("i64", "ids_ptr", "map_ptr") | ptr("i32", "offsets_ptr",
                                                                "starts_ptr", "sorted_ids_ptr")
     | i32("num_pairs", "E"), {"HAS_MAP": False, "CHUNK": 128}, 8),
    (act._swiglu_oai_kernel, ptr("bf16", "x_ptr", "out_ptr") | i32("d", "stride_x", "stride_o"),
     {"LIMIT": 7.0, "HAS_LIMIT": True, "ALPHA": 1.702, "BLOCK": 1024, "PDL": True}, 4),
]:
    assert "cubin" in compile_for_sm90(kernel, sig, const, [], warps, 1).asm
    print(kernel.fn.__name__)
"""


def test_kernels_compile_for_hopper():
    """CI has no GPU and runs the kernels in Triton's interpreter: here they go through
    Triton's compiler and ptxas for sm_90, as a GPU's first launch would take them."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["_counts_kernel", "_offsets_kernel", "_blocks_kernel",
                                   "_scatter_kernel", "_swiglu_oai_kernel"]
