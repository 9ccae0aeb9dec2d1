"""Sliding-window attention and attention sinks: the paged reference against dense attention
written out here (a mask and a softmax with one more logit per head), and the Triton decode and
prefill kernels against the reference, with bf16/fp32 and fp8 caches. Kernels run on CUDA, or
in Triton's interpreter on CPU."""

from __future__ import annotations

import random

import pytest
import torch
from paged_tables import shuffled_table

from skyline.ops.attention import (
    paged_attention_ref,
    paged_decode_attention,
    paged_prefill_attention,
)
from skyline.ops.kv_quant import FP8_DTYPE, dequantize_kv, quantize_kv

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def dense(q, k, v, first, scale, window, sinks):
    """q [n, H, D] at positions first.., k/v [L, KVH, D]: each query over keys j <= its
    position p with p - j < window (0: all), the sink logit of its head in the denominator."""
    n, h, _ = q.shape
    rep = h // k.shape[1]
    k, v = k.repeat_interleave(rep, 1).double(), v.repeat_interleave(rep, 1).double()
    out = torch.empty(n, h, q.shape[2], dtype=torch.float64)
    for i in range(n):
        p = first + i
        lo = max(0, p - window + 1) if window else 0
        s = torch.einsum("hd,lhd->hl", q[i].double(), k[lo:p + 1]) * scale  # [H, keys]
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None]], 1)
        w = torch.softmax(s, -1)[:, : p + 1 - lo]
        out[i] = torch.einsum("hl,lhd->hd", w, v[lo:p + 1])
    return out


def _setup(shapes, page, heads, kvh, d, dtype, seed, fp8=False):
    """(q, cache, table, qsl, seq_lens, k_scale, v_scale) for (q_len, seq_len) shapes."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    seq_lens = [s for _, s in shapes]
    num_blocks = sum(-(-n // page) for n in seq_lens) + 3
    kv = torch.randn(2, num_blocks, page, kvh, d, generator=g)
    k_scale = v_scale = 1.0
    if fp8:
        k_scale, v_scale = 0.02, 0.004
        cache = torch.stack([quantize_kv(kv[0] * 4, FP8_DTYPE, k_scale),
                             quantize_kv(kv[1] * 0.5, FP8_DTYPE, v_scale)])
    else:
        cache = kv.to(dtype)
    cache[:, 0] = float("nan")  # table padding points here; nothing may read it
    table = shuffled_table(seq_lens, page, num_blocks, rng)
    qsl = [0]
    for q_len, _ in shapes:
        qsl.append(qsl[-1] + q_len)
    q = torch.randn(qsl[-1], heads, d, generator=g).to(dtype)
    return q, cache, table, qsl, seq_lens, k_scale, v_scale


def _dense_of(q, cache, table, qsl, seq_lens, scale, window, sinks, k_scale, v_scale):
    out = torch.empty(q.shape, dtype=torch.float64)
    page = cache.shape[2]
    for i, n in enumerate(seq_lens):
        blocks = table[i, : -(-n // page)].long()
        k = dequantize_kv(cache[0][blocks].flatten(0, 1)[:n], torch.float64, k_scale)
        v = dequantize_kv(cache[1][blocks].flatten(0, 1)[:n], torch.float64, v_scale)
        s, e = qsl[i], qsl[i + 1]
        out[s:e] = dense(q[s:e], k, v, n - (e - s), scale, window, sinks)
    return out


@pytest.mark.parametrize("window", [0, 1, 5, 16])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("num_decodes", [0, 3])
def test_reference_matches_dense(window, sinks, num_decodes):
    shapes = [(1, 30), (1, 3), (1, 17)][:num_decodes] + [(9, 9), (6, 25), (1, 12), (20, 44)]
    q, cache, table, qsl, lens, ks, vs = _setup(shapes, 4, 4, 2, 16, torch.float32, window)
    s = torch.randn(4, generator=torch.Generator().manual_seed(9)) if sinks else None
    out = paged_attention_ref(q, cache, qsl, lens, table, 0.25, num_decodes=num_decodes,
                              window=window, sinks=s)
    want = _dense_of(q, cache, table, qsl, lens, 0.25, window, s, ks, vs)
    assert (out.double() - want).abs().max() < 1e-5


KERNEL_SHAPES = [(4, 2, 16, 4), (6, 3, 32, 16), (8, 8, 64, 16)]
# (window, sinks, fp8 cache); full attention without sinks is tests/ops/test_paged_*'s
KERNEL_CASES = [(0, True, False), (3, False, True), (3, True, False), (40, True, True),
                (40, False, False)]


@pytest.mark.parametrize("heads,kvh,d,page", KERNEL_SHAPES)
@pytest.mark.parametrize("window,sinks,fp8", KERNEL_CASES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_kernel(heads, kvh, d, page, window, sinks, fp8, num_splits):
    if DEV == "cpu" and d > 32:
        pytest.skip("interpreter: small shapes only")
    shapes = [(1, n) for n in (1, 7, 41, 90)]
    q, cache, table, qsl, lens, ks, vs = _setup(shapes, page, heads, kvh, d, torch.float32,
                                                d + window, fp8)
    s = torch.randn(heads, generator=torch.Generator().manual_seed(3)) * 2 if sinks else None
    lens_t = torch.tensor(lens, dtype=torch.int32)
    out = paged_decode_attention(q.to(DEV), cache.to(DEV), table.to(DEV), lens_t.to(DEV), d**-0.5,
                                 num_splits, k_scale=ks, v_scale=vs, window=window,
                                 sinks=None if s is None else s.to(DEV))
    ref = paged_attention_ref(q.double(), cache if fp8 else cache.double(), qsl, lens, table,
                              d**-0.5, num_decodes=len(lens), seq_lens_tensor=lens_t, k_scale=ks,
                              v_scale=vs, window=window, sinks=s)
    assert torch.isfinite(out).all()
    assert (out.cpu().double() - ref.double()).norm() / ref.norm() < 1e-5


@pytest.mark.parametrize("heads,kvh,d,page", KERNEL_SHAPES)
@pytest.mark.parametrize("window,sinks,fp8,pack", [
    (0, True, False, True), (3, False, True, False), (3, True, False, True),
    (40, True, True, False), (40, False, False, True), (40, True, False, True)])
def test_prefill_kernel(heads, kvh, d, page, window, sinks, fp8, pack):
    """`pack`: the query heads of a kv head in one program, 16-token tiles (tiles wholly
    inside every query's window run unmasked)."""
    if DEV == "cpu" and d > 32:
        pytest.skip("interpreter: small shapes only")
    # fresh prompts, extends over a cached prefix, a chunk past the window, a single token
    shapes = [(50, 50), (17, 60), (1, 33), (5, 6), (30, 75)]
    q, cache, table, qsl, lens, ks, vs = _setup(shapes, page, heads, kvh, d, torch.float32,
                                                d * window + 1, fp8)
    s = torch.randn(heads, generator=torch.Generator().manual_seed(4)) * 2 if sinks else None
    out = paged_prefill_attention(
        q.to(DEV), cache.to(DEV), torch.tensor(qsl, dtype=torch.int32, device=DEV),
        torch.tensor(lens, dtype=torch.int32, device=DEV), table.to(DEV), d**-0.5,
        max(a for a, _ in shapes), ks, vs, window=window, sinks=None if s is None else s.to(DEV),
        config={"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2, "PACK": 2}
        if pack else None)
    ref = paged_attention_ref(q.double(), cache if fp8 else cache.double(), qsl, lens, table,
                              d**-0.5, k_scale=ks, v_scale=vs, window=window, sinks=s)
    assert torch.isfinite(out).all()
    assert (out.cpu().double() - ref.double()).norm() / ref.norm() < 1e-5


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window", [0, 128])
def test_bf16_kernels_gpt_oss_shape(window):
    """gpt-oss's heads (64 x 8 of 64) in bf16 with sinks, decode and prefill."""
    shapes = [(1, 300), (1, 1000), (200, 700), (64, 64)]
    q, cache, table, qsl, lens, ks, vs = _setup(shapes, 16, 64, 8, 64, torch.bfloat16, 7)
    s = torch.randn(64, generator=torch.Generator().manual_seed(5))
    lens_t = torch.tensor(lens, dtype=torch.int32)
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    from skyline.ops.attention import paged_attention

    out = paged_attention(q.cuda(), cache.cuda(), qsl, lens, table.cuda(), 0.125, num_decodes=2,
                          seq_lens_tensor=lens_t.cuda(), query_start_loc_tensor=qsl_t.cuda(),
                          window=window, sinks=s.cuda().bfloat16())
    ref = paged_attention_ref(q.double(), cache.double(), qsl, lens, table, 0.125,
                              num_decodes=2, window=window, sinks=s.bfloat16())
    assert (out.cpu().double() - ref).norm() / ref.norm() < 1e-2


@pytest.mark.parametrize("sinks", [False, True])
def test_reference_in_query_chunks(monkeypatch, sinks):
    """attend_ref bounds the scores it holds by running queries in chunks: same result."""
    from skyline.ops import attention_ref

    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(4, 50, 16, generator=g), torch.randn(2, 50, 16, generator=g),
               torch.randn(2, 50, 16, generator=g))
    s = torch.randn(4, generator=g) if sinks else None
    mask = attention_ref.causal_mask(0, 50, 7, "cpu")
    whole = [attention_ref.attend_ref(q, k, v, m, 0.25, s, causal=True) for m in (None, mask)]
    monkeypatch.setattr(attention_ref, "ATTEND_CHUNK", 4 * 50 * 7)  # 7 queries a chunk
    for m, want in zip((None, mask), whole, strict=True):
        got = attention_ref.attend_ref(q, k, v, m, 0.25, s, causal=True)
        assert (got - want).abs().max() < 1e-5
