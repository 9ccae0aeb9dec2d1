"""The Triton rotary kernel (in place on q/k views of one qkv tensor, optionally after Qwen3's
per-head q/k RMSNorm) against the PyTorch reference, over head counts (GQA), head sizes, token
counts, dtypes and real cos/sin caches (default and Llama-3 scaling). Runs on CUDA, or in
Triton's interpreter on CPU (small sizes; see tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from skyline.model.layers.rotary import RotaryEmbedding  # noqa: E402
from skyline.ops.rotary import (  # noqa: E402
    qk_norm_rotary,
    qk_norm_rotary_ref,
    rotary_embedding,
    rotary_embedding_ref,
    rotary_triton,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CUDA_ONLY = pytest.mark.skipif(DEV == "cpu", reason="large sweep: CUDA only")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# The reference rounds each product to the dtype, the kernel only the result, so where the two
# products cancel they differ by units in the last place of the *inputs*: in 16-bit dtypes the
# absolute tolerance scales with the largest value. (On CPU, Triton's interpreter also
# truncates float32 -> bfloat16 where the GPU rounds to nearest.)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=256)
MAX_POS = 2048
# (num_heads, num_kv_heads, head_dim): MHA, GQA, a head_dim whose half is not a power of two
HEADS = [(4, 4, 16), (8, 2, 64), (6, 2, 80)] + [
    pytest.param(*h, marks=CUDA_ONLY) for h in ((32, 8, 128), (40, 8, 128), (64, 8, 128))]
TOKENS = [1, 5, 19] + [pytest.param(n, marks=CUDA_ONLY) for n in (37, 100, 1000)]


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = TOL[want.dtype]
    atol = tol if want.dtype == torch.float32 else tol * want.abs().amax().item()
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=tol)


def qkv_views(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
              dtype: torch.dtype, seed: int = 0):
    # q, k, v as views of one [T, (H + 2 * KVH) * D] tensor, as the attention layer splits it
    g = torch.Generator().manual_seed(seed + num_tokens * 31 + head_dim)
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    qkv = (torch.randn(num_tokens, sum(sizes), generator=g) * 2).to(DEV, dtype)
    q, k, v = qkv.split(sizes, dim=-1)
    positions = torch.randint(0, MAX_POS, (num_tokens,), generator=g).to(DEV)
    positions[0] = MAX_POS - 1
    return (qkv, q.unflatten(-1, (num_heads, head_dim)), k.unflatten(-1, (num_kv_heads, head_dim)),
            v, positions)


def cache_of(head_dim: int, scaling: dict | None) -> torch.Tensor:
    with torch.device(DEV):
        return RotaryEmbedding(head_dim, MAX_POS, 500000.0, scaling).cos_sin_cache


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", HEADS)
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [False, True], ids=["rope", "qknorm_rope"])
def test_rotary_in_place_matches_reference(num_heads, num_kv_heads, head_dim, num_tokens, dtype,
                                           norm):
    qkv, q, k, v, positions = qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    cache = cache_of(head_dim, LLAMA3 if head_dim % 32 == 0 else None)
    v_before = v.clone()
    if norm:
        g = torch.Generator().manual_seed(head_dim)
        qw = (torch.rand(head_dim, generator=g) + 0.5).to(DEV, dtype)
        kw = (torch.rand(head_dim, generator=g) + 0.5).to(DEV, dtype)
        want_q, want_k = qk_norm_rotary_ref(positions, q, k, cache, qw, kw, 1e-6)
        got_q, got_k = rotary_triton(positions, q, k, cache, qw, kw, 1e-6)
    else:
        want_q, want_k = rotary_embedding_ref(positions, q, k, cache)
        got_q, got_k = rotary_triton(positions, q, k, cache)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    close(q, want_q)
    close(k, want_k)
    assert torch.equal(v, v_before)  # the v part of the row is not touched


@pytest.mark.parametrize("config", [dict(BLOCK_H=1, num_warps=1), dict(BLOCK_H=2, num_warps=2),
                                    dict(BLOCK_H=4, num_warps=4), dict(BLOCK_H=16, num_warps=4)])
def test_launch_configs_agree(config):
    # head blocks that split q's and k's heads unevenly, and larger than both
    qkv, q, k, v, positions = qkv_views(6, 6, 2, 32, torch.float32, seed=1)
    cache = cache_of(32, LLAMA3)
    want_q, want_k = rotary_embedding_ref(positions, q, k, cache)
    rotary_triton(positions, q, k, cache, config=config)
    close(q, want_q)
    close(k, want_k)


def test_contiguous_q_and_k_and_int32_positions():
    _, q, k, _, positions = qkv_views(5, 4, 2, 16, torch.float32, seed=2)
    q, k = q.contiguous(), k.contiguous()
    cache = cache_of(16, None)
    want_q, want_k = rotary_embedding_ref(positions, q, k, cache)
    rotary_triton(positions.int(), q, k, cache)
    close(q, want_q)
    close(k, want_k)


def test_dispatch_on_cpu_is_the_reference():
    _, q, k, _, positions = qkv_views(4, 4, 2, 16, torch.float32, seed=3)
    q, k, positions = q.cpu(), k.cpu(), positions.cpu()
    cache = RotaryEmbedding(16, MAX_POS, 10000.0).cos_sin_cache
    q_before, k_before = q.clone(), k.clone()
    got = rotary_embedding(positions, q, k, cache)
    want = rotary_embedding_ref(positions, q, k, cache)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    qw, kw = torch.rand(16), torch.rand(16)
    got = qk_norm_rotary(positions, q, k, cache, qw, kw, 1e-6)
    want = qk_norm_rotary_ref(positions, q, k, cache, qw, kw, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert torch.equal(q, q_before) and torch.equal(k, k_before)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("norm", [False, True], ids=["rope", "qknorm_rope"])
def test_dispatch_on_cuda_is_in_place_and_graph_safe(norm):
    qkv, q, k, v, positions = qkv_views(16, 32, 8, 128, torch.bfloat16, seed=4)
    cache = cache_of(128, LLAMA3)
    w = torch.rand(2, 128, device=DEV, dtype=torch.bfloat16) + 0.5

    def apply(q, k, pos):
        if norm:
            return qk_norm_rotary(pos, q, k, cache, w[0], w[1], 1e-6)
        return rotary_embedding(pos, q, k, cache)

    def ref(q, k, pos):
        if norm:
            return qk_norm_rotary_ref(pos, q, k, cache, w[0], w[1], 1e-6)
        return rotary_embedding_ref(pos, q, k, cache)

    want_q, want_k = ref(q, k, positions)
    got_q, got_k = apply(q, k, positions)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    close(q, want_q)
    close(k, want_k)
    # Captured once, replayed on new data and positions.
    static_qkv, static_pos = torch.zeros_like(qkv), torch.zeros_like(positions)
    sq = static_qkv[:, : 32 * 128].unflatten(-1, (32, 128))
    sk = static_qkv[:, 32 * 128: 40 * 128].unflatten(-1, (8, 128))
    apply(sq, sk, static_pos)  # warm-up (compilation) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        apply(sq, sk, static_pos)
    qkv2, q2, k2, _, pos2 = qkv_views(16, 32, 8, 128, torch.bfloat16, seed=5)
    want_q, want_k = ref(q2, k2, pos2)
    static_qkv.copy_(qkv2)
    static_pos.copy_(pos2)
    graph.replay()
    close(sq, want_q)
    close(sk, want_k)


@pytest.mark.parametrize("norm", [False, True], ids=["rope", "qknorm_rope"])
@pytest.mark.parametrize("fp8", [False, True], ids=["model_dtype_cache", "fp8_cache"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,config", [
    (4, 2, 16, None), (6, 2, 32, dict(BLOCK_H=1, num_warps=1)), (8, 8, 16, None)])
def test_rotary_with_kv_write_equals_rotary_then_write_kv(norm, fp8, num_heads, num_kv_heads,
                                                          head_dim, config):
    # One launch (rope + the cache write of k and v) against two (rope, then write_kv's
    # kernel): the same q and k, the same cache bytes, fp8 caches scaled and saturated alike.
    from skyline.ops.kv_quant import FP8_DTYPE
    from skyline.ops.kv_write import KVWrite, write_kv_triton

    page, num_blocks, num_tokens = 4, 7, 9
    g = torch.Generator().manual_seed(head_dim + num_heads)
    slots = torch.randperm(num_blocks * page, generator=g)[:num_tokens].to(DEV)
    cos_sin = cache_of(head_dim, LLAMA3 if head_dim % 32 == 0 else None)
    w = (torch.rand(2, head_dim, generator=g) + 0.5).to(DEV)
    scales = (2**-4, 2**-6) if fp8 else (1.0, 1.0)
    runs = []
    for fused in (False, True):
        qkv, q, k, v, positions = qkv_views(num_tokens, num_heads, num_kv_heads, head_dim,
                                            torch.float32, seed=5)
        v = v.unflatten(-1, (num_kv_heads, head_dim))
        v[0, 0, :2] = 1e4  # beyond the fp8 range at these scales: saturates
        kv_cache = torch.zeros(2, num_blocks, page, num_kv_heads, head_dim, device=DEV,
                               dtype=FP8_DTYPE if fp8 else torch.float32)
        kv = KVWrite(v, kv_cache, slots, *scales) if fused else None
        args = (w[0], w[1], 1e-6) if norm else (None, None, 0.0)
        rotary_triton(positions, q, k, cos_sin, *args, config=config, kv=kv)
        if not fused:
            write_kv_triton(k, v, kv_cache, slots, *scales)
        runs.append((qkv, kv_cache.view(torch.uint8) if fp8 else kv_cache))
    (qkv_a, cache_a), (qkv_b, cache_b) = runs
    assert torch.equal(qkv_a, qkv_b)
    assert torch.equal(cache_a, cache_b)
    assert cache_b.float().abs().sum() > 0


def test_dispatch_on_cpu_writes_the_cache_with_kv():
    # CPU: the references rotate, then write_kv_ref stores k (rotated) and v
    from skyline.ops.kv_write import KVWrite, write_kv_ref

    _, q, k, v, positions = qkv_views(3, 4, 2, 16, torch.float32, seed=6)
    q, k, positions = q.cpu(), k.cpu(), positions.cpu()
    v = v.cpu().unflatten(-1, (2, 16))
    cos_sin = RotaryEmbedding(16, MAX_POS, 10000.0).cos_sin_cache
    slots = torch.tensor([5, 0, 9])
    got_cache = torch.zeros(2, 3, 4, 2, 16)
    got_q, got_k = rotary_embedding(positions, q, k, cos_sin,
                                    kv=KVWrite(v, got_cache, slots))
    want_q, want_k = rotary_embedding_ref(positions, q, k, cos_sin)
    want_cache = torch.zeros(2, 3, 4, 2, 16)
    write_kv_ref(want_k, v, want_cache, slots)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(got_cache, want_cache)
