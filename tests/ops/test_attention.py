"""paged_attention_ref and write_kv_ref against dense causal attention (float64 math), with
caches of the model dtype and fp8 caches with per-layer scales."""

from __future__ import annotations

import math

import pytest
import torch

from skyline.ops.attention import SMALL_EXTEND, paged_attention_ref
from skyline.ops.kv_quant import FP8_DTYPE, dequantize_kv, quantize_kv
from skyline.ops.kv_write import write_kv_ref


def _dense_ref(q, k, v, scale):
    """q [q_len, H, D] are the last q_len positions of k/v [n, KVH, D]; causal."""
    q_len, num_heads, _ = q.shape
    n, kvh, _ = k.shape
    k = k.double().repeat_interleave(num_heads // kvh, dim=1)  # [n, H, D]
    v = v.double().repeat_interleave(num_heads // kvh, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale  # [H, q_len, n]
    qpos = torch.arange(n - q_len, n)[:, None]
    scores = scores.masked_fill(torch.arange(n)[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _run_case(seqs, num_heads, num_kv_heads, head_dim, block_size, seed, dtype=torch.float32,
              cache_dtype=None, k_scale=1.0, v_scale=1.0):
    """seqs: list of (context_len_before_step, q_len); decodes (q_len 1) must come first.
    Returns the largest error against dense attention over the unquantized K/V."""
    cache_dtype = cache_dtype or dtype
    g = torch.Generator().manual_seed(seed)
    num_decodes = 0
    while num_decodes < len(seqs) and seqs[num_decodes][1] == 1:
        num_decodes += 1
    blocks_per_seq = [math.ceil((c + n) / block_size) for c, n in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    kv_cache = kv_cache.to(cache_dtype)  # stale garbage everywhere not written
    max_blocks = max(blocks_per_seq)
    block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    qs, ks, vs, slots, loc, seq_lens = [], [], [], [], [0], []
    full_k, full_v = [], []
    for i, (ctx, q_len) in enumerate(seqs):
        n = ctx + q_len
        table = perm[: blocks_per_seq[i]]
        perm = perm[blocks_per_seq[i]:]
        block_tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        k = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        pos = torch.arange(n)
        seq_slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        # the context is already cached; this step writes only the new tokens
        write_kv_ref(k[:ctx], v[:ctx], kv_cache, seq_slots[:ctx], k_scale, v_scale)
        qs.append(torch.randn(q_len, num_heads, head_dim, generator=g).to(dtype))
        ks.append(k[ctx:])
        vs.append(v[ctx:])
        slots.append(seq_slots[ctx:])
        loc.append(loc[-1] + q_len)
        seq_lens.append(n)
        full_k.append(k)
        full_v.append(v)
    q = torch.cat(qs)
    write_kv_ref(torch.cat(ks), torch.cat(vs), kv_cache, torch.cat(slots), k_scale, v_scale)
    scale = head_dim**-0.5
    out = paged_attention_ref(q, kv_cache, loc, seq_lens, block_tables, scale, num_decodes,
                              k_scale=k_scale, v_scale=v_scale)
    assert out.shape == q.shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    worst = 0.0
    for i in range(len(seqs)):
        # what the cache holds, read back: exact for a cache of the model dtype
        k_seen = dequantize_kv(quantize_kv(full_k[i], cache_dtype, k_scale), dtype, k_scale)
        v_seen = dequantize_kv(quantize_kv(full_v[i], cache_dtype, v_scale), dtype, v_scale)
        ref = _dense_ref(qs[i], k_seen, v_seen, scale)
        torch.testing.assert_close(out[loc[i]: loc[i + 1]].double(), ref, atol=tol, rtol=tol)
        exact = _dense_ref(qs[i], full_k[i], full_v[i], scale)
        worst = max(worst, (out[loc[i]: loc[i + 1]].double() - exact).abs().max().item())
    return worst


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_prefill_only(num_heads, num_kv_heads, block_size):
    _run_case([(0, 7), (0, 1), (0, 19)], num_heads, num_kv_heads, 16, block_size, seed=1)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("block_size", [2, 8])
def test_decode_only(num_heads, num_kv_heads, block_size):
    _run_case([(5, 1), (0, 1), (17, 1), (8, 1)], num_heads, num_kv_heads, 32, block_size, seed=2)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_mixed_decode_prefill_extend(block_size):
    # two decodes, then a fresh prefill, a prefix-extend, and an extend of one token
    seqs = [(9, 1), (30, 1), (0, 12), (13, 6), (4, 2)]
    _run_case(seqs, 8, 2, 16, block_size, seed=3)


def test_prefix_extend_across_block_boundary():
    _run_case([(7, 5), (16, 16)], 4, 2, 64, 8, seed=4)


def test_bfloat16_cache():
    _run_case([(3, 1), (0, 9), (10, 4)], 8, 4, 16, 4, seed=5, dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_fp8_cache_with_scales(dtype, block_size):
    # K/V ~ N(0, 1): scales that put their amax (~4.5) near 448 / 2, and scales 1.0
    seqs = [(9, 1), (30, 1), (0, 12), (13, 6), (4, 2)]
    for k_scale, v_scale in [(0.02, 0.03), (1.0, 1.0)]:
        err = _run_case(seqs, 8, 2, 16, block_size, seed=6, dtype=dtype, cache_dtype=FP8_DTYPE,
                        k_scale=k_scale, v_scale=v_scale)
        # fp8 rounding of K and V, against the unquantized values (a reader that ignored
        # the scales would be off by a factor of 30 or more)
        assert err < 0.25, err


@pytest.mark.parametrize("seed", range(4))
def test_random_shapes(seed):
    g = torch.Generator().manual_seed(100 + seed)
    r = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))
    num_kv_heads = r(1, 3)
    num_heads = num_kv_heads * r(1, 4)
    num_dec, num_pre = r(0, 3), r(0, 3)
    seqs = [(r(0, 40), 1) for _ in range(num_dec)] + [(r(0, 20), r(2, 20)) for _ in range(num_pre)]
    seqs = seqs or [(0, 3)]
    _run_case(seqs, num_heads, num_kv_heads, 8 * r(1, 4), 2 ** r(0, 4), seed=seed)


def test_write_kv_ref_places_tokens_at_slots():
    cache = torch.zeros(2, 3, 4, 2, 8)
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([11, 0, 5, 6, 3])
    write_kv_ref(k, v, cache, slots)
    for i, s in enumerate(slots.tolist()):
        torch.testing.assert_close(cache[0, s // 4, s % 4], k[i])
        torch.testing.assert_close(cache[1, s // 4, s % 4], v[i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decodes_of_one_length_and_long_extends(dtype):
    # decodes with equal contexts take the unmasked path; extends, of more than SMALL_EXTEND
    # queries or fewer, torch's masked attention (the small-extend matmuls serve sinks only)
    _run_case([(12, 1), (12, 1), (12, 1)], 8, 2, 16, 4, seed=7, dtype=dtype)
    _run_case([(11, 1)], 6, 3, 32, 8, seed=8, dtype=dtype)
    _run_case([(10, SMALL_EXTEND + 6), (30, SMALL_EXTEND), (5, 3)], 8, 2, 16, 16, seed=9,
              dtype=dtype)
