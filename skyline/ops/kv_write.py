"""Writing this step's K/V into the paged KV cache: the PyTorch reference (any device, any
cache dtype) and, on CUDA, one Triton kernel that scatters K and V in a single launch (for an
fp8 cache also scaling, saturating and converting them; the reference then takes ~10 small
kernels a layer, and 2 for a bf16 cache).

KV cache layout per layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (K then V).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from skyline.ops.kv_quant import FP8_MAX, inverse_scale, is_fp8, quantize_kv
from skyline.ops.pdl import pdl_wait, use_pdl
from skyline.ops.triton_utils import tl, triton


class KVWrite(NamedTuple):
    """Where this step's K/V go, for a kernel that produces K (rope) to store it on the way:
    the V to store with it, the layer's cache, the tokens' slots, and the cache's scales."""

    v: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor  # [num_tokens] int64
    k_scale: float = 1.0
    v_scale: float = 1.0


def write_kv_ref(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64: block_id * block_size + offset
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Token i's k/v go to slot slot_mapping[i], stored as k / k_scale and v / v_scale."""
    _, nb, bs, kvh, d = kv_cache.shape
    k, v = quantize_kv(k, kv_cache.dtype, k_scale), quantize_kv(v, kv_cache.dtype, v_scale)
    if is_fp8(kv_cache):  # index_copy_ has no float8 kernel: copy the bytes
        k, v, kv_cache = k.view(torch.uint8), v.view(torch.uint8), kv_cache.view(torch.uint8)
    kv_cache[0].view(nb * bs, kvh, d).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(nb * bs, kvh, d).index_copy_(0, slot_mapping, v)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """write_kv_ref's contract; on CUDA written by write_kv_triton."""
    if kv_cache.is_cuda and triton is not None:
        write_kv_triton(k, v, kv_cache, slot_mapping, k_scale, v_scale)
    elif (kv_cache.device.type == "cpu" and k.dtype == v.dtype == kv_cache.dtype
          and k_scale == v_scale == 1.0):
        # K and V stored unchanged: one scatter of both (the reference takes six operations,
        # and a CPU decode step is bound by the operations Python dispatches), read in place
        # where they are neighbouring views of one projection
        _, nb, bs, kvh, d = kv_cache.shape
        kv_cache.view(2, nb * bs, kvh, d).index_copy_(1, slot_mapping, _kv_pair(k, v))
    else:
        write_kv_ref(k, v, kv_cache, slot_mapping, k_scale, v_scale)


def _kv_pair(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # [2, T, KVH, D]
    """k and v as one tensor: a view where v follows k in memory as a qkv projection's
    neighbouring slices do (same strides, each head row contiguous), else a stacked copy."""
    t, kvh, d = k.shape
    if (v.data_ptr() == k.data_ptr() + kvh * d * k.element_size() and k.stride() == v.stride()
            and k.stride()[1:] == (d, 1)):
        return k.as_strided((2, t, kvh, d), (kvh * d, *k.stride()))
    return torch.stack((k, v))


if triton is not None:

    @triton.jit
    def store_kv(dst_ptr, x, inv_scale, mask, FP8_MAX: tl.constexpr, SATURATE: tl.constexpr):
        # x into the cache as quantize_kv stores it: for fp8 (SATURATE) x times the float32
        # reciprocal of the scale, saturated, then converted (shared with ops/rotary.py)
        if SATURATE:
            x = tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -FP8_MAX), FP8_MAX)
        tl.store(dst_ptr, x.to(dst_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _write_kv_kernel(
        k_ptr, v_ptr, cache_k_ptr, cache_v_ptr, slot_ptr, inv_k_scale, inv_v_scale,
        stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
        NUM_KV_HEADS: tl.constexpr, H_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr, PAGE: tl.constexpr, FP8_MAX: tl.constexpr, SATURATE: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # One program per token: all its kv heads, K and V. Multiplying by the float32
        # reciprocal, then saturating, rounds exactly as quantize_kv does.
        pdl_wait(PDL)
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        h = tl.arange(0, H_PAD)
        d = tl.arange(0, D_PAD)
        mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
        dst = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs \
            + h[:, None] * stride_ch + d[None, :]  # [H, D]
        k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        store_kv(cache_k_ptr + dst, k, inv_k_scale, mask, FP8_MAX, SATURATE)
        v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        store_kv(cache_v_ptr + dst, v, inv_v_scale, mask, FP8_MAX, SATURATE)


def write_kv_triton(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    num_tokens, kvh, head_dim = k.shape
    if num_tokens == 0:
        return
    # rows may be strided (views of a fused qkv projection); elements within a head may not
    k = k if k.stride(2) == 1 else k.contiguous()
    v = v if v.stride(2) == 1 else v.contiguous()
    ck, cv = kv_cache[0], kv_cache[1]
    pdl = use_pdl(k.device)
    _write_kv_kernel[(num_tokens,)](
        k, v, ck, cv, slot_mapping, inverse_scale(k_scale), inverse_scale(v_scale),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), ck.stride(0), ck.stride(1),
        ck.stride(2),
        NUM_KV_HEADS=kvh, H_PAD=triton.next_power_of_2(kvh), HEAD_DIM=head_dim,
        D_PAD=triton.next_power_of_2(head_dim), PAGE=kv_cache.shape[2], FP8_MAX=FP8_MAX,
        SATURATE=is_fp8(kv_cache), PDL=pdl,
        num_warps=4, launch_pdl=pdl,
    )
