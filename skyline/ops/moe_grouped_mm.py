"""The MoE MLP at prefill sizes through torch's grouped GEMM (`torch._grouped_mm`: CUTLASS on
Hopper, a loop elsewhere): the (token, expert) pairs sorted by expert, their rows gathered, one
grouped product per projection with each expert's rows delimited by device offsets (no host
sync: CUDA graphs capture it), the activation, the routing weights, and each token's k rows put
back in place and summed. ops/moe.py's fused_moe_ref is the reference. With
SKYLINE_MOE_GROUPED_MM=1 (off by default until measured on a GPU: envs.py) `fused_moe` takes
this path for bf16 experts, and for MXFP4 experts at sizes where decoding all of a layer's
experts to bf16 first (one pass at the copy rate, ops/moe_triton.py's dequant_mxfp4_kernel)
should cost less than the Triton kernel's decoding in its K loop (`grouped_mm_ok`). fp8
experts stay on the Triton kernel."""

from __future__ import annotations

import torch

from skyline.ops.fp4 import dequantize_mxfp4
from skyline.ops.moe import ExpertWeights, moe_activation_ref, sort_pairs
from skyline.ops.triton_utils import interpreted, triton

# Fewer (token, expert) pairs than these stay on the Triton grouped GEMM. Estimates, not yet
# measured: bench/kernels/moe_grouped_speed.py times both paths at 256-4,096 tokens
MIN_PAIRS = {"dense": 256, "mxfp4": 1024}

# CUTLASS's grouped GEMM wants 16-byte aligned rows: dimensions a multiple of 8 bf16 values
_ALIGN = 8


def grouped_mm_ok(x: torch.Tensor, w13: ExpertWeights, w2: ExpertWeights,
                  num_pairs: int | None = None) -> bool:
    """Whether `fused_moe_grouped_mm` runs this call: bf16 activations, dense bf16 or MXFP4
    experts of aligned shapes and at least their format's MIN_PAIRS pairs (when `num_pairs` is
    given), on a GPU of compute capability 9.0 (the grouped GEMM's CUTLASS kernel)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != torch.bfloat16:
        return False
    fmt = w13.fmt
    if w2.fmt != fmt or fmt not in MIN_PAIRS or (num_pairs is not None
                                                 and num_pairs < MIN_PAIRS[fmt]):
        return False
    if fmt == "dense" and any(w.weight.dtype != torch.bfloat16 for w in (w13, w2)):
        return False
    if any(d % _ALIGN for d in (w13.n, w13.k, w2.n, w2.k)):
        return False
    return x.is_cuda and torch.cuda.get_device_capability(x.device) == (9, 0)


def fused_moe_grouped_mm(
    x: torch.Tensor,  # [T, K]
    w13: ExpertWeights,  # dense [E, 2I, K]: gate then up
    w2: ExpertWeights,  # dense [E, K, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k] global expert ids
    activation: str = "silu",
    limit: float | None = None,
    expert_map: torch.Tensor | None = None,  # [E_global] -> local index or -1
) -> torch.Tensor:  # [T, K] in x's dtype
    """fused_moe_ref's contract with two grouped GEMMs over the pairs sorted by expert."""
    t, top_k = topk_ids.shape
    num_experts = w13.num_experts
    order, sorted_key, counts = sort_pairs(topk_ids, num_experts, expert_map)
    offs = torch.cumsum(counts, 0).to(torch.int32)  # each expert's rows end here
    expert = sorted_key.clamp(max=num_experts - 1)
    h = torch._grouped_mm(x[order // top_k], bf16_experts(w13, x.dtype).transpose(1, 2),
                          offs=offs)
    if w13.bias is not None:
        h += w13.bias[expert]
    h = moe_activation_ref(h, activation, limit)
    y = torch._grouped_mm(h, bf16_experts(w2, x.dtype).transpose(1, 2), offs=offs)
    del h
    if w2.bias is not None:
        y += w2.bias[expert]
    route = topk_weights.flatten()[order].float()
    if expert_map is not None:  # rows past the last offset are not written: zero them
        y = torch.where((sorted_key < num_experts)[:, None], y, 0)
    y.mul_(route[:, None])  # in float32, stored in y's dtype (the Triton epilogue's rounding)
    out = torch.empty_like(y)
    out[order] = y
    return out.view(t, top_k, -1).sum(1, dtype=torch.float32).to(x.dtype)


def bf16_experts(w: ExpertWeights, dtype: torch.dtype) -> torch.Tensor:
    """The stacked weights [E, N, K] in `dtype`: dense ones as they are, MXFP4 ones decoded
    (a temporary the size of the layer's experts in `dtype`)."""
    if w.fmt == "dense":
        return w.weight
    e, n, half = w.weight.shape
    k = 2 * half
    if triton is None or not (w.weight.is_cuda or interpreted()):
        return dequantize_mxfp4(w.weight.reshape(e * n, half),
                                w.scale.reshape(e * n, -1)).to(dtype).view(e, n, k)
    from skyline.ops import moe_triton

    codes, scales = w.weight.reshape(e * n, half), w.scale.reshape(e * n, -1)
    out = torch.empty(e * n, k, dtype=dtype, device=w.weight.device)
    block_r, block_k = 32, 128
    moe_triton.dequant_mxfp4_kernel[(triton.cdiv(e * n, block_r), triton.cdiv(k, block_k))](
        codes, scales, out, e * n, k, codes.stride(0), scales.stride(0), out.stride(0),
        BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4)
    return out.view(e, n, k)
