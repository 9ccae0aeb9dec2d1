"""Mixture-of-experts MLP: each token runs through its top-k experts' gated MLPs, weighted by
its routing weights. The PyTorch reference (CPU, any device) groups the (token, expert) pairs by
expert and runs each expert once on its rows; the Triton path (CUDA; Triton's interpreter in
tests) sorts the pairs by expert into blocks of BLOCK_M rows (ops/moe_align.py, no host sync,
so CUDA graphs capture it) and runs each projection as one grouped GEMM over all experts
(ops/moe_triton.py), the second with the routing weights in its epilogue, then sums each
token's k rows. At decode sizes (1..8 tokens) two GEMV-style launches over the (token, expert)
pairs replace all of that (ops/moe_gemv.py).

Expert weights are stacked [E, N, K] (rows = output features, as a Linear's) in one of three
formats (`ExpertWeights`): dense (the model dtype), fp8 (e4m3 with a float32 scale per output
channel [E, N] or per block [E, N / bn, K / bk]; weight-only: activations stay in the model
dtype) and mxfp4 (E2M1 codes two per byte, element 2j in the low nibble, with an E8M0 scale per
32 elements [E, N, K / 32], quant/fp4.py's layout and gpt-oss's). The first projection stacks
gate then up ([E, 2I, H]); the second is down ([E, H, I]).

An `expert_map` [E] (global expert id -> index among this rank's experts, -1 where another rank
holds it) restricts the MLP to this rank's experts: the pairs routed elsewhere contribute
nothing, so summing every rank's output gives the whole (expert parallelism's combine).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from skyline import envs
from skyline.ops.activation import (
    silu_and_mul,
    silu_and_mul_ref,
    swiglu_oai,
    swiglu_oai_ref,
)
from skyline.ops.fp4 import dequantize_mxfp4
from skyline.ops.gemv_block import rounded_x_ref
from skyline.ops.moe_align import local_ids, moe_align
from skyline.ops.triton_utils import inline_ptx, interpreted, triton
from skyline.ops.tuning import dtype_name, get_config, token_bucket

KERNEL = "fused_moe"  # the grouped GEMM's name in the tuning tables
ACTIVATIONS = ("silu", "swiglu_oai")


@dataclass
class ExpertWeights:
    """One stacked projection of E experts, y_e = x W_e^T (+ b_e), W_e [N, K] as stored."""

    weight: torch.Tensor  # dense, fp8: [E, N, K]; mxfp4: [E, N, K / 2] uint8
    scale: torch.Tensor | None = None  # fp8: [E, N] or [E, N / bn, K / bk]; mxfp4: [E, N, K / 32]
    bias: torch.Tensor | None = None  # [E, N]
    fmt: str = "dense"  # "dense" | "fp8" | "mxfp4"

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    @property
    def n(self) -> int:
        return self.weight.shape[1]

    @property
    def k(self) -> int:
        return self.weight.shape[2] * (2 if self.fmt == "mxfp4" else 1)

    def block(self) -> tuple[int, int] | None:
        """fp8 block scales: the (rows, columns) of one block; None for per-channel scales."""
        if self.fmt != "fp8" or self.scale is None or self.scale.dim() != 3:
            return None
        return -(-self.n // self.scale.shape[1]), -(-self.k // self.scale.shape[2])

    def expert(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e's weight [N, K] in `dtype` (dequantized; a view for dense weights)."""
        w = self.weight[e]
        if self.fmt == "dense":
            return w if w.dtype == dtype else w.to(dtype)
        if self.fmt == "mxfp4":
            return dequantize_mxfp4(w, self.scale[e])[:, : self.k].to(dtype)
        s = self.scale[e].float()
        if s.dim() == 2:  # blocks: each scale over bn x bk elements
            bn, bk = self.block()
            s = s.repeat_interleave(bn, 0)[: self.n].repeat_interleave(bk, 1)[:, : self.k]
            return (w.float() * s).to(dtype)
        return (w.float() * s[:, None]).to(dtype)


def moe_activation_ref(h: torch.Tensor, activation: str, limit: float | None = None
                       ) -> torch.Tensor:
    """[P, 2I] (gate then up) -> [P, I]. "silu": silu(gate) * up (SwiGLU). "swiglu_oai"
    (gpt-oss): gate clamped above and up on both sides at `limit`, then
    gate * sigmoid(1.702 gate) * (up + 1)."""
    if activation == "silu":
        return silu_and_mul_ref(h)
    return swiglu_oai_ref(h, limit)


def moe_activation(h: torch.Tensor, activation: str, limit: float | None = None
                   ) -> torch.Tensor:
    """moe_activation_ref's contract and roundings, one launch on CUDA (ops/activation.py)."""
    return silu_and_mul(h) if activation == "silu" else swiglu_oai(h, limit)


def fused_moe_ref(
    x: torch.Tensor,  # [T, K]
    w13: ExpertWeights,  # [E, 2I, K]: gate then up
    w2: ExpertWeights,  # [E, K, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k] global expert ids
    activation: str = "silu",
    limit: float | None = None,
    expert_map: torch.Tensor | None = None,  # [E_global] -> local index or -1
    a8: bool = False,
) -> torch.Tensor:  # [T, K] in x's dtype
    """Grouped by expert: one pass per expert that has pairs, over its rows (the CPU path).
    With a8, in float32 with x and the activations before `down` (stored in x's dtype first)
    rounded to int8 per 32 columns, as the decode GEMV's integer mode rounds them
    (ops/moe_gemv.py)."""
    dtype = x.dtype
    if a8:
        x = rounded_x_ref(x)

    def mlp(e: int, rows: torch.Tensor) -> torch.Tensor:
        h = F.linear(rows, w13.expert(e, rows.dtype), _row(w13.bias, e, rows.dtype))
        h = moe_activation_ref(h, activation, limit)
        if a8:
            h = rounded_x_ref(h.to(dtype))
        return F.linear(h, w2.expert(e, rows.dtype), _row(w2.bias, e, rows.dtype))

    return moe_by_expert(x, topk_weights, topk_ids, w13.num_experts, mlp,
                         expert_map).to(dtype)


def moe_by_expert(
    x: torch.Tensor,  # [T, K]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k] global expert ids
    num_experts: int,  # held here
    mlp: Callable[[int, torch.Tensor], torch.Tensor],  # (local expert, rows [n, K]) -> [n, K]
    expert_map: torch.Tensor | None = None,  # [E_global] -> local index or -1
) -> torch.Tensor:  # [T, K] in x's dtype
    """The (token, expert) pairs grouped by expert: `mlp` once per expert that has pairs, on
    its tokens' rows; each token's k outputs weighted and summed in float32."""
    t, top_k = topk_ids.shape
    ids = local_ids(topk_ids, expert_map)
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids.clamp(min=-1) + 1, minlength=num_experts + 1).tolist()
    weights = topk_weights.flatten()
    out = torch.zeros(t * top_k, x.shape[1], dtype=torch.float32, device=x.device)
    start = counts[0]  # pairs of other ranks' experts sort first (-1)
    for e, n in enumerate(counts[1:]):
        if n:
            pairs = order[start:start + n]
            y = mlp(e, x[pairs // top_k])
            out[pairs] = y.float() * weights[pairs, None].float()
        start += n
    return out.view(t, top_k, -1).sum(1).to(x.dtype)


def _row(bias: torch.Tensor | None, e: int, dtype: torch.dtype) -> torch.Tensor | None:
    return None if bias is None else bias[e].to(dtype)


def default_config(num_pairs: int, w: ExpertWeights) -> dict[str, Any]:
    """Launch configuration without a tuned entry: 16-row blocks at decode sizes (most blocks
    hold a few rows; the weights dominate), 64 above."""
    small = num_pairs <= 64
    return {"BLOCK_M": 16 if small else 64, "BLOCK_N": 64, "BLOCK_K": 128 if small else 64,
            "num_warps": 4, "num_stages": 3}


@functools.cache
def _config(n: int, k: int, fmt: str, dtype: torch.dtype, bucket: int,
            default: tuple) -> dict[str, Any]:
    key = f"n{n}:k{k}:{fmt}:{dtype_name(dtype)}:t{bucket}"
    return get_config(KERNEL, key, dict(default))


def moe_config(num_pairs: int, w: ExpertWeights, dtype: torch.dtype) -> dict[str, Any]:
    """The grouped GEMM's configuration for `num_pairs` rows: tuned (skyline/ops/configs/), else
    default_config."""
    default = tuple(default_config(num_pairs, w).items())
    return _config(w.n, w.k, w.fmt, dtype, token_bucket(num_pairs), default)


def grouped_matmul_triton(
    a: torch.Tensor,  # [rows, K]: tokens (gather=k) or pairs (gather=1)
    w: ExpertWeights,
    sorted_ids: torch.Tensor,
    block_experts: torch.Tensor,
    num_pairs: int,
    gather: int,
    config: dict[str, Any],
    route_weights: torch.Tensor | None = None,  # [P] float: multiply row p by it
    zero: bool = False,  # zero the rows of pairs no block holds (else left undefined)
) -> torch.Tensor:  # [P, N] in a's dtype
    """out[p] = a[p // gather] W_e^T (+ b_e) (* route_weights[p]) for every pair p of the
    blocks, e its block's expert (one Triton launch; ops/moe_triton.py)."""
    from skyline.ops import moe_triton

    out = (torch.zeros if zero else torch.empty)(num_pairs, w.n, dtype=a.dtype, device=a.device)
    block_m, block_k = config["BLOCK_M"], config["BLOCK_K"]
    grid = (block_experts.shape[0], triton.cdiv(w.n, config["BLOCK_N"]))
    fmt = {"dense": 0, "fp8": 1, "mxfp4": 2}[w.fmt]
    blk = w.block() or (1, 1)
    if w.block() is not None:  # a K tile stays within one scale block
        block_k = min(block_k, blk[1] & -blk[1])
        if block_k < 16:
            raise ValueError(f"fp8 scale blocks of {blk[1]} columns are too narrow for the "
                             "MoE kernel; use blocks of 16 columns or more")
    if w.fmt == "mxfp4":
        block_k = max(block_k, 32)  # two dots of BLOCK_K / 2 >= 16
    weight = w.weight.view(torch.uint8) if w.fmt == "fp8" else w.weight
    scale = w.scale if w.scale is not None else weight
    scale_strides = (scale.stride(0), scale.stride(1), scale.stride(-1)) if w.scale is not None \
        else (0, 0, 0)
    bias = w.bias if w.bias is not None else weight
    moe_triton.grouped_matmul_kernel[grid](
        a, weight, scale, bias, out, route_weights if route_weights is not None else a,
        sorted_ids, block_experts, w.n, w.k, num_pairs,
        a.stride(0), weight.stride(0), weight.stride(1), weight.stride(2), *scale_strides,
        bias.stride(0) if w.bias is not None else 0, out.stride(0),
        GATHER=gather, FMT=fmt, CHANNEL_SCALE=w.fmt == "fp8" and w.block() is None,
        SCALE_BN=blk[0], SCALE_BK=blk[1], HAS_BIAS=w.bias is not None,
        ROUTE=route_weights is not None, BLOCK_M=block_m, BLOCK_N=config["BLOCK_N"],
        BLOCK_K=block_k, IEEE=a.dtype == torch.float32,
        ASM=w.fmt == "mxfp4" and a.dtype == torch.bfloat16 and inline_ptx(a.device),
        PIPELINE=not interpreted() and config["num_stages"] > 1,
        NUM_STAGES=config["num_stages"], num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
    return out


# MXFP4 experts are decoded to the activations' dtype, the whole layer's at once, before the
# grouped GEMMs of calls with this many (token, expert) pairs or more (outside CUDA graphs),
# which then run on dense tiles: the fused kernel decodes each weight tile once per block of
# rows, so at many rows an expert one pass of decoding (the layer's experts read once, written
# once in bf16) wins (bench/kernels/moe_grouped_speed.py, H100, gpt-oss-20b's experts, decoded
# first against in tiles: 4,096 pairs 0.73x, 8,192 0.89x, 12,288 0.99x, 16,384 1.06x, 32,768
# 1.14x).
DECODE_PAIRS = 16384


def decode_pairs() -> int:
    """DECODE_PAIRS, or SKYLINE_MOE_DECODE_PAIRS where set (0: never)."""
    n = envs.ENV.moe_decode_pairs
    return DECODE_PAIRS if n < 0 else n or 1 << 62


# The decoding kernel's (rows, columns, warps) per program: the fastest of seven on the H100,
# 0.86 of the copy rate.
DECODE_BLOCK = (8, 1024, 4)


def decoded_experts(w: ExpertWeights, dtype: torch.dtype,
                    block: tuple[int, int, int] = DECODE_BLOCK) -> ExpertWeights:
    """MXFP4 experts as dense ones in `dtype` (a temporary the size of the layer's experts in
    that dtype; moe_triton.dequant_mxfp4_kernel, reference ops/fp4.py's dequantize_mxfp4)."""
    from skyline.ops import moe_triton

    e, n, half = w.weight.shape
    k = 2 * half
    codes, scales = w.weight.reshape(e * n, half), w.scale.reshape(e * n, -1)
    out = torch.empty(e * n, k, dtype=dtype, device=w.weight.device)
    block_r, block_k, warps = block
    moe_triton.dequant_mxfp4_kernel[(triton.cdiv(e * n, block_r), triton.cdiv(k, block_k))](
        codes, scales, out, e * n, k, codes.stride(0), scales.stride(0), out.stride(0),
        BLOCK_R=block_r, BLOCK_K=block_k, num_warps=warps)
    return ExpertWeights(out.view(e, n, k), bias=w.bias)


def fused_moe_triton(
    x: torch.Tensor, w13: ExpertWeights, w2: ExpertWeights, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, activation: str = "silu", limit: float | None = None,
    expert_map: torch.Tensor | None = None, config: dict[str, Any] | None = None,
    decode: bool | None = None,
) -> torch.Tensor:
    """fused_moe_ref's contract with the grouped GEMMs (any device Triton runs on). MXFP4
    experts are decoded first, one projection at a time, where `decode` says (None: from
    decode_pairs() pairs up)."""
    t, top_k = topk_ids.shape
    num_pairs = t * top_k
    if decode is None:  # never inside a CUDA graph, whose pool would keep the decoded copy
        decode = num_pairs >= decode_pairs() and not (
            x.is_cuda and torch.cuda.is_current_stream_capturing())
    decode = decode and w13.fmt == "mxfp4" and w2.fmt == "mxfp4"
    if decode:
        w13 = decoded_experts(w13, x.dtype)
    if config is None:
        config = moe_config(num_pairs, w13, x.dtype)
    sorted_ids, block_experts = moe_align(topk_ids, w13.num_experts, config["BLOCK_M"],
                                          expert_map)
    x = x.contiguous()
    # Temporaries scale with the pairs: at the start-up profile's 8,192 tokens of top-8 they
    # are h [P, 2I], its activation [P, I] (h freed once it is computed), y [P, H] and the
    # fp32 sum [T, H]; y is summed in fp32 as it is read, not through an fp32 copy of it (at
    # Qwen3-30B-A3B's sizes 0.5 GB more). MXFP4 experts decoded first add one projection's
    # experts in x's dtype (gpt-oss-20b's gate/up: 1.06 GB).
    h = grouped_matmul_triton(x, w13, sorted_ids, block_experts, num_pairs, top_k, config)
    h = moe_activation(h, activation, limit)
    if decode:  # w13's decoded experts freed before w2's are made
        del w13
        w2 = decoded_experts(w2, x.dtype)
    # Pairs of other ranks' experts are in no block: their rows of y must read zero.
    y = grouped_matmul_triton(h, w2, sorted_ids, block_experts, num_pairs, 1, config,
                              route_weights=topk_weights.flatten().float(),
                              zero=expert_map is not None)
    del h
    return y.view(t, top_k, -1).sum(1, dtype=torch.float32).to(x.dtype)


def fused_moe(
    x: torch.Tensor, w13: ExpertWeights, w2: ExpertWeights, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, activation: str = "silu", limit: float | None = None,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, K] through each token's top-k experts -> [T, K]: on CUDA the decode GEMVs
    (ops/moe_gemv.py) for a few tokens, the Triton grouped GEMMs above; on the CPU the
    reference grouped by expert."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown MoE activation {activation!r}; expected one of {ACTIVATIONS}")
    if x.shape[0] == 0:
        return torch.empty_like(x)
    if x.is_cuda and triton is not None:
        from skyline.ops import moe_gemv

        # SKYLINE_UNFUSE=moe_gemv: the grouped GEMMs at every size (to measure the fusion)
        if moe_gemv.gemv_ok(x, w13, w2) and "moe_gemv" not in envs.ENV.unfuse:
            return moe_gemv.fused_moe_gemv(x, w13, w2, topk_weights, topk_ids, activation,
                                           limit, expert_map)
        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, activation, limit,
                                expert_map)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, activation, limit, expert_map)
