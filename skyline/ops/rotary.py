"""Rotary position embedding (NeoX / rotate-half layout) read from a cos/sin cache by position,
optionally preceded by a per-head RMSNorm of q and k (Qwen3): PyTorch references, and one
Triton kernel for both (CUDA) that rotates q and k in place. Given a `KVWrite` (ops/kv_write.py)
the same launch also stores the rotated k and v in the paged KV cache, as write_kv would, so a
decode step spends one launch per layer on rope and the cache write instead of two.

The cache is [max_position, head_dim] float32, cos half then sin half (see
model/layers/rotary.py); every scaling (llama3, yarn, linear, ...) is already in it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from skyline import envs
from skyline.ops.kv_quant import FP8_MAX, inverse_scale, is_fp8
from skyline.ops.kv_write import KVWrite, write_kv, write_kv_triton
from skyline.ops.norm import rms_norm_ref, rms_norm_triton
from skyline.ops.pdl import pdl_wait, use_pdl
from skyline.ops.triton_utils import tl, triton
from skyline.ops.tuning import dtype_name, get_config, token_bucket


def rotary_embedding_ref(
    positions: torch.Tensor,  # [num_tokens] int64
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated by their tokens' positions, as new tensors (cos/sin cast to q's dtype
    first, as HF does)."""
    cos_sin = cos_sin_cache.index_select(0, positions).to(q.dtype)  # [T, head_dim]
    cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # [T, 1, head_dim // 2] each
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x * [cos, cos] + rotate_half(x) * [sin, sin], written per half
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotation_operands(
    positions: torch.Tensor,  # [num_tokens] int64
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] float32
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, 1, head_dim] each
    """What rotary_cpu multiplies by, made once per forward pass: [cos, cos] and [-sin, sin]
    (cast to `dtype` first, as rotary_embedding_ref casts them)."""
    cos, sin = cos_sin_cache.index_select(0, positions).to(dtype).unsqueeze(1).chunk(2, dim=-1)
    return torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)


def rotary_cpu(
    cos2: torch.Tensor,  # [num_tokens, 1, head_dim] from rotation_operands
    sin2: torch.Tensor,
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary_embedding_ref's result in three operations a layer: a CPU decode step is bound by
    the operations Python dispatches (the reference takes ~25 for q and k), not by their
    arithmetic. x * [cos, cos] + roll(x, d / 2) * [-sin, sin], the second product added in
    float32 (addcmul) before the one rounding. q and k that are neighbouring views of one
    projection (qkv.split) rotate together and in place, as on CUDA: k then still neighbours
    the projection's v, and write_kv stores both from there without stacking them."""
    t, h, d = q.shape
    # (a dimension of size 1 may have any stride)
    if (k.data_ptr() == q.data_ptr() + h * d * q.element_size() and q.stride()[1:] == (d, 1)
            and k.stride()[1:] == (d, 1) and (t == 1 or k.stride(0) == q.stride(0))):
        qk = q.as_strided((t, h + k.shape[1], d), q.stride())
        # the out= operand is read only by the two products, made before it is written
        torch.addcmul(qk * cos2, qk.roll(d // 2, -1), sin2, out=qk)
        return q, k
    return (torch.addcmul(q * cos2, q.roll(d // 2, -1), sin2),
            torch.addcmul(k * cos2, k.roll(d // 2, -1), sin2))


def qk_norm_rotary_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor,  # [head_dim]
    k_weight: torch.Tensor,  # [head_dim]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over each head of q (weight q_weight) and of k (k_weight), then rotary."""
    q, k = rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps)
    return rotary_embedding_ref(positions, q, k, cos_sin_cache)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
    config: dict[str, Any] | None = None, kv: KVWrite | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary_embedding_ref's contract, and with `kv` the rotated k and kv.v written to the
    cache (write_kv's contract). On CUDA one Triton launch rotates q and k in place (they may
    be strided views, e.g. of one qkv tensor), writes the cache, and returns them."""
    if not _use_triton(positions, q, k, cos_sin_cache, kv):
        q, k = rotary_embedding_ref(positions, q, k, cos_sin_cache)
        return _write(q, k, kv)
    if kv is not None and "rope_kv" in envs.ENV.unfuse:
        return rotary_unfused(positions, q, k, cos_sin_cache, kv=kv)
    return rotary_triton(positions, q, k, cos_sin_cache, config=config, kv=kv)


def _write(q: torch.Tensor, k: torch.Tensor, kv: KVWrite | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    if kv is not None:
        write_kv(k, kv.v, kv.kv_cache, kv.slot_mapping, kv.k_scale, kv.v_scale)
    return q, k


def qk_norm_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
    config: dict[str, Any] | None = None, kv: KVWrite | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """qk_norm_rotary_ref's contract (and the cache write of `kv`, as rotary_embedding). On
    CUDA one Triton launch norms and rotates q and k in place and returns them."""
    same = q_weight.dtype == q.dtype and k_weight.dtype == q.dtype
    if not (same and _use_triton(positions, q, k, cos_sin_cache, kv)):
        q, k = qk_norm_rotary_ref(positions, q, k, cos_sin_cache, q_weight, k_weight, eps)
        return _write(q, k, kv)
    if "qk_norm" in envs.ENV.unfuse or (kv is not None and "rope_kv" in envs.ENV.unfuse):
        return rotary_unfused(positions, q, k, cos_sin_cache, q_weight, k_weight, eps, kv,
                              envs.ENV.unfuse)
    return rotary_triton(positions, q, k, cos_sin_cache, q_weight, k_weight, eps, config, kv)


def rotary_unfused(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
    eps: float = 0.0, kv: KVWrite | None = None,
    unfuse: frozenset[str] = frozenset({"qk_norm", "rope_kv"}),
) -> tuple[torch.Tensor, torch.Tensor]:
    """The modular forms of rotary_triton (SKYLINE_UNFUSE, to measure each fusion): with
    "qk_norm" in `unfuse` and weights given, the RMSNorm kernel norms q and k into new tensors
    first (a launch each); with "rope_kv" and `kv`, write_kv's kernel stores k and v after the
    rotary kernel; what stays fused runs in the rotary kernel. Returns q and k, as it does."""
    if q_weight is not None and k_weight is not None and "qk_norm" in unfuse:
        q, k = rms_norm_triton(q, q_weight, eps), rms_norm_triton(k, k_weight, eps)
        q_weight = k_weight = None
    fused_kv = kv if "rope_kv" not in unfuse else None
    q, k = rotary_triton(positions, q, k, cos_sin_cache, q_weight, k_weight, eps, kv=fused_kv)
    if kv is not None and fused_kv is None:
        write_kv_triton(k, kv.v, kv.kv_cache, kv.slot_mapping, kv.k_scale, kv.v_scale)
    return q, k


def _use_triton(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                cache: torch.Tensor, kv: KVWrite | None = None) -> bool:
    return (q.is_cuda and triton is not None and q.dim() == 3 and k.dim() == 3
            and q.dtype == k.dtype and q.stride(-1) == 1 and k.stride(-1) == 1
            and q.shape[-1] == k.shape[-1] == cache.shape[-1] and q.shape[-1] % 2 == 0
            and cache.stride(-1) == 1 and positions.is_contiguous() and q.shape[0] > 0
            and (kv is None or (kv.v.shape == k.shape and kv.v.stride(-1) == 1
                                and kv.kv_cache.is_contiguous()
                                and kv.slot_mapping.is_contiguous())))


def default_config(head_dim: int, num_heads: int) -> dict[str, Any]:
    """Heuristic launch configuration when no tuned one is stored: up to ~512 rotated pairs
    (several heads) per program."""
    half_pad = 1 << (head_dim // 2 - 1).bit_length()  # the next power of two
    return {"BLOCK_H": max(1, min(1 << (num_heads - 1).bit_length(), 512 // half_pad)),
            "num_warps": 4}


def config_key(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
               num_tokens: int) -> str:
    """Tuning-table key (kernels "rotary", "qk_norm_rotary")."""
    bucket = token_bucket(num_tokens)
    return f"h{num_heads}x{num_kv_heads}:d{head_dim}:{dtype_name(dtype)}:t{bucket}"


@functools.cache
def _config(kernel: str, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
            bucket: int) -> dict[str, Any]:
    key = config_key(num_heads, num_kv_heads, head_dim, dtype, bucket)
    return get_config(kernel, key, default_config(head_dim, max(num_heads, num_kv_heads)))


def rotary_triton(
    positions: torch.Tensor,  # [T], contiguous
    q: torch.Tensor,  # [T, num_heads, head_dim], last dim contiguous
    k: torch.Tensor,  # [T, num_kv_heads, head_dim], last dim contiguous, q's dtype
    cache: torch.Tensor,  # [max_position, head_dim] float32, last dim contiguous
    q_weight: torch.Tensor | None = None,  # [head_dim], q's dtype: per-head RMSNorm first
    k_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    config: dict[str, Any] | None = None,  # None: tuned or default_config
    kv: KVWrite | None = None,  # also store the rotated k and kv.v in kv.kv_cache
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel behind rotary_embedding and qk_norm_rotary (any device Triton runs
    on): rotates q and k in place, after a per-head RMSNorm when weights are given, and with
    `kv` writes the cache as write_kv does (fp8 caches scaled and saturated alike)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    norm = q_weight is not None
    if config is None:
        kernel = "qk_norm_rotary" if norm else "rotary"
        config = _config(kernel, num_heads, num_kv_heads, head_dim, q.dtype,
                         token_bucket(num_tokens))
    block_h = config["BLOCK_H"]
    num_q_blocks = triton.cdiv(num_heads, block_h)
    grid = (num_tokens, num_q_blocks + triton.cdiv(num_kv_heads, block_h))
    qw, kw = (q_weight, k_weight) if norm else (cache, cache)  # unused when NORM is False
    if kv is not None:
        v, ck, cv, slots = kv.v, kv.kv_cache[0], kv.kv_cache[1], kv.slot_mapping
        inv_k, inv_v = inverse_scale(kv.k_scale), inverse_scale(kv.v_scale)
        page, fp8 = kv.kv_cache.shape[2], is_fp8(kv.kv_cache)
    else:  # unused when WRITE_KV is False
        v, ck, cv, slots, inv_k, inv_v, page, fp8 = k, k, k, positions, 1.0, 1.0, 1, False
    pdl = use_pdl(q.device)
    _rotary_kernel[grid](
        positions, q, k, cache, qw, kw, eps, num_heads, num_kv_heads, num_q_blocks,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cache.stride(0),
        v, ck, cv, slots, inv_k, inv_v, v.stride(0), v.stride(1), ck.stride(0), ck.stride(1),
        ck.stride(2),
        HALF=head_dim // 2, HALF_PAD=triton.next_power_of_2(head_dim // 2), BLOCK_H=block_h,
        NORM=norm, WRITE_KV=kv is not None, PAGE=page, FP8_MAX=FP8_MAX, SATURATE=fp8,
        PDL=pdl, num_warps=config["num_warps"], launch_pdl=pdl,
    )
    return q, k



if triton is not None:
    from skyline.ops.kv_write import store_kv

    @triton.jit
    def _rotate_heads(x_ptr, stride_h, h0, num_heads, w_ptr, eps, cos, sin,
                      HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
                      NORM: tl.constexpr):
        # Heads [h0, h0 + BLOCK_H) of one token at x_ptr, in place: [optional RMSNorm] + rope.
        # Returns the stored halves ([BLOCK_H, HALF_PAD] in x's dtype) and their mask.
        h = h0 + tl.arange(0, BLOCK_H)
        j = tl.arange(0, HALF_PAD)
        jm = j < HALF
        mask = (h < num_heads)[:, None] & jm[None, :]
        p1 = x_ptr + h[:, None] * stride_h + j[None, :]  # first half of each head
        x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, HALF_PAD]
        x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
        dtype = x_ptr.dtype.element_ty
        if NORM:  # as rms_norm_ref: normed in float32, cast to the dtype, times the weight
            ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
            rstd = tl.rsqrt(ss / (2 * HALF) + eps)[:, None]
            w1 = tl.load(w_ptr + j, mask=jm, other=0.0).to(tl.float32)[None, :]
            w2 = tl.load(w_ptr + HALF + j, mask=jm, other=0.0).to(tl.float32)[None, :]
            x1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
            x2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
        r1 = (x1 * cos - x2 * sin).to(dtype)
        r2 = (x2 * cos + x1 * sin).to(dtype)
        tl.store(p1, r1, mask=mask)
        tl.store(p1 + HALF, r2, mask=mask)
        return r1, r2, h, j, mask

    @triton.jit(do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])
    def _rotary_kernel(
        pos_ptr, q_ptr, k_ptr, cache_ptr, qw_ptr, kw_ptr, eps, num_heads, num_kv_heads,
        num_q_blocks, stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
        v_ptr, cache_k_ptr, cache_v_ptr, slot_ptr, inv_k_scale, inv_v_scale,
        stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
        HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr, NORM: tl.constexpr,
        WRITE_KV: tl.constexpr, PAGE: tl.constexpr, FP8_MAX: tl.constexpr,
        SATURATE: tl.constexpr, PDL: tl.constexpr,
    ):
        # One program per (token, block of BLOCK_H heads); q's head blocks come first, then
        # k's. cos/sin are cast to q's dtype first, as the reference (and HF) does. With
        # WRITE_KV a k block also stores its rotated heads, and the same heads of v, at the
        # token's slot of the paged cache.
        pdl_wait(PDL)
        tok = tl.program_id(0)
        blk = tl.program_id(1)
        j = tl.arange(0, HALF_PAD)
        row = cache_ptr + tl.load(pos_ptr + tok).to(tl.int64) * stride_cache
        dtype = q_ptr.dtype.element_ty
        cos = tl.load(row + j, mask=j < HALF, other=0.0).to(dtype).to(tl.float32)[None, :]
        sin = tl.load(row + HALF + j, mask=j < HALF, other=0.0).to(dtype).to(tl.float32)[None, :]
        tok64 = tok.to(tl.int64)
        if blk < num_q_blocks:
            _rotate_heads(q_ptr + tok64 * stride_qt, stride_qh, blk * BLOCK_H, num_heads, qw_ptr,
                          eps, cos, sin, HALF, HALF_PAD, BLOCK_H, NORM)
        else:
            k1, k2, h, j, mask = _rotate_heads(
                k_ptr + tok64 * stride_kt, stride_kh, (blk - num_q_blocks) * BLOCK_H,
                num_kv_heads, kw_ptr, eps, cos, sin, HALF, HALF_PAD, BLOCK_H, NORM)
            if WRITE_KV:
                slot = tl.load(slot_ptr + tok).to(tl.int64)
                dst = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs \
                    + h[:, None] * stride_ch + j[None, :]  # first half of each head
                store_kv(cache_k_ptr + dst, k1, inv_k_scale, mask, FP8_MAX, SATURATE)
                store_kv(cache_k_ptr + dst + HALF, k2, inv_k_scale, mask, FP8_MAX, SATURATE)
                pv = v_ptr + tok64 * stride_vt + h[:, None] * stride_vh + j[None, :]
                store_kv(cache_v_ptr + dst, tl.load(pv, mask=mask), inv_v_scale, mask,
                          FP8_MAX, SATURATE)
                store_kv(cache_v_ptr + dst + HALF, tl.load(pv + HALF, mask=mask), inv_v_scale,
                          mask, FP8_MAX, SATURATE)
