"""MoE routing (ops/moe_route.py): the one-launch Triton kernel against the PyTorch reference
for every scoring, expert counts that are and are not powers of two, top-k from 1 to 8 and
float32 / bfloat16 logits (Triton's interpreter on the CPU, CUDA where there is one)."""

from __future__ import annotations

import pytest
import torch

from skyline.ops.moe_route import route, route_ref, route_triton
from skyline.ops.triton_utils import triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(triton is None, reason="needs triton")


def check(t: int, e: int, k: int, scoring: str, dtype: torch.dtype, dev: str) -> None:
    g = torch.Generator().manual_seed(t * e + k)
    # distinct values in every dtype (bfloat16 holds these exactly): no ties, whose order
    # torch.topk leaves open
    logits = (torch.stack([torch.randperm(e, generator=g) for _ in range(t)]) / 16 - 3
              ).to(dtype)
    want_w, want_ids = route_ref(logits, k, scoring)
    got_w, got_ids = route_triton(logits.to(dev), k, scoring)
    assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32
    assert torch.equal(got_ids.cpu(), want_ids)
    assert (got_w.cpu() - want_w).abs().max() < 1e-6


@needs_triton
@pytest.mark.parametrize("scoring", ["softmax", "softmax_renorm", "topk_softmax"])
@pytest.mark.parametrize("t,e,k", [(1, 6, 2), (3, 32, 4), (5, 128, 8), (2, 8, 1)])
def test_matches_reference(scoring, t, e, k):
    check(t, e, k, scoring, torch.float32, DEV)


@needs_triton
def test_bfloat16_logits_and_dispatch():
    check(4, 128, 8, "softmax_renorm", torch.bfloat16, DEV)
    logits = torch.randn(2, 16)
    ref = route_ref(logits, 2, "softmax")
    got = route(logits, 2, "softmax")  # the CPU: the reference itself
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    with pytest.raises(ValueError, match="scoring"):
        route(logits, 2, "sigmoid")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scoring", ["softmax_renorm", "topk_softmax"])
def test_model_shapes_cuda(scoring):
    for t in (1, 8, 300):
        check(t, 128, 8, scoring, torch.bfloat16, "cuda")
        check(t, 32, 4, scoring, torch.bfloat16, "cuda")


@needs_triton
@pytest.mark.parametrize("scoring", ["softmax", "topk_softmax"])
def test_a_non_finite_row_still_routes_to_experts_that_exist(scoring):
    # A padding token of a CUDA graph's step (its attention rows are left unwritten) may
    # carry NaN or inf: its expert ids must stay within the experts (an id past them would
    # index past the MoE kernels' buffers); the other rows route as ever.
    logits = torch.randn(4, 6)
    logits[1, 2] = float("nan")
    logits[2] = float("inf")
    logits[3] = float("nan")
    _, ids = route_triton(logits.to(DEV), 2, scoring)
    assert ((ids >= 0) & (ids < 6)).all()
    assert torch.equal(ids[0].cpu(), route_ref(logits[:1], 2, scoring)[1][0])
