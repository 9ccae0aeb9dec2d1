"""MoE routing from the router's logits: each token's top-k experts and their weights, with the
architecture's normalization ("softmax": the top-k of the softmax over all experts, Qwen3-MoE;
"softmax_renorm": those renormalized to sum to 1, Mixtral and Qwen3-MoE with norm_topk_prob;
"topk_softmax": a softmax over the top-k logits, gpt-oss).

`route_ref` is the PyTorch reference (and the CPU path): a float32 softmax, torch.topk and a
division, five or six kernels on a GPU. At batch-1 decode each of those is a launch of a few
microseconds on a few hundred values, in every MoE layer; `route` does it in one Triton launch
on CUDA (one program per token: the softmax over its E logits, then k rounds of argmax, each
masking the expert it picked), which CUDA graphs capture (no host sync).
"""

from __future__ import annotations

import torch

from skyline import envs
from skyline.ops.triton_utils import tl, triton

SCORINGS = ("softmax", "softmax_renorm", "topk_softmax")
MAX_EXPERTS = 1024  # one program holds a token's logits in registers


def route_ref(logits: torch.Tensor, top_k: int, scoring: str
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64), best first."""
    if scoring == "topk_softmax":
        top, ids = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(top.float(), dim=-1), ids
    weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
    if scoring == "softmax_renorm":
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def route(logits: torch.Tensor, top_k: int, scoring: str
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """route_ref's contract; one Triton launch for 2-D logits on CUDA."""
    if scoring not in SCORINGS:
        raise ValueError(f"unknown router scoring {scoring!r}; expected one of {SCORINGS}")
    if (triton is None or not logits.is_cuda or logits.dim() != 2 or logits.shape[0] == 0
            or not top_k <= logits.shape[1] <= MAX_EXPERTS
            or "moe_route" in envs.ENV.unfuse):  # (the modular form, to measure the fusion)
        return route_ref(logits, top_k, scoring)
    return route_triton(logits, top_k, scoring)


def route_triton(logits: torch.Tensor, top_k: int, scoring: str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel behind `route` (any device Triton runs on)."""
    t, e = logits.shape
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    _route_kernel[(t,)](
        logits, weights, ids, logits.stride(0), logits.stride(1), E=e, TOP_K=top_k,
        SCORING=SCORINGS.index(scoring), BLOCK_E=triton.next_power_of_2(e),
        BLOCK_K=triton.next_power_of_2(top_k), num_warps=1 if e <= 256 else 4,
    )
    return weights, ids


if triton is not None:

    @triton.jit
    def _route_kernel(logits_ptr, w_ptr, ids_ptr, stride_t, stride_e, E: tl.constexpr,
                      TOP_K: tl.constexpr, SCORING: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_K: tl.constexpr):
        # SCORING 0 softmax, 1 softmax_renorm, 2 topk_softmax. Experts past E read -inf: they
        # weigh 0 in the softmax and are never picked (TOP_K <= E).
        t = tl.program_id(0)
        e = tl.arange(0, BLOCK_E)
        score = tl.load(logits_ptr + t.to(tl.int64) * stride_t + e * stride_e, mask=e < E,
                        other=float("-inf")).to(tl.float32)
        if SCORING != 2:
            score = tl.exp(score - tl.max(score, axis=0))
            score = score / tl.sum(score, axis=0)
        j = tl.arange(0, BLOCK_K)
        top = tl.zeros((BLOCK_K,), dtype=tl.float32)
        ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
        for r in tl.static_range(TOP_K):  # best first, as torch.topk orders them
            best = tl.max(score, axis=0)
            # the lowest index holding the maximum; a row of NaN (a padding token's garbage
            # in a CUDA graph's step) holds none: an expert that exists, never BLOCK_E
            pick = tl.minimum(tl.min(tl.where(score == best, e, BLOCK_E), axis=0), E - 1)
            top = tl.where(j == r, best, top)
            ids = tl.where(j == r, pick, ids)
            score = tl.where(e == pick, float("-inf"), score)
        if SCORING == 1:
            top = top / tl.sum(tl.where(j < TOP_K, top, 0.0), axis=0)
        if SCORING == 2:
            top = tl.where(j < TOP_K, top, float("-inf"))
            top = tl.exp(top - tl.max(top, axis=0))
            top = top / tl.sum(top, axis=0)
        out = t.to(tl.int64) * TOP_K + j
        tl.store(w_ptr + out, top, mask=j < TOP_K)
        tl.store(ids_ptr + out, ids.to(tl.int64), mask=j < TOP_K)
